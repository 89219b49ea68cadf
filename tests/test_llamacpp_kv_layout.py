"""The llama.cpp batch's KV cache layout (`LlamaCppBatch(kv_unified=...)`, `serve
--kv-unified`), on the real SmolLM2 GGUF.

Split (llama-server's default when ``-np`` is given): each sequence has its own share of
the cache and attends over it alone, so a sequence's tokens and logprobs do not depend
on what runs beside it. Oracle: the engine's own single-sequence decode
(`LlamaCppEngine.generate`), which llama-server's solo answers equal (measured in
`docs/engines.md`). A unified cache makes no such promise: llama-server with
``--kv-unified`` answers the same greedy request differently alone and beside others
(ggml-org/llama.cpp#20063; `docs/engines.md` has the figures), and so does our batch,
as llama.cpp computes it. Served: the per-sequence context is what `/v1/models` reports
and what a request must fit, through the official `openai` client on a real
`tokentrail serve --engine llamacpp`.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.env import require
from tests.helpers.generation import assert_batch_equals_solo
from tests.helpers.net import free_port
from tests.helpers.servers import launch

TOPICS = ("cats", "the sea", "Paris")


@pytest.fixture(scope="module")
def smol_fa_off(smollm2_gguf: Path) -> tuple[Any, Any]:
    """SmolLM2 with flash attention off (llama-cpp-python's exact decode), unlike the
    session's `smol`."""
    require("llama_cpp")
    from tokentrail.engines.llamacpp.engine import load

    return load(smollm2_gguf, n_ctx=2048, flash_attn="off")


def chat(tok: Any, topic: str) -> list[int]:
    from tokentrail.prompting import prompt_ids

    return prompt_ids(tok, [{"role": "user", "content": f"Tell me about {topic}."}], None)


def test_split_cache_gives_each_sequence_its_solo_run(smol_fa_off: tuple[Any, Any]) -> None:
    """Three chats decoded together, one joining two steps late, each equal to its solo
    run: the same tokens, logprobs and top-3 ids (flash attention off: 0.0 apart here)."""
    from tokentrail.engines.llamacpp.batch import LlamaCppBatch
    from tokentrail.sampling import make_params

    engine, tok = smol_fa_off
    jobs = [(chat(tok, t), make_params(top_logprobs=3), 16) for t in TOPICS]
    batch = LlamaCppBatch(engine, 4, kv_unified=False)
    assert not batch.kv_unified and batch.context_length * 4 <= batch.n_ctx
    assert_batch_equals_solo(engine, batch, jobs, late=1, tol=1e-4)
    batch.close()


def test_stream_batch_generate_gives_each_prompt_its_stream_generate_run(
    smol: tuple[Any, Any],
) -> None:
    """`stream_batch_generate` promises each sequence exactly what `stream_generate`
    yields for it. On llama.cpp that holds only on a split cache: its private batch is
    split and sized for the longest sequence (on the unified cache it used before, two of
    these six greedy answers took other tokens and logprobs moved by up to 2.6). The
    session's engine as loaded (flash attention `auto`), six chats, three joining late."""
    from tokentrail import stream_generate
    from tokentrail.batch import stream_batch_generate

    engine, tok = smol
    questions = ["What is the capital of France?", "Name an animal that lives in the sea.",
                 "What is 12 plus 7?", "Who wrote Hamlet?", "What colour is the sky?",
                 "Tell me about Paris."]
    prompts = [[{"role": "user", "content": q}] for q in questions]
    solo = [[(r.token, r.token_logprob, [a.id for a in r.top_logprobs])
             for r in stream_generate(engine, tok, p, max_tokens=24, top_logprobs=3)]
            for p in prompts]
    got: dict[int, list[Any]] = {}
    for i, r in stream_batch_generate(engine, tok, prompts, 24, top_logprobs=3, max_batch=3):
        got.setdefault(i, []).append((r.token, r.token_logprob, [a.id for a in r.top_logprobs]))
    for i, want in enumerate(solo):
        assert [t for t, _, _ in got[i]] == [t for t, _, _ in want], questions[i]
        for (_, lp, top), (_, lp2, top2) in zip(got[i], want, strict=True):
            assert lp == pytest.approx(lp2, abs=1e-4)
            assert top == top2


def test_a_private_batch_stays_within_the_engines_own_context(smol: tuple[Any, Any]) -> None:
    """`stream_batch_generate`'s split batch takes no more KV cells than the engine was
    loaded with unless the caller names `max_batch`: as many sequences as fit, each with
    room for the longest (llama.cpp's 256-cell rounding), at least one."""
    engine, _ = smol
    assert engine.context_length == 2048
    for longest, most in [(40, 32), (100, 32), (300, 32), (700, 5), (3000, 32), (1, 2)]:
        n, layout = engine.solo_batch(longest, None, most)
        assert layout["kv_unified"] is False
        share = layout["n_ctx"] // n
        assert share >= min(longest, 2048) and share % 256 == 0
        assert 1 <= n <= most and layout["n_ctx"] <= 2048
        assert n == most or (n + 1) * share > 2048  # no room left for one more
    n, layout = engine.solo_batch(100, 12, 32)  # named: kept, and the memory it needs
    assert n == 12 and layout["n_ctx"] == 12 * 256


def test_split_batch_lists_sequence_ids_in_order_without_gaps(smol_fa_off: tuple[Any, Any]) -> None:
    """llama.cpp cuts a split cache's batch into ubatches of consecutive sequence ids as
    they come (`split_equal`, sequential), one pass over the weights each: the batch
    writes its tokens in id order, and a new sequence takes the lowest free id."""
    from tokentrail.engines.llamacpp.batch import LlamaCppBatch
    from tokentrail.sampling import make_params

    engine, tok = smol_fa_off
    batch = LlamaCppBatch(engine, 4, kv_unified=False)
    uids = [batch.add(chat(tok, t), make_params(), 30) for t in TOPICS]
    batch.step()
    batch.remove(uids[0])  # frees the lowest id while the others go on
    uids.append(batch.add(chat(tok, "a red bicycle"), make_params(), 30))
    for _ in range(2):
        batch.step()
        b = batch._batch.batch
        ids = [b.seq_id[i][0] for i in range(b.n_tokens)]
        runs = [ids[0]] + [y for x, y in itertools.pairwise(ids) if y != x]
        assert runs == sorted(set(ids)) == list(range(len(runs))), ids
    batch.close()


def test_layouts_auto_and_the_per_sequence_context(smol_fa_off: tuple[Any, Any]) -> None:
    from tokentrail.engines.llamacpp.batch import LlamaCppBatch
    from tokentrail.engines.llamacpp.engine import kv_unified_mode
    from tokentrail.sampling import make_params

    engine, _ = smol_fa_off
    shared = LlamaCppBatch(engine, 4)  # the engine's default: one shared cache
    assert shared.kv_unified and shared.context_length == shared.n_ctx == 2048
    shared.close()
    # "auto": llama-server's -kvu rule, shared only when the slot count is left out
    auto_given = LlamaCppBatch(engine, 4, kv_unified="auto")
    assert not auto_given.kv_unified and auto_given.context_length == 512
    auto_given.close()
    auto_left = LlamaCppBatch(engine, None, kv_unified="auto")
    assert auto_left.kv_unified and auto_left.context_length == auto_left.n_ctx
    auto_left.close()
    split = LlamaCppBatch(engine, 4, kv_unified=False)
    with pytest.raises(ValueError, match=r"512 tokens per sequence .*split among 4"):
        split.add([5] * 600, make_params(), 4)
    split.close()
    with pytest.raises(ValueError, match="kv_unified must be"):
        LlamaCppBatch(engine, 4, kv_unified="sometimes")
    assert (kv_unified_mode("on"), kv_unified_mode("off"), kv_unified_mode("auto")) == (
        True, False, "auto"
    )  # fmt: skip
    with pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
        kv_unified_mode("split")


def serve(gguf: Path, log: Path, *flags: str) -> Any:
    port = free_port()
    cmd = [sys.executable, "-m", "tokentrail", "serve", "--engine", "llamacpp", "--model",
           str(gguf), "--n-ctx", "2048", "--port", str(port), "--log-level", "warning",
           *flags]  # fmt: skip
    return launch(cmd, log, f"http://127.0.0.1:{port}", timeout=180.0)


@pytest.fixture(scope="module")
def split_server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    require("uvicorn")
    srv = serve(smollm2_gguf, tmp_path_factory.mktemp("kv") / "split.log", "--max-batch", "4")
    yield srv
    srv.stop()


def test_serve_splits_the_cache_when_max_batch_is_given_as_llama_server_does(
    split_server: Any,
) -> None:
    openai = require("openai")
    client = openai.OpenAI(base_url=split_server.url + "/v1", api_key="x", max_retries=0)
    card = client.models.list().data[0]
    assert card.model_extra["max_model_len"] == 512  # 2048 split among 4 sequences
    long = "word " * 600  # about 600 tokens: over a sequence's share, under the cache
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=card.id, messages=[{"role": "user", "content": long}], max_tokens=4
        )
    assert e.value.body["code"] == "context_length_exceeded", e.value.body
    assert "context of 512 tokens" in e.value.body["message"], e.value.body
    assert "splits its KV cache of 2048 tokens" in e.value.body["message"], e.value.body
    ok = client.chat.completions.create(
        model=card.id, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert ok.usage.completion_tokens >= 1


@pytest.mark.parametrize(
    "flags", [("--max-batch", "4", "--kv-unified", "on"), ()], ids=["on", "max-batch-left-out"]
)
def test_serve_shares_the_cache_when_told_or_when_max_batch_is_left_out(
    smollm2_gguf: Path, tmp_path: Path, flags: tuple[str, ...]
) -> None:
    require("uvicorn")
    openai = require("openai")
    srv = serve(smollm2_gguf, tmp_path / "shared.log", *flags)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        card = client.models.list().data[0]
        assert card.model_extra["max_model_len"] == 2048
        long = "word " * 600
        out = client.chat.completions.create(
            model=card.id, messages=[{"role": "user", "content": long}], max_tokens=2
        )
        assert out.usage.prompt_tokens > 512
    finally:
        srv.stop()


def test_kv_unified_is_refused_for_other_engines(tmp_path: Path) -> None:
    import subprocess

    r = subprocess.run(
        [sys.executable, "-m", "tokentrail", "serve", "--engine", "torch", "--kv-unified",
         "off"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "--kv-unified does not apply to --engine torch" in r.stderr
