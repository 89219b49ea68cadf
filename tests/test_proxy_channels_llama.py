"""llama-server's own chat channels through `tokentrail serve --upstream URL --upstream-chat`
(issue 18 §5): its Jinja template, its tool handling and its tool-call parser run
upstream; the proxy attributes the answer per token.

llama-server (``--jinja``) refuses logprobs on a streamed request with tools ("logprobs
is not supported with tools + stream"), so the proxy sends such a request whole and
streams the answer on; the oracle is the same request straight to llama-server (its
text, its logprobs' token ids).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.helpers.env import require
from tests.helpers.llamacpp import find_smollm2, llama_server_binary
from tests.helpers.net import free_port
from tests.helpers.servers import Server, launch, start_server

require("uvicorn")
openai = require("openai")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
#: A grammar that makes SmolLM2 write DeepSeek's markers (it never does on its own).
THINK = 'root ::= "<think>" [a-z ]{5,30} "</think>" [A-Za-z ]{3,30}'


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    gguf = find_smollm2()
    port = free_port()
    cmd = [str(llama_server_binary()), "-m", str(gguf), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "-c", "2048", "-np", "1", "-t", "2", "--no-webui", "--jinja"]
    cmd += ["--reasoning-format", "deepseek"]
    log = tmp_path_factory.mktemp("logs") / "llama.log"
    server = launch(cmd, log, f"http://127.0.0.1:{port}", timeout=120)
    server.model_dir = gguf
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(llama: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "proxy.log"
    args = ("--upstream", llama.url, "--tokenizer", str(llama.model_dir), "--upstream-chat")
    server = start_server(None, log, *args)
    yield server
    server.stop()


def direct(llama: Server, **body: Any) -> dict[str, Any]:
    r = httpx.post(
        llama.url + "/v1/chat/completions",
        json={"messages": MESSAGES, "tools": TOOLS, "temperature": 0, "logprobs": True, **body},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return dict(r.json()["choices"][0])


def streamed(proxy: Server, **kw: Any) -> list[Any]:
    c = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    return list(
        c.chat.completions.create(
            model=proxy.model, messages=MESSAGES, tools=TOOLS, temperature=0, stream=True,
            logprobs=True, **kw,
        )
    )  # fmt: skip


def segments(chunks: list[Any]) -> list[dict[str, Any]]:
    return [
        s for c in chunks for s in (c.model_extra.get("tokentrail") or {}).get("segments") or []
    ]


def joined(segs: list[dict[str, Any]], channel: str) -> bytes:
    return b"".join(
        bytes(t["bytes"])[t["start"] : t["end"]]
        for s in segs
        if s["channel"] == channel
        for t in s["tokens"]
    )


def test_a_request_with_tools_is_llamas_own_answer_attributed(proxy: Server, llama: Server) -> None:
    own = direct(llama, max_tokens=12)
    chunks = streamed(proxy, max_tokens=12)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == (own["message"].get("content") or "")
    segs = segments(chunks)
    assert joined(segs, "content").decode() == content
    # The ids are llama-server's own (its logprobs entries carry them), each listed once.
    listed = {t["index"]: t["id"] for s in segs for t in s["tokens"] or []}
    assert [listed[k] for k in sorted(listed)] == [e["id"] for e in own["logprobs"]["content"]]
    assert chunks[-1].choices[0].finish_reason == own["finish_reason"]


def test_a_forced_tool_call_is_listed_as_its_raw_text(proxy: Server, llama: Server) -> None:
    own = direct(llama, max_tokens=80, tool_choice="required")
    if not own["message"].get("tool_calls"):
        pytest.skip(
            "this llama-server build does not force a call for SmolLM2 with tool_choice "
            f"'required' (it answered text: {str(own['message'].get('content'))[:60]!r})"
        )
    chunks = streamed(proxy, max_tokens=80, tool_choice="required")
    pieces = [p for c in chunks if c.choices for p in c.choices[0].delta.tool_calls or []]
    call = own["message"]["tool_calls"][0]
    assert pieces and pieces[0].function.name == call["function"]["name"]
    raw = joined(segments(chunks), "tool_call").decode()
    # The raw text holds the name and the arguments the upstream parsed out of it.
    assert call["function"]["name"] in raw
    args = json.loads(call["function"]["arguments"])
    decoder = json.JSONDecoder()
    found = []
    for k, ch in enumerate(raw):
        if ch == "{":
            try:
                found.append(decoder.raw_decode(raw, k)[0])
            except ValueError:
                continue
    assert args in found or any(args == v.get("arguments") for v in found if isinstance(v, dict))


def test_llama_reasoning_format_deepseek_channels(proxy: Server, llama: Server) -> None:
    body = {"messages": MESSAGES, "grammar": THINK, "temperature": 0, "max_tokens": 40}
    own = httpx.post(llama.url + "/v1/chat/completions", json=body, timeout=300).json()
    message = own["choices"][0]["message"]
    if not message.get("reasoning_content"):
        pytest.skip(
            "llama-server's --reasoning-format deepseek leaves <think>...</think> in the "
            "content for SmolLM2's template (its content-only chat format parses no "
            f"reasoning): content {str(message.get('content'))[:40]!r}"
        )
    c = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    chunks = list(
        c.chat.completions.create(
            model=proxy.model, messages=MESSAGES, temperature=0, stream=True, logprobs=True,
            max_tokens=40, extra_body={"grammar": THINK},
        )
    )  # fmt: skip
    segs = segments(chunks)
    assert joined(segs, "reasoning").decode() == message["reasoning_content"]
    assert joined(segs, "content").decode() == (message.get("content") or "")
    assert "<think>" in joined(segs, "markup").decode()


def test_upstream_chat_without_upstream_exits_2_with_one_line() -> None:
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "tokentrail",
        "serve",
        "--port",
        str(free_port()),
        "--upstream-chat",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "--upstream-chat needs --upstream" in proc.stderr
