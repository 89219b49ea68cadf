"""Several prompts in one ``/v1/completions`` request (`tokentrail.server.prompts`).

OpenAI's completions API takes ``prompt`` as an array of strings or of token-id arrays
and answers every prompt's ``n`` choices in one response, choice ``index`` = prompt
index × n + choice; lm-evaluation-harness's ``local-completions`` sends its batches so.
On a real `tokentrail serve` (the demo model) through the official `openai` client,
each prompt's answer in a request with several is checked against the same prompt
asked alone (greedy: the same text, tokens and logprobs), ``usage`` against the sums of
the single answers, and streaming against the whole response. In front of llama.cpp's
`llama-server`, the proxy's answer to several prompts is checked against llama-server's
own answer to the same request. Refusals name the field; a client that hangs up stops
every prompt's generation, and a request the queue cannot hold is refused whole.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.env import require

openai = require("openai")
require("uvicorn")

from tests.helpers.servers import Server, start_llama_server, start_server  # noqa: E402
from tokentrail.server.prompts import MAX_PROMPTS  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "src" / "tokentrail" / "demo_model"
PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(None, tmp_path_factory.mktemp("logs") / "prompts.log")
    yield srv
    srv.stop()


def _ask(server: Server, prompt: Any, **options: Any) -> Any:
    return server.client().completions.create(
        model=server.model, prompt=prompt, temperature=0, **options
    )


def _ext(choice_or_response: Any) -> dict[str, Any]:
    return (choice_or_response.model_extra or {})["tokentrail"]


def test_each_prompt_answered_as_if_alone(server: Server) -> None:
    options = {"max_tokens": 8, "logprobs": 2}
    alone = [_ask(server, p, **options) for p in PROMPTS]
    both = _ask(server, PROMPTS, n=2, **options)

    assert [c.index for c in both.choices] == list(range(2 * len(PROMPTS)))
    assert len({both.id}) == 1 and both.object == "text_completion"
    for choice in both.choices:
        single = alone[choice.index // 2].choices[0]
        assert choice.text == single.text
        assert choice.finish_reason == single.finish_reason
        assert choice.logprobs.tokens == single.logprobs.tokens
        assert choice.logprobs.token_logprobs == pytest.approx(single.logprobs.token_logprobs)
    # usage: every prompt's tokens once, every choice's completion tokens
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert both.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    assert both.usage.total_tokens == both.usage.prompt_tokens + both.usage.completion_tokens
    # the extension: one per choice, in index order
    exts = _ext(both)["choices"]
    for e, choice in zip(exts, both.choices, strict=True):
        text = "".join(s["text"] for s in e["segments"])
        assert text == choice.text


def test_streamed_as_whole(server: Server) -> None:
    whole = _ask(server, PROMPTS, max_tokens=10)
    chunks = list(
        _ask(server, PROMPTS, max_tokens=10, stream=True, stream_options={"include_usage": True})
    )
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    for chunk in chunks[:-1]:
        assert chunk.id == chunks[0].id and chunk.usage is None
        (c,) = chunk.choices
        assert _ext(chunk)["choice"] == c.index  # several choices: the extension names its
        texts[c.index] = texts.get(c.index, "") + c.text
        if c.finish_reason is not None:
            finish[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == whole.usage.completion_tokens


def test_token_id_prompts(server: Server) -> None:
    ids = [[400, 401, 402], [17, 18], [1000]]
    alone = [_ask(server, p, max_tokens=6) for p in ids]
    several = _ask(server, ids, max_tokens=6)
    assert [c.text for c in several.choices] == [a.choices[0].text for a in alone]
    assert several.usage.prompt_tokens == 6


@pytest.mark.parametrize(
    ("prompt", "extra", "param"),
    [
        (["a"] * (MAX_PROMPTS + 1), {}, "prompt"),
        (["a", ""], {}, "prompt"),
        ([[1, 2], [10**9]], {}, "prompt"),
        (["a", "b"], {"n": 2, "tokentrail": {"vote": "majority"}}, "tokentrail.vote"),
    ],
)
def test_refused_naming_the_field(
    server: Server, prompt: Any, extra: dict[str, Any], param: str
) -> None:
    body = {"model": server.model, "prompt": prompt, "max_tokens": 4, **extra}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def _idle(server: Server, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        health = server.health()
        if (health["active"], health["queued"]) == (0, 0) or time.monotonic() > deadline:
            return health
        time.sleep(0.2)


def test_hang_up_stops_every_prompt(server: Server) -> None:
    body = {"model": server.model, "prompt": PROMPTS, "max_tokens": 400, "stream": True,
            "temperature": 1.0, "logit_bias": {"0": -100, "2": -100}}  # fmt: skip
    before = _idle(server)["generated_tokens"]
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", server.url + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    # the response is closed here, long before 3 x 400 tokens
    health = _idle(server)
    assert (health["active"], health["queued"]) == (0, 0), health
    assert health["generated_tokens"] - before < 3 * 400 / 2  # stopped, not run out


def test_refused_whole_when_the_queue_cannot_hold_it(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    srv = start_server(None, tmp_path_factory.mktemp("logs") / "small.log",
                       "--max-batch", "1", "--max-queue", "1")  # fmt: skip
    try:
        body = {"model": srv.model, "prompt": PROMPTS, "max_tokens": 4}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 429, r.text
        health = _idle(srv)
        assert (health["active"], health["queued"]) == (0, 0), health
        body["prompt"] = PROMPTS[:2]  # the batch's one place and the queue's one
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
    finally:
        srv.stop()


# -- in front of llama-server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_and_proxy(
    demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Server]]:
    logs = tmp_path_factory.mktemp("logs")
    llama = start_llama_server(demo_gguf, logs / "llama-server.log", parallel=3)
    proxy = start_server(None, logs / "proxy.log", "--upstream", llama.url,
                         "--tokenizer", str(DEMO))  # fmt: skip
    yield llama, proxy
    proxy.stop()
    llama.stop()


def test_proxy_answers_as_llama_server_does(llama_and_proxy: tuple[Server, Server]) -> None:
    """The same request, several prompts, to llama-server and through the proxy:
    the same text for every prompt, at the same index."""
    llama, proxy = llama_and_proxy
    body = {"prompt": PROMPTS, "max_tokens": 12, "temperature": 0}
    own = httpx.post(llama.url + "/v1/completions", json=body, timeout=120).json()
    ours = _ask(proxy, PROMPTS, max_tokens=12)
    theirs = sorted((c["index"], c["text"], c["finish_reason"]) for c in own["choices"])
    assert [(c.index, c.text, c.finish_reason) for c in ours.choices] == theirs
    # (llama-server's own `usage` here counts one prompt's tokens, not the request's)
    if all(c.finish_reason == "length" for c in ours.choices):
        assert ours.usage.completion_tokens == 12 * len(PROMPTS)
