"""Batches on mlx-lm's BatchGenerator: `MLXEngine.open_batch`, `batch_generate`,
`stream_batch_generate`.

Cases ported from mlx-lm's ml-explore/mlx-lm `tests/test_generate.py` (TestGenerate's
batch tests, cited per test) run against tokentrail on the demo model; mlx-lm's
`batch_generate` and tokentrail's single-sequence `stream_generate` are the oracles.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.env import require

mx = require("mlx.core")
require("mlx_lm")

import mlx_lm  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import tokentrail  # noqa: E402
from tests.helpers.generation import check_exact  # noqa: E402
from tokentrail import batch_generate, stream_batch_generate, stream_generate  # noqa: E402
from tokentrail.engines import engine_for  # noqa: E402
from tokentrail.engines.batch import Batch, open_batch  # noqa: E402
from tokentrail.generate import DEMO_MODEL  # noqa: E402
from tokentrail.sampling import make_params  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (DEMO_MODEL / "config.json").is_file(), reason="the built-in demo model is missing"
)

TEXTS = ["Write a story about Einstein", "Hi", "What time is it?", "How tall is Mt Everest?"]


@pytest.fixture(scope="module")
def demo() -> tuple[Any, Any]:
    return tokentrail.load()


@pytest.fixture(scope="module")
def prompts(demo: tuple[Any, Any]) -> list[list[int]]:
    _, tok = demo
    return [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                add_generation_prompt=True)
        for p in TEXTS
    ]


def single(model: Any, tok: Any, prompt: Any, n: int, **kw: Any) -> list[Any]:
    return list(stream_generate(model, tok, prompt, n, **kw))


def test_batch_generate_matches_mlx_lm(demo: tuple[Any, Any], prompts: list[list[int]]) -> None:
    model, tok = demo
    ref = mlx_lm.batch_generate(model, tok, prompts, max_tokens=12, return_token_ids=True)
    out = batch_generate(model, tok, prompts, max_tokens=12, top_logprobs=2)
    assert out.token_ids == ref.token_ids
    assert out.texts == ref.texts  # byte-level BPE from a chat prompt: no leading space
    for c in out.completions:
        assert c.text == "".join(s.text for s in c.segments)
        assert c.text == tok.decode(c.token_ids)


def test_batch_matches_single(demo: tuple[Any, Any], prompts: list[list[int]]) -> None:
    # ported: mlx-lm tests/test_generate.py TestGenerate.test_batch_matches_single (and
    # test_many_batches: a batch smaller than the prompts, so sequences join later)
    model, tok = demo
    for max_batch in (4, 3, 1):
        got: dict[int, list[Any]] = {}
        for i, r in stream_batch_generate(model, tok, prompts, 8, top_logprobs=3,
                                          max_batch=max_batch):
            got.setdefault(i, []).append(r)
        for i, p in enumerate(prompts):
            ref = single(model, tok, p, 8, top_logprobs=3)
            assert [r.token for r in got[i]] == [r.token for r in ref]
            assert [r.text for r in got[i]] == [r.text for r in ref]
            for a, b in zip(got[i], ref, strict=True):
                assert a.token_logprob == pytest.approx(b.token_logprob, abs=1e-4)
                assert [x.id for x in a.top_logprobs] == [x.id for x in b.top_logprobs]
                assert mx.allclose(a.logprobs, b.logprobs, atol=1e-4).item()
                assert a.token_logprob == pytest.approx(a.logprobs[a.token].item(), abs=1e-5)
            check_exact(tok, p, got[i])


def test_batch_unique_max_toks(demo: tuple[Any, Any], prompts: list[list[int]]) -> None:
    # ported: mlx-lm tests/test_generate.py TestGenerate.test_batch_unique_max_toks
    model, tok = demo
    num = [2, 3, 4, 5]
    no_eos = {0: -1e9, 2: -1e9}
    out = batch_generate(model, tok, prompts, max_tokens=num, logit_bias=no_eos, max_batch=3)
    for i, p in enumerate(prompts):
        ref = single(model, tok, p, num[i], logit_bias=no_eos)
        assert out.token_ids[i] == [r.token for r in ref]
        assert out.completions[i].finish_reason == "length"


def test_per_sequence_logits_processors(demo: tuple[Any, Any]) -> None:
    # ported: mlx-lm tests/test_generate.py
    # TestGenerate.test_batch_generate_with_logits_processors (one bias per sequence)
    model, tok = demo
    prompt = tok.encode("hello")
    biases = [{5: 2000.0}, {6: 2000.0}, {7: 2000.0}]
    out = batch_generate(model, tok, [prompt] * 3, max_tokens=1, logit_bias=biases)
    assert out.token_ids == [[5], [6], [7]]
    assert all(lp == [pytest.approx(0.0, abs=1e-4)] for lp in out.logprobs)


def test_per_sequence_sampling_settings_and_seeds(demo: tuple[Any, Any]) -> None:
    """Greedy, seeded and penalised sequences in one batch each get what they would
    alone; a seeded sequence's draw does not depend on what else is in the batch."""
    model, tok = demo
    ps = [tok.encode(t) for t in ("Once upon a time", "def main():", "import os")]
    kw = dict(temp=[0.0, 1.0, 0.0], seed=[None, 11, None], repetition_penalty=[None, None, 1.5],
              top_p=[1.0, 0.9, 1.0])
    together = batch_generate(model, tok, ps, max_tokens=10, **kw)
    apart = batch_generate(model, tok, ps, max_tokens=10, max_batch=1, **kw)
    assert together.token_ids == apart.token_ids
    greedy = single(model, tok, ps[0], 10)
    assert together.token_ids[0] == [r.token for r in greedy if r.token not in (0, 2)]
    penalised = single(model, tok, ps[2], 10, repetition_penalty=1.5)
    assert together.token_ids[2] == [r.token for r in penalised if r.token not in (0, 2)]
    assert together.logprobs[2] == pytest.approx(
        [r.token_logprob for r in penalised][: len(together.logprobs[2])], abs=1e-4
    )


def test_n_completions_and_stop_strings_per_sequence(demo: tuple[Any, Any]) -> None:
    model, tok = demo
    ps = [tok.encode("The cat"), tok.encode("def f(x):")]
    seen: dict[int, list[Any]] = {}
    for i, r in stream_batch_generate(model, tok, ps, 16, n=3, temp=1.0, seed=4,
                                      stop=[["e"], None]):
        seen.setdefault(i, []).append(r)
    assert sorted(seen) == list(range(6))
    for i, rs in seen.items():
        assert rs[-1].finish_reason is not None
        assert all(r.finish_reason is None for r in rs[:-1])
        text = "".join(r.text for r in rs)
        if i < 3 and rs[-1].stop_string == "e":
            assert "e" not in text  # cut before the stop string
        if i >= 3:
            assert rs[-1].stop_string is None
    # choice j uses seed + j: choice 1 of prompt 0 equals a single run with seed 5
    ref = single(model, tok, ps[0], 16, temp=1.0, seed=5, stop="e")
    assert [r.token for r in seen[1]] == [r.token for r in ref]
    assert [r.text for r in seen[1]] == [r.text for r in ref]


def test_open_batch_protocol_join_leave_and_prompt_cache(demo: tuple[Any, Any]) -> None:
    model, tok = demo
    engine = engine_for(model)
    batch = open_batch(engine, 2, prompt_cache_bytes=None)
    assert isinstance(batch, Batch) and type(batch).__name__ == "MLXBatch"
    first = tok.encode("User: tell me about the sea\nAssistant:")
    a = batch.add(first, make_params(top_logprobs=2), 6)
    b = batch.add(tok.encode("x = 1"), make_params(), 50)
    with pytest.raises(RuntimeError, match="full"):
        batch.add([1, 2], make_params(), 3)
    got: dict[int, list[Any]] = {a: [], b: []}
    steps = 0
    while len(got[a]) < 6:
        for uid, step in batch.step():
            got[uid].append(step)
        steps += 1
        assert steps < 100
    assert len(batch) == 1  # `a` left by itself after its 6th token
    batch.remove(b)  # leaves early
    assert len(batch) == 0
    assert [s.token for s in got[a]] == [
        s.token for s in engine.generate(first, make_params(), 6)
    ]
    assert all(len(s.top_logprobs) == 2 for s in got[a])
    # a follow-up that starts with the first conversation reuses its cached prefix
    follow = first + [s.token for s in got[a]] + tok.encode("\nUser: more")
    c = batch.add(follow, make_params(), 5)
    assert batch.cached_tokens(c) >= len(first)
    cached = []
    while len(batch):
        cached += [s.token for uid, s in batch.step() if uid == c]
    batch.close()
    fresh = open_batch(engine, 1, prompt_cache_bytes=0)
    d = fresh.add(follow, make_params(), 5)
    assert fresh.cached_tokens(d) == 0
    plain = []
    while len(fresh):
        plain += [s.token for _, s in fresh.step()]
    fresh.close()
    assert cached == plain


def test_prompt_cache_bytes_bounds_the_cache(demo: tuple[Any, Any]) -> None:
    model, tok = demo
    batch = open_batch(engine_for(model), 1, prompt_cache_bytes=1)
    ids = tok.encode("a prompt that will not fit in one byte of cache")
    batch.add(ids, make_params(), 3)
    while len(batch):
        batch.step()
    assert batch.prompt_cache.nbytes <= 1
    e = batch.add([*ids, 5], make_params(), 2)
    assert batch.cached_tokens(e) == 0
    batch.close()


def test_bad_batch_arguments(demo: tuple[Any, Any]) -> None:
    model, tok = demo
    with pytest.raises(ValueError, match="max_batch"):
        engine_for(model).open_batch(0)
    with pytest.raises(ValueError, match="prompt_cache_bytes"):
        engine_for(model).open_batch(2, prompt_cache_bytes=-1)
    with pytest.raises(ValueError, match="temp has 1 entries for 2 prompts"):
        stream_batch_generate(model, tok, ["a", "b"], temp=[0.5])
    with pytest.raises(ValueError, match="n must be"):
        stream_batch_generate(model, tok, ["a"], n=0)
    with pytest.raises(TypeError, match="prompts must be a list"):
        stream_batch_generate(model, tok, "a")
    with pytest.raises(ValueError, match="top_p"):
        stream_batch_generate(model, tok, ["a", "b"], top_p=[0.5, 2.0])


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    prompts=st.lists(st.lists(st.integers(3, 3071), min_size=1, max_size=10), min_size=1,
                     max_size=5),
    n=st.integers(1, 10),
    max_batch=st.integers(1, 4),
)
def test_property_batch_equals_single_with_exact_attribution(
    demo: tuple[Any, Any], prompts: list[list[int]], n: int, max_batch: int
) -> None:
    """Any prompts, lengths and batch sizes: each sequence is what it would be alone."""
    model, tok = demo
    got: dict[int, list[Any]] = {}
    for i, r in stream_batch_generate(model, tok, prompts, n, max_batch=max_batch):
        got.setdefault(i, []).append(r)
    for i, p in enumerate(prompts):
        ref = single(model, tok, p, n)
        assert [r.token for r in got[i]] == [r.token for r in ref]
        check_exact(tok, p, got[i])


def test_batches_on_an_engine_without_open_batch(demo: tuple[Any, Any]) -> None:
    """Engines that only generate one sequence at a time get a SerialBatch: the batched
    API still works, each sequence with its own settings."""
    from tokentrail.engines import Step

    _, tok = demo
    ids = tok.encode(" one two three four", add_special_tokens=False)

    class Scripted:
        name, vocab_size, context_length = "scripted", 3072, None

        def generate(self, prompt_ids: Any, params: Any, max_tokens: Any) -> Any:
            for i in ids[: max_tokens or len(ids)]:
                yield Step(i, -0.5, [(i, -0.5)][: params.top_logprobs], None)

        def peak_memory(self) -> float:
            return 0.0

    out = batch_generate(Scripted(), tok, [[1], [2]], max_tokens=[2, 4], top_logprobs=[0, 1])
    assert out.token_ids == [ids[:2], ids[:4]]
    assert out.texts == [tok.decode(ids[:2]), tok.decode(ids[:4])]
    assert out.logprobs == [[-0.5] * 2, [-0.5] * 4]
