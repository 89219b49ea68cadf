"""``echo`` on ``/v1/completions`` (`tokentrail.server.echo`): the prompt before the
completion, with its tokens' logprobs when ``logprobs`` is asked.

On a real `tokentrail serve` (the demo model, MLX) through the official `openai` client:
the prompt's logprobs come from one forward pass over the prompt, the completion's from
the batch's decoding, so the two are checked against each other. A greedy completion's
tokens, sent back as the prompt with ``echo``, get the logprobs they were generated with
and are each their position's most likely token (what lm-evaluation-harness's
``local-completions`` reads as ``is_greedy``). Streaming gives the same text and lists as
the whole response. Through the proxy (llama-server has no prompt logprobs to give)
``echo`` with ``logprobs`` is a 400 naming ``echo``, and ``echo`` alone works.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.env import require

openai = require("openai")
require("uvicorn")

from tests.helpers.responses import extension_ids  # noqa: E402
from tests.helpers.servers import Server, start_llama_server, start_server  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "src" / "tokentrail" / "demo_model"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(None, tmp_path_factory.mktemp("logs") / "echo.log")
    yield srv
    srv.stop()


def _ask(server: Server, prompt: Any, **options: Any) -> Any:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    return client.completions.create(model=server.model, prompt=prompt, temperature=0, **options)


def test_a_greedy_completion_echoed_back_has_its_own_logprobs(server: Server) -> None:
    prompt = [400, 401, 402, 403]
    made = _ask(server, prompt, max_tokens=6, logprobs=3).choices[0]
    generated = extension_ids(_ask(server, prompt, max_tokens=6, logprobs=3))
    assert len(generated) == len(made.logprobs.tokens) == 6

    echoed = _ask(server, prompt + generated, max_tokens=1, logprobs=3, echo=True).choices[0]
    lp = echoed.logprobs
    n = len(prompt) + len(generated)
    assert len(lp.tokens) == n + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[len(prompt) : n] == made.logprobs.tokens
    # teacher-forced in one forward pass = generated step by step in the batch
    assert lp.token_logprobs[len(prompt) : n] == pytest.approx(
        made.logprobs.token_logprobs, abs=2e-3
    )
    for token, top, mine in zip(
        lp.tokens[len(prompt) : n], lp.top_logprobs[len(prompt) : n], made.logprobs.top_logprobs,
        strict=True,
    ):  # fmt: skip
        assert max(top, key=top.get) == token  # greedy: each is its position's likeliest
        assert len(top) <= 3 and top[token] == pytest.approx(mine[token], abs=2e-3)
    # the prompt's own tokens: each logprob within its alternatives' range, never above
    # the likeliest one's
    for token, value, top in zip(lp.tokens[1 : len(prompt)], lp.token_logprobs[1 : len(prompt)],
                                 lp.top_logprobs[1 : len(prompt)], strict=True):  # fmt: skip
        assert value <= max(top.values()) + 1e-6
        if token in top:
            assert top[token] == pytest.approx(value)


def test_the_text_is_the_prompt_and_the_completion(server: Server) -> None:
    plain = _ask(server, PROMPT, max_tokens=5).choices[0]
    echoed = _ask(server, PROMPT, max_tokens=5, echo=True).choices[0]
    assert echoed.text == PROMPT + plain.text and echoed.logprobs is None
    with_lp = _ask(server, PROMPT, max_tokens=5, echo=True, logprobs=1).choices[0]
    lp = with_lp.logprobs
    assert with_lp.text == echoed.text
    # every offset points at its token's text within the echoed text
    for token, at in zip(lp.tokens, lp.text_offset, strict=True):
        assert with_lp.text[at:].startswith(token)
    assert lp.text_offset == sorted(lp.text_offset)


def test_streamed_as_whole(server: Server) -> None:
    options = {"max_tokens": 5, "echo": True, "logprobs": 2}
    whole = _ask(server, PROMPT, **options).choices[0]
    chunks = list(_ask(server, PROMPT, stream=True, **options))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        streamed = [v for c in chunks for v in getattr(c.choices[0].logprobs, key)]
        assert streamed == getattr(whole.logprobs, key), key


def test_echo_must_be_a_boolean(server: Server) -> None:
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 2, "echo": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_through_the_proxy_the_text_is_echoed_and_prompt_logprobs_refused(
    demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    logs = tmp_path_factory.mktemp("logs")
    llama = start_llama_server(demo_gguf, logs / "llama-server.log")
    proxy = start_server(None, logs / "proxy.log", "--upstream", llama.url,
                         "--tokenizer", str(DEMO))  # fmt: skip
    try:
        plain = _ask(proxy, PROMPT, max_tokens=4).choices[0]
        echoed = _ask(proxy, PROMPT, max_tokens=4, echo=True).choices[0]
        assert echoed.text == PROMPT + plain.text
        alone = _ask(proxy, PROMPT, max_tokens=0, echo=True)  # the upstream is not asked
        assert alone.choices[0].text == PROMPT and alone.choices[0].finish_reason == "length"
        assert alone.usage.completion_tokens == 0
        body = {"model": proxy.model, "prompt": PROMPT, "max_tokens": 2, "echo": True,
                "logprobs": 1}  # fmt: skip
        r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "echo" and "logprobs" in error["message"]
    finally:
        proxy.stop()
        llama.stop()


def test_max_tokens_0_returns_the_prompt_scored_and_generates_nothing(server: Server) -> None:
    """OpenAI's legacy way to score a text (HELM, older lm-evaluation-harness): ``echo``
    with ``max_tokens`` 0. The prompt's entries are those of the same prompt echoed
    before a completion (checked against the batch's decoding above)."""
    prompt = [400, 401, 402, 403, 404]
    scored = _ask(server, prompt, max_tokens=0, logprobs=3, echo=True)
    choice = scored.choices[0]
    before = _ask(server, prompt, max_tokens=1, logprobs=3, echo=True).choices[0]
    n = len(prompt)
    assert choice.finish_reason == "length"
    assert scored.usage.prompt_tokens == n and scored.usage.completion_tokens == 0
    assert before.text.startswith(choice.text) and len(choice.logprobs.tokens) == n
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert getattr(choice.logprobs, key) == getattr(before.logprobs, key)[:n], key
    assert scored.model_extra["tokentrail"]["segments"] == []
    # logprobs 0 (HELM's request): each token's own logprob, no alternatives
    zero = _ask(server, PROMPT, max_tokens=0, logprobs=0, echo=True).choices[0]
    assert zero.text == PROMPT and zero.logprobs.token_logprobs[0] is None
    assert all(isinstance(v, float) for v in zero.logprobs.token_logprobs[1:])
    assert all(top == {} for top in zero.logprobs.top_logprobs[1:])
    plain = _ask(server, PROMPT, max_tokens=0, echo=True).choices[0]
    assert plain.text == PROMPT and plain.logprobs is None and plain.finish_reason == "length"


def test_max_tokens_0_streamed_and_with_several_choices(server: Server) -> None:
    options = {"max_tokens": 0, "echo": True, "logprobs": 2}
    whole = _ask(server, PROMPT, **options)
    chunks = list(_ask(server, PROMPT, stream=True, stream_options={"include_usage": True},
                       **options))  # fmt: skip
    texts = [c for c in chunks if c.choices]
    assert len(texts) == 1 and texts[0].choices[0].text == PROMPT
    assert texts[0].choices[0].finish_reason == "length"
    assert texts[0].choices[0].logprobs.token_logprobs == whole.choices[0].logprobs.token_logprobs
    assert chunks[-1].usage.completion_tokens == 0
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    two = _ask(server, [PROMPT, "Two prompts"], max_tokens=0, echo=True)
    assert [c.text for c in two.choices] == [PROMPT, "Two prompts"]
    n2 = _ask(server, PROMPT, max_tokens=0, echo=True, n=2)
    assert [c.text for c in n2.choices] == [PROMPT, PROMPT]
    assert n2.usage.completion_tokens == 0


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": False}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1, "echo": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 0}),
    ],
)
def test_max_tokens_0_needs_echo(server: Server, path: str, body: dict[str, Any]) -> None:
    r = httpx.post(server.url + path, json={"model": server.model, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "max_tokens"
