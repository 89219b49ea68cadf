"""llama-server's and mlx_lm.server's own request fields (`tokentrail.server.llamacpp_fields`,
`tokentrail.server.mlx_fields`), as their users send them through the official `openai`
client's ``extra_body``.

The oracle is llama-server itself (llama.cpp's own server on SmolLM2-135M-Instruct's
GGUF): the same chat request with the same llama.cpp fields, sent to it and to
tokentrail, gets the same reply (text, token count, finish reason, and with ``n_probs``
the same alternatives), on the proxy in front of that llama-server and on `tokentrail
serve --engine llamacpp` on the same GGUF. Every field's effect is checked against the
request without it (it changed the answer), refusals by name on the demo model's server,
and a client that sends llama.cpp's every sampler setting at its default (as SillyTavern
and Open WebUI do) is served the answer it gets without them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.env import require

openai = require("openai")
require("uvicorn")

from tests.helpers.net import free_port  # noqa: E402
from tests.helpers.servers import (  # noqa: E402
    STARTUP_TIMEOUT,
    Server,
    launch,
    start_llama_server,
    start_proxy,
    start_server,
)

ASK = [{"role": "user", "content": "List five fruits, one per line."}]
#: A prompt SmolLM2 answers with repeats (where a repeat penalty changes the reply).
REPEATS = [{"role": "user", "content": "Write the word 'apple' ten times, one per line."}]
#: llama.cpp's sampler settings at llama-server's defaults (`common_params_sampling`),
#: as clients that expose every setting send them.
AT_DEFAULTS = {
    "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "typical_p": 1.0,
    "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 64,
    "dry_sequence_breakers": ["\n", ":", "\"", "*"], "xtc_probability": 0.0,
    "xtc_threshold": 0.1, "top_n_sigma": -1.0, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
    "min_keep": 0, "repeat_last_n": 64, "repeat_penalty": 1.0, "n_probs": 0,
    "cache_prompt": True, "id_slot": -1, "n_keep": 0, "timings_per_token": False,
    "return_tokens": False, "post_sampling_probs": False, "t_max_predict_ms": 0, "n_indent": 0,
    "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                 "temperature"],
}  # fmt: skip


@pytest.fixture(scope="module")
def llama(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_llama_server(smollm2_gguf, tmp_path_factory.mktemp("logs") / "llama.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module", params=["proxy", "engine"])
def ours(
    request: pytest.FixtureRequest, llama: Server, smollm2_gguf: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Server]:  # fmt: skip
    """The proxy in front of `llama`, or `serve --engine llamacpp` on the same GGUF."""
    log = tmp_path_factory.mktemp("logs") / f"{request.param}.log"
    if request.param == "proxy":
        srv = start_proxy(llama, log)
    else:
        port = free_port()
        cmd = [sys.executable, "-m", "tokentrail", "serve", "--engine", "llamacpp", "--model",
               str(smollm2_gguf), "--n-ctx", "2048", "--port", str(port),
               "--log-level", "warning"]  # fmt: skip
        srv = launch(cmd, log, f"http://127.0.0.1:{port}", timeout=STARTUP_TIMEOUT)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(None, tmp_path_factory.mktemp("logs") / "demo.log")
    yield srv
    srv.stop()


def _chat(url: str, body: dict[str, Any], messages: list[dict[str, Any]] = ASK) -> Any:
    """The chat answer to `body` (greedy unless it says otherwise), through the `openai`
    client's ``extra_body`` as a llama-server user sends its own fields."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    body = {"temperature": 0, **body}
    known = {k: body.pop(k) for k in ("temperature", "max_tokens", "logprobs") if k in body}
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=messages, extra_body=body,
                                          **known)  # fmt: skip


def _reply(answer: Any) -> tuple[str, int, str]:
    c = answer.choices[0]
    return c.message.content, answer.usage.completion_tokens, c.finish_reason


@pytest.mark.parametrize(
    ("body", "without"),
    [
        ({"max_tokens": 3, "n_predict": 9}, {"max_tokens": 3}),
        ({"n_predict": -1, "max_tokens": 3}, {"max_tokens": 3}),
        ({"repeat_penalty": 1.5, "max_tokens": 40}, {"max_tokens": 40}),
    ],
    ids=["n_predict", "n_predict_unlimited", "repeat_penalty"],
)
def test_llama_servers_fields_answer_as_llama_server_answers(
    ours: Server, llama: Server, body: dict[str, Any], without: dict[str, Any]
) -> None:
    messages = REPEATS if "repeat_penalty" in body else ASK
    theirs = _reply(_chat(llama.url, dict(body), messages))
    mine = _reply(_chat(ours.url, dict(body), messages))
    assert mine == theirs
    assert _reply(_chat(ours.url, dict(without), messages)) != mine  # the field did something


def test_n_probs_lists_llama_servers_alternatives(ours: Server, llama: Server) -> None:
    """``n_probs`` alone (no ``logprobs``): llama-server answers with logprobs and that
    many alternatives per token; so does tokentrail, the same ones."""
    body = {"n_probs": 3, "max_tokens": 6}
    theirs, mine = _chat(llama.url, dict(body)), _chat(ours.url, dict(body))
    assert _reply(mine) == _reply(theirs)
    t_rows, m_rows = theirs.choices[0].logprobs.content, mine.choices[0].logprobs.content
    assert [r.token for r in m_rows] == [r.token for r in t_rows]
    for t, m in zip(t_rows, m_rows, strict=True):
        assert len(m.top_logprobs) == 3
        assert [a.token for a in m.top_logprobs] == [a.token for a in t.top_logprobs]
        assert m.logprob == pytest.approx(t.logprob, abs=0.02)
    assert _chat(ours.url, {"max_tokens": 6}).choices[0].logprobs is None


def test_every_sampler_setting_at_llama_servers_default_is_served(
    ours: Server, llama: Server
) -> None:
    plain = _reply(_chat(ours.url, {"max_tokens": 16}))
    assert _reply(_chat(ours.url, {"max_tokens": 16, **AT_DEFAULTS})) == plain
    assert _reply(_chat(llama.url, {"max_tokens": 16, **AT_DEFAULTS})) == plain


REFUSED = [
    ("mirostat", {"mirostat": 2}),
    ("typical_p", {"typical_p": 0.5}),
    ("dry_multiplier", {"dry_multiplier": 0.8}),
    ("xtc_probability", {"xtc_probability": 0.5, "temperature": 1.0}),
    ("top_n_sigma", {"top_n_sigma": 1.5}),
    ("dynatemp_range", {"dynatemp_range": 0.5}),
    ("min_keep", {"min_keep": 5}),
    ("lora", {"lora": [{"id": 0, "scale": 1.0}]}),
    ("post_sampling_probs", {"post_sampling_probs": True}),
    ("grammar_lazy", {"grammar_lazy": True}),
    ("samplers", {"samplers": ["top_p", "top_k", "temperature"]}),
    ("samplers", {"samplers": ["top_p", "temperature"], "top_k": 40, "temperature": 0.7}),
    ("samplers", {"samplers": "kpmq"}),
    ("repeat_last_n", {"repeat_last_n": 16, "repeat_penalty": 1.2}),
    ("repeat_penalty", {"repeat_penalty": 1.2, "repetition_penalty": 1.3}),
    ("repeat_penalty", {"repeat_penalty": 0}),
    ("n_cmpl", {"n_cmpl": 2, "n": 3}),
    ("n_probs", {"n_probs": 3, "logprobs": True, "top_logprobs": 2}),
    ("n_predict", {"n_predict": 0}),
    ("n_predict", {"n_predict": "5"}),
    ("reasoning_format", {"reasoning_format": "deepseek-legacy"}),
    ("repetition_context_size", {"repetition_context_size": 5, "repetition_penalty": 1.2}),
    ("adapters", {"adapters": "my-lora"}),
    ("draft_model", {"draft_model": "small"}),
]


@pytest.mark.parametrize(("field", "body"), REFUSED, ids=[f"{f}-{i}" for i, (f, _) in
                                                         enumerate(REFUSED)])  # fmt: skip
def test_fields_not_honoured_are_refused_by_name(
    demo: Server, field: str, body: dict[str, Any]
) -> None:
    r = httpx.post(demo.url + "/v1/chat/completions",
                   json={"messages": ASK, "max_tokens": 4, **body}, timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert f"'{field}'" in r.json()["error"]["message"]


def test_settings_of_a_sampler_that_is_off_are_accepted(demo: Server) -> None:
    """A sampler's own settings change nothing while it is off; a sampler switched on
    by them alone is refused."""
    plain = _reply(_chat(demo.url, {"max_tokens": 12}))
    inert = {"mirostat_tau": 3.0, "dry_base": 1.1, "dry_allowed_length": 4,
             "xtc_threshold": 0.3, "dynatemp_exponent": 2.0, "repeat_last_n": 16,
             "num_draft_tokens": 4, "repetition_context_size": 5}  # fmt: skip
    assert _reply(_chat(demo.url, {"max_tokens": 12, **inert})) == plain
    # XTC at a threshold above 0.5 removes nothing (llama.cpp's rule): served.
    assert _reply(_chat(demo.url, {"max_tokens": 12, "xtc_probability": 0.5,
                                   "xtc_threshold": 0.6})) == plain  # fmt: skip


def test_n_cmpl_is_n(demo: Server) -> None:
    got = _chat(demo.url, {"max_tokens": 5, "n_cmpl": 2, "temperature": 1.0, "seed": 3})
    assert [c.index for c in got.choices] == [0, 1]


def test_repeat_penalty_is_repetition_penalty(demo: Server) -> None:
    one = _reply(_chat(demo.url, {"max_tokens": 30, "repeat_penalty": 1.8}, REPEATS))
    assert one == _reply(_chat(demo.url, {"max_tokens": 30, "repetition_penalty": 1.8},
                               REPEATS))  # fmt: skip
    assert one != _reply(_chat(demo.url, {"max_tokens": 30}, REPEATS))


def test_n_probs_on_completions_is_logprobs(demo: Server) -> None:
    client = demo.client()
    got = client.completions.create(model=demo.model, prompt="Once upon", max_tokens=4,
                                    temperature=0, extra_body={"n_probs": 2})  # fmt: skip
    asked = client.completions.create(model=demo.model, prompt="Once upon", max_tokens=4,
                                      temperature=0, logprobs=2)  # fmt: skip
    assert got.choices[0].logprobs.top_logprobs == asked.choices[0].logprobs.top_logprobs
    assert all(len(row) == 2 for row in got.choices[0].logprobs.top_logprobs)
