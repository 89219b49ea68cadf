"""The fixed probes `tokentrail check` sends: each aimed at what breaks streams.

Every probe is a chat request (the check falls back to ``/v1/completions`` with the same
text when the server has no chat template). Greedy where the check compares runs;
seeded where it compares a stream with a whole response. `QUICK` is the subset the
proxy runs at startup.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Probe:
    """One request: `name`, what it aims at, its prompt and its sampling settings."""

    name: str
    aim: str
    prompt: str
    max_tokens: int
    settings: dict[str, Any] = field(default_factory=dict)


MULTIBYTE = Probe(
    "multibyte",
    "multi-byte characters split across tokens",
    "Write the words 你好世界, こんにちは, 안녕하세요 and naïve café, then say what they mean.",
    48,
    {"temperature": 0},
)
EMOJI = Probe(
    "emoji",
    "emoji, often several byte tokens each",
    "Reply with five emoji such as 🎉🚀🧑‍💻🌍🔥 and nothing else.",
    24,
    {"temperature": 0},
)
COUNT = Probe(
    "stop",
    "a stop string that starts inside one token and ends inside the next",
    "Describe the history of mathematics in two sentences.",
    40,
    {"temperature": 0},
)
EOS = Probe("eos", "the end-of-turn token (a special token the content omits)", "Say OK.", 64,
            {"temperature": 0})  # fmt: skip
LONG = Probe(
    "long",
    "a long sampled output, streamed and whole with one seed",
    "Write a long story about a lighthouse keeper and a storm.",
    200,
    {"temperature": 0.8, "seed": 7},
)
CHOICES = Probe("n", "n > 1 choices in one stream", "Name a colour.", 8,
                {"temperature": 1.0, "seed": 3, "n": 2})  # fmt: skip

#: Run in this order by a full check.
FULL = (MULTIBYTE, EMOJI, COUNT, EOS, LONG, CHOICES)
#: The proxy's startup check: short, a few requests.
QUICK = (
    Probe(MULTIBYTE.name, MULTIBYTE.aim, MULTIBYTE.prompt, 20, MULTIBYTE.settings),
    Probe(COUNT.name, COUNT.aim, COUNT.prompt, 24, COUNT.settings),
    EOS,
)

#: Bad requests whose answers must be OpenAI-shaped errors.
BAD_REQUESTS = (
    ("messages not a list", {"messages": "not a list", "max_tokens": 4}),
    ("negative max_tokens", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": -5}),
)

#: A tool the capability probe offers.
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
