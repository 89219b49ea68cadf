"""Branch from any token (``tokentrail.branch``, issue #31 part 3), over real HTTP with
the official `openai` client: a real server on the demo model (MLX), and one on
SmolLM2's GGUF through llama.cpp.

A branch keeps the original reply's first `at` tokens, forces `token` at `at` and
generates after it. Checked: the kept prefix is the original's field by field
(segments, tokens, logprobs, alternatives, text), the continuation is what a plain
greedy completion of prompt + prefix + forced token gives (the oracle: the same server
asked without a branch), the prefix is read from the prompt cache (`cached_tokens`),
and bad ids are 400s naming the position and the key.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.env import require
from tests.helpers.net import free_port
from tests.helpers.servers import STARTUP_TIMEOUT, Server, launch, pick_model_dir, start_server

openai = require("openai")
require("mlx_lm")

MSG = [{"role": "user", "content": "Tell me about Paris."}]
MAX = 16
TOP = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    return pick_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path | None) -> Iterator[Server]:
    srv = start_server(model_dir, tmp_path_factory.mktemp("logs") / "branch.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path | None) -> Any:
    import tokentrail

    return tokentrail.load(None if model_dir is None else str(model_dir))[1]


def _ext(obj: Any) -> dict[str, Any]:
    return obj.model_dump()["tokentrail"]


def _tokens(segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t for s in segments for t in s["tokens"]]


def _before(segments: list[dict[str, Any]], at: int) -> list[dict[str, Any]]:
    """The segments whose tokens all come before position `at`."""
    return [s for s in segments if all(t["index"] < at for t in s["tokens"])]


def _boundary(segments: list[dict[str, Any]], lo: int) -> int:
    """A position >= lo where a segment of the reply starts (a token with alternatives)."""
    for s in segments:
        first = s["tokens"][0] if s["tokens"] else None
        if first is not None and first["index"] >= lo and len(first["top_logprobs"]) > 1:
            return int(first["index"])
    raise AssertionError("no segment boundary past the start")


def _branch(ids: list[int], at: int, token: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"ids": ids, "at": at}
    if token is not None:
        out["token"] = token
    return {"tokentrail": {"branch": out}}


def _chat(client: Any, model: str, **kw: Any) -> Any:
    return client.chat.completions.create(
        model=model, messages=MSG, max_tokens=MAX, temperature=0, logprobs=True,
        top_logprobs=TOP, **kw,
    )  # fmt: skip


def _check_branch(
    original: list[dict[str, Any]],
    branch: list[dict[str, Any]],
    at: int,
    token: int,
    plain_ids: list[int],
) -> None:
    """The prefix is the original's, the forced token sits at `at`, the rest is the
    plain request's continuation."""
    kept = _before(original, at)
    assert kept, "the test needs a prefix that spans whole segments"
    assert branch[: len(kept)] == kept  # segments, tokens, logprobs, top_logprobs, text
    ids = [t["id"] for t in _tokens(branch)]
    assert ids[:at] == [t["id"] for t in _tokens(original)][:at]
    assert ids[at] == token
    assert ids[at + 1 :] == plain_ids
    forced = _tokens(branch)[at]
    listed = {a["id"]: a["logprob"] for a in _tokens(original)[at]["top_logprobs"]}
    assert forced["logprob"] == listed[token]  # the original's distribution at `at`


def test_chat_branch_keeps_the_prefix_and_continues_like_a_plain_request(
    client: Any, server: Server, tokenizer: Any
) -> None:
    from tokentrail.prompting import prompt_ids

    first = _chat(client, server.model)
    original = _ext(first)["segments"]
    ids = [t["id"] for t in _tokens(original)]
    at = _boundary(original, 3)
    alt = _tokens(original)[at]["top_logprobs"][1]["id"]
    assert alt != ids[at]

    got = _chat(client, server.model, extra_body=_branch(ids, at, alt))
    prompt = prompt_ids(tokenizer, MSG, None)
    plain = client.completions.create(
        model=server.model, prompt=prompt + ids[:at] + [alt], max_tokens=MAX - at - 1,
        temperature=0,
    )  # fmt: skip
    plain_ids = [t["id"] for t in _tokens(_ext(plain)["segments"])]
    _check_branch(original, _ext(got)["segments"], at, alt, plain_ids)
    kept_text = "".join(s["text"] for s in _before(original, at))
    assert got.choices[0].message.content.startswith(kept_text)
    usage = got.usage
    assert usage.prompt_tokens == len(prompt)
    assert usage.completion_tokens == MAX
    assert usage.prompt_tokens_details.cached_tokens >= len(prompt) + at

    # A branch of the branch (the page's tree): its prefix is the branch's, replayed from
    # the branch's own records, which hold the first prefix as it was replayed.
    first_branch = _ext(got)["segments"]
    ids2 = [t["id"] for t in _tokens(first_branch)]
    at2 = _boundary(first_branch, at + 1)
    alt2 = _tokens(first_branch)[at2]["top_logprobs"][1]["id"]
    deeper = _ext(_chat(client, server.model, extra_body=_branch(ids2, at2, alt2)))["segments"]
    assert deeper[: len(_before(first_branch, at2))] == _before(first_branch, at2)
    assert _tokens(deeper)[at2]["id"] == alt2


def test_streamed_branch_sends_the_same_prefix_chunk_by_chunk(client: Any, server: Server) -> None:
    first = _chat(client, server.model)
    original = _ext(first)["segments"]
    ids = [t["id"] for t in _tokens(original)]
    at = _boundary(original, 2)
    alt = _tokens(original)[at]["top_logprobs"][-1]["id"]
    whole = _ext(_chat(client, server.model, extra_body=_branch(ids, at, alt)))["segments"]
    segments: list[dict[str, Any]] = []
    text = ""
    for chunk in _chat(client, server.model, stream=True, extra_body=_branch(ids, at, alt)):
        segments += _ext(chunk)["segments"]
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    assert segments == whole
    kept = _before(original, at)
    assert segments[: len(kept)] == kept
    assert text == "".join(s["text"] for s in whole)


def test_completions_branch_and_retry_from_here(client: Any, server: Server) -> None:
    """Completions too; `token` left out samples afresh at `at` (the page's retry)."""
    prompt = "The capital of France is"
    kw = {"model": server.model, "prompt": prompt, "max_tokens": MAX, "logprobs": TOP}
    original = _ext(client.completions.create(temperature=0, **kw))["segments"]
    ids = [t["id"] for t in _tokens(original)]
    at = _boundary(original, 2)
    for seed in (1, 2):
        got = client.completions.create(
            temperature=1.0, seed=seed, extra_body=_branch(ids, at), **kw
        )  # fmt: skip
        segments = _ext(got)["segments"]
        assert segments[: len(_before(original, at))] == _before(original, at)
        assert len(_tokens(segments)) == MAX
        assert got.choices[0].text == "".join(s["text"] for s in segments)


def test_a_prefix_not_in_memory_is_computed_by_one_forward_pass(
    client: Any, server: Server
) -> None:
    """More alternatives than the original recorded: the prefix's records come from a
    forward pass over prompt + prefix, equal to the original's within float error."""
    original = _ext(_chat(client, server.model))["segments"]
    ids = [t["id"] for t in _tokens(original)]
    at = _boundary(original, 3)
    alt = _tokens(original)[at]["top_logprobs"][1]["id"]
    got = client.chat.completions.create(
        model=server.model, messages=MSG, max_tokens=MAX, temperature=0, logprobs=True,
        top_logprobs=TOP + 2, extra_body=_branch(ids, at, alt),
    )  # fmt: skip
    computed = _tokens(_ext(got)["segments"])
    for old, new in zip(_tokens(original)[:at], computed[:at], strict=True):
        assert new["id"] == old["id"]
        assert math.isclose(new["logprob"], old["logprob"], abs_tol=1e-4)
        assert len(new["top_logprobs"]) == TOP + 2
        for a, b in zip(old["top_logprobs"], new["top_logprobs"], strict=False):
            assert math.isclose(a["logprob"], b["logprob"], abs_tol=1e-4)
    assert computed[at]["id"] == alt


@pytest.mark.parametrize(
    ("branch", "param", "words"),
    [
        ({"ids": [1, 2], "at": 3}, "tokentrail.branch.at", "past the 2 ids"),
        ({"ids": [300, 10**7, 5], "at": 1}, "tokentrail.branch.ids", "position 1"),
        ({"ids": [300, 301], "at": 1, "token": 10**7}, "tokentrail.branch.token", "position 1"),
        ({"ids": [300, "EOS", 301], "at": 1}, "tokentrail.branch.ids", "position 1"),
        ({"ids": [300, 301, "EOS"], "at": 3}, "tokentrail.branch.at", "position 2"),
        ({"ids": [300, 301], "at": -1}, "tokentrail.branch.at", ""),
        ({"ids": [300, 301], "at": 1, "token": "x"}, "tokentrail.branch.token", ""),
    ],
)
def test_bad_branches_are_400s_naming_the_key_and_position(
    client: Any, server: Server, tokenizer: Any, branch: dict[str, Any], param: str, words: str
) -> None:
    eos = tokenizer.eos_token_id
    branch = {**branch, "ids": [eos if i == "EOS" else i for i in branch["ids"]]}
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, server.model, extra_body={"tokentrail": {"branch": branch}})
    error = e.value.body
    assert error["param"] == param
    assert words in error["message"]


def test_branch_refusals_that_depend_on_the_request(client: Any, server: Server) -> None:
    ids = [300, 301, 302]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=server.model, messages=MSG, max_tokens=3, extra_body=_branch(ids, 2, 5)
        )
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=server.model, messages=MSG, max_tokens=8,
            response_format={"type": "json_object"}, extra_body=_branch(ids, 1),
        )  # fmt: skip
    assert e.value.body["param"] == "tokentrail.branch"


@pytest.mark.parametrize("mode", [(), ("--upstream-chat",)], ids=["upstream", "upstream-chat"])
def test_the_proxy_refuses_a_branch_saying_where(
    server: Server, tmp_path_factory: pytest.TempPathFactory, mode: tuple[str, ...]
) -> None:
    """An upstream's KV cache and records are not this server's: a 400, not a reply that
    silently ignores the branch."""
    from tests.helpers.servers import DEMO_MODEL

    log = tmp_path_factory.mktemp("logs") / "proxy.log"
    proxy = start_server(None, log, "--upstream", server.url, "--tokenizer", str(DEMO_MODEL), *mode)
    try:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, proxy.model, extra_body=_branch([300, 301], 1, 5))
        assert e.value.body["param"] == "tokentrail.branch"
        assert "upstream" in e.value.body["message"]
    finally:
        proxy.stop()


# -- torch: the same contract through the serial batch (no prompt cache there) ----------


def test_torch_server_branch_keeps_the_prefix_and_continues_like_a_plain_request(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path | None, tokenizer: Any
) -> None:
    from tokentrail.prompting import prompt_ids

    require("torch")
    log = tmp_path_factory.mktemp("logs") / "torch.log"
    srv = start_server(model_dir, log, "--engine", "torch", "--device", "cpu")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        original = _ext(_chat(client, srv.model))["segments"]
        ids = [t["id"] for t in _tokens(original)]
        at = _boundary(original, 3)
        alt = _tokens(original)[at]["top_logprobs"][1]["id"]
        got = _chat(client, srv.model, extra_body=_branch(ids, at, alt))
        prompt = prompt_ids(tokenizer, MSG, None)
        plain = client.completions.create(
            model=srv.model, prompt=prompt + ids[:at] + [alt], max_tokens=MAX - at - 1,
            temperature=0,
        )  # fmt: skip
        plain_ids = [t["id"] for t in _tokens(_ext(plain)["segments"])]
        _check_branch(original, _ext(got)["segments"], at, alt, plain_ids)
    finally:
        srv.stop()


# -- llama.cpp: the same contract on SmolLM2's GGUF ----------------------------------------


@pytest.fixture(scope="module")
def llama_server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require("uvicorn")
    port = free_port()
    log = tmp_path_factory.mktemp("llamacpp-branch") / "server.log"
    cmd = [
        sys.executable, "-m", "tokentrail", "serve", "--engine", "llamacpp", "--model",
        str(smollm2_gguf), "--n-ctx", "1024", "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip
    srv = launch(cmd, log, f"http://127.0.0.1:{port}", timeout=STARTUP_TIMEOUT)
    yield srv.url
    srv.stop()


def test_llamacpp_branch_keeps_the_prefix_and_continues_like_a_plain_request(
    llama_server: str, smol: tuple[Any, Any]
) -> None:
    from tokentrail.prompting import prompt_ids

    client = openai.OpenAI(base_url=llama_server + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    first = _chat(client, model)
    original = _ext(first)["segments"]
    ids = [t["id"] for t in _tokens(original)]
    at = _boundary(original, 3)
    alt = _tokens(original)[at]["top_logprobs"][1]["id"]
    got = _chat(client, model, extra_body=_branch(ids, at, alt))
    prompt = prompt_ids(smol[1], MSG, None)
    plain = client.completions.create(
        model=model, prompt=prompt + ids[:at] + [alt], max_tokens=MAX - at - 1, temperature=0
    )
    plain_ids = [t["id"] for t in _tokens(_ext(plain)["segments"])]
    _check_branch(original, _ext(got)["segments"], at, alt, plain_ids)
    assert got.usage.prompt_tokens_details.cached_tokens >= len(prompt) + at
    # Not in memory (more alternatives than recorded): llama.cpp computes the prefix's
    # records again in one pass on the engine's own context (`engines.llamacpp.positions`),
    # equal to what the server's batch recorded within float error.
    more = client.chat.completions.create(
        model=model, messages=MSG, max_tokens=MAX, temperature=0, logprobs=True,
        top_logprobs=TOP + 2, extra_body=_branch(ids, at, alt),
    )  # fmt: skip
    computed = _tokens(_ext(more)["segments"])
    for old, new in zip(_tokens(original)[:at], computed[:at], strict=True):
        assert new["id"] == old["id"] and len(new["top_logprobs"]) == TOP + 2
        assert math.isclose(new["logprob"], old["logprob"], abs_tol=2e-3)
        for a, b in zip(old["top_logprobs"], new["top_logprobs"], strict=False):
            assert a["id"] == b["id"] and math.isclose(a["logprob"], b["logprob"], abs_tol=2e-3)
    assert computed[at]["id"] == alt
    # A forced token the original did not list at `at`: its record from the same pass.
    listed = {a["id"] for a in _tokens(original)[at]["top_logprobs"]}
    unlisted = next(i for i in range(300, 400) if i not in listed)
    forced = _tokens(_ext(_chat(client, model, extra_body=_branch(ids, at, unlisted)))["segments"])
    assert [t["id"] for t in forced[: at + 1]] == [*ids[:at], unlisted]
    assert forced[at]["logprob"] < forced[at]["top_logprobs"][0]["logprob"]


# -- the library: stream_generate(branch=...) ---------------------------------------------


@pytest.mark.parametrize("engine", ["mlx", "torch"])
def test_stream_generate_branch_replays_the_prefix_and_forces_the_token(
    model_dir: Path | None, engine: str
) -> None:
    import tokentrail
    from tokentrail.errors import BranchError

    options = {"engine": "torch", "device": "cpu"} if engine == "torch" else {}
    if engine == "torch":
        require("torch")
    model, tok = tokentrail.load(None if model_dir is None else str(model_dir), **options)
    prompt = "The capital of France is"
    original = list(tokentrail.stream_generate(model, tok, prompt, MAX, top_logprobs=TOP))
    ids = [r.token for r in original]
    at = 4
    alt = next(a.id for a in original[at].top_logprobs if a.id != ids[at])
    got = list(
        tokentrail.stream_generate(
            model, tok, prompt, MAX, top_logprobs=TOP, branch={"ids": ids, "at": at, "token": alt}
        )
    )
    for old, new in zip(original[:at], got[:at], strict=True):  # one forward pass: float error
        assert (new.token, new.text) == (old.token, old.text)
        assert math.isclose(new.token_logprob, old.token_logprob, abs_tol=1e-4)
        assert [a.id for a in new.top_logprobs] == [a.id for a in old.top_logprobs]
    assert got[at].token == alt
    head = tok.encode(prompt) + ids[:at] + [alt]
    plain = tokentrail.stream_generate(model, tok, head, MAX - at - 1)
    assert [r.token for r in got[at + 1 :]] == [r.token for r in plain]
    with pytest.raises(BranchError) as e:
        list(tokentrail.stream_generate(model, tok, prompt, MAX, branch={"ids": ids, "at": 99}))
    assert e.value.param == "branch.at"
    with pytest.raises(ValueError, match="position 1"):
        bad = {"ids": [5, 10**7], "at": 1}
        list(tokentrail.stream_generate(model, tok, prompt, MAX, branch=bad))


# -- the reply memory, on its own ---------------------------------------------------------

replies = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(replies, st.integers(1, 20), st.lists(st.integers(0, 3), max_size=5))
def test_reply_memory_finds_only_replies_that_start_with_the_prefix(
    kept: list[list[int]], limit: int, prefix: list[int]
) -> None:
    """Whatever was kept: the memory stays within its token bound, and what it finds
    starts with the prefix, has a record at the branch point, and was kept for this
    prompt and these settings (a kept reply that fits the bound is found)."""
    from tokentrail.branching import ReplyMemory
    from tokentrail.sampling import make_params

    memory = ReplyMemory(limit)
    params, other = make_params(top_logprobs=2), make_params(top_logprobs=2, logit_bias={1: 1.0})
    for ids in kept:
        memory.keep([9], params, [(t, -1.0, [(t, -1.0)], False, "raw", None) for t in ids])
        assert memory.tokens <= limit
    found = memory.find([9], params, prefix, len(prefix) + 1)
    if found is not None:
        assert [r[0] for r in found[: len(prefix)]] == prefix and len(found) > len(prefix)
    last = kept[-1]
    if len(last) <= limit and last[: len(prefix)] == prefix and len(last) > len(prefix):
        assert found is not None
    assert memory.find([8], params, prefix, len(prefix)) is None  # another prompt
    assert memory.find([9], other, prefix, len(prefix)) is None  # another logit bias
    assert memory.find([9], make_params(top_logprobs=3), prefix, len(prefix)) is None
