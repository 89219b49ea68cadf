"""tokentrail.stream_generate on mlx-lm's own step functions: same ids and `from_draft`
flags as mlx-lm for the same inputs and seed, with exact attribution.

Most cases are ported from mlx-lm's own tests, ml-explore/mlx-lm `tests/test_generate.py`
(TestGenerate) and `tests/test_prompt_cache.py` (TestPromptCache), cited per test; they
run on the built-in demo model and on small random-weight Llamas built here (one with
head_dim 64, so `kv_bits` quantized caches run). mlx-lm itself is the oracle: every test
runs the same call through `mlx_lm.stream_generate` / `generate_step` and compares.
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
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache  # noqa: E402
from mlx_lm.sample_utils import make_logits_processors, make_sampler  # noqa: E402

import tokentrail  # noqa: E402
from tests.helpers.generation import check_exact  # noqa: E402
from tokentrail import Aligner, GenerationResponse, stream_generate  # noqa: E402
from tokentrail.generate import DEMO_MODEL  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (DEMO_MODEL / "config.json").is_file(), reason="the built-in demo model is missing"
)


def random_llama(hidden: int, heads: int, layers: int, seed: int, vocab: int = 3072) -> Any:
    """A random-weight mlx-lm Llama over the demo model's 3072-token vocabulary."""
    from mlx_lm.models import llama

    mx.random.seed(seed)
    args = llama.ModelArgs.from_dict({
        "model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
        "intermediate_size": 2 * hidden, "num_attention_heads": heads,
        "num_key_value_heads": heads, "rms_norm_eps": 1e-5, "vocab_size": vocab,
        "max_position_embeddings": 512, "tie_word_embeddings": False, "rope_theta": 1e4,
    })
    model = llama.Model(args)
    # A larger output layer gives peaked but varied next-token distributions.
    model.lm_head.weight = model.lm_head.weight * 8
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def demo() -> tuple[Any, Any]:
    return tokentrail.load()


@pytest.fixture(scope="module")
def head64() -> Any:
    """head_dim 64 (128 / 2 heads): mlx's quantized attention takes it, so kv_bits runs."""
    return random_llama(128, 2, 2, seed=1)


@pytest.fixture(scope="module")
def big() -> Any:
    """A random "larger target" for speculative decoding with the demo model drafting."""
    return random_llama(256, 4, 3, seed=2)


def theirs(model: Any, tok: Any, prompt: Any, *args: Any, seed: int | None = None,
           **kw: Any) -> list[Any]:
    if seed is not None:
        mx.random.seed(seed)
    return list(mlx_lm.stream_generate(model, tok, prompt, *args, **kw))


def ours(model: Any, tok: Any, prompt: Any, *args: Any, seed: int | None = None,
         **kw: Any) -> list[GenerationResponse]:
    if seed is not None:
        mx.random.seed(seed)
    return list(stream_generate(model, tok, prompt, *args, **kw))


def check_logprobs(out: list[GenerationResponse], k: int) -> None:
    """Each token's logprob and top-k are read off mlx-lm's own logprobs vector."""
    for r in out:
        assert r.token_logprob == pytest.approx(r.logprobs[r.token].item(), abs=1e-5)
        if k:
            want = sorted(mx.topk(r.logprobs, k).tolist(), reverse=True)
            assert [a.logprob for a in r.top_logprobs] == pytest.approx(want, abs=1e-5)
            for a in r.top_logprobs:
                assert a.logprob == pytest.approx(r.logprobs[a.id].item(), abs=1e-5)


def same(a: list[Any], b: list[GenerationResponse]) -> None:
    assert [r.token for r in a] == [r.token for r in b]
    assert [r.from_draft for r in a] == [r.from_draft for r in b]
    assert [r.finish_reason for r in a] == [r.finish_reason for r in b]


# -- stream_generate / generate_step ---------------------------------------------------

SAMPLERS = {
    "greedy": lambda: make_sampler(0.0),
    "temp": lambda: make_sampler(1.0),
    "top_p_min_p_top_k": lambda: make_sampler(0.9, top_p=0.9, min_p=0.05, top_k=20),
    "xtc": lambda: make_sampler(1.0, xtc_probability=0.5, xtc_threshold=0.05),
}


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_same_ids_as_mlx_lm_with_any_sampler(demo: tuple[Any, Any], name: str) -> None:
    model, tok = demo
    prompt = tok.encode("Once upon a time")
    a = theirs(model, tok, prompt, 24, sampler=SAMPLERS[name](), seed=7)
    b = ours(model, tok, prompt, 24, sampler=SAMPLERS[name](), seed=7, top_logprobs=4)
    same(a, b)
    check_exact(tok, prompt, b)
    check_logprobs(b, 4)


def test_tokentrail_sampling_keywords_make_mlx_lm_samplers(demo: tuple[Any, Any]) -> None:
    model, tok = demo
    a = theirs(model, tok, "def f(x):", 20, sampler=make_sampler(0.8, top_p=0.95), seed=3)
    b = ours(model, tok, "def f(x):", 20, temp=0.8, top_p=0.95, seed=3)
    same(a, b)


def test_stream_generate_max_tokens_positional(demo: tuple[Any, Any]) -> None:
    # ported: mlx-lm tests/test_generate.py TestGenerate.test_stream_generate_max_tokens
    model, tok = demo
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Write a story about Einstein"}],
        tokenize=True, add_generation_prompt=True,
    )
    logit_bias = {0: -1e9, 2: -1e9}  # no EOS, so exactly max_tokens come out
    out = ours(model, tok, prompt, 4, logit_bias=logit_bias)
    assert len(out) == 4 and out[-1].finish_reason == "length"
    check_exact(tok, prompt, out)


def test_generate_with_logit_bias(demo: tuple[Any, Any]) -> None:
    # ported: mlx-lm tests/test_generate.py TestGenerate.test_generate_with_logit_bias
    model, tok = demo
    bang = tok.encode("!")[0]
    processors = make_logits_processors({bang: 2000.0, 1: -20.0})
    out = ours(model, tok, "hello", 5, logits_processors=processors)
    assert "".join(r.text for r in out) == "!!!!!"
    assert all(r.token_logprob == pytest.approx(0.0, abs=1e-4) for r in out)
    # tokentrail's own logit_bias keyword is the same mlx-lm processor
    same(out, ours(model, tok, "hello", 5, logit_bias={bang: 2000.0, 1: -20.0}))


def test_generate_with_processor_sees_prompt_and_tokens(demo: tuple[Any, Any]) -> None:
    # ported: mlx-lm tests/test_generate.py TestGenerate.test_generate_with_processor
    model, tok = demo
    seen: dict[str, Any] = {}

    def processor(toks: Any, logits: Any) -> Any:
        seen["toks"] = toks
        return logits

    init = tok.encode("hello")
    bias = make_logits_processors({0: -1e9, 2: -1e9})
    theirs(model, tok, "hello", 5, logits_processors=[processor, *bias])
    want = seen.pop("toks").tolist()
    out = ours(model, tok, "hello", 5, logits_processors=[processor, *bias])
    assert seen["toks"].tolist() == want
    assert want[: len(init)] == init and len(want) == len(init) + 5
    assert want[len(init) :][:5] == [r.token for r in out]


def test_stream_generate_speculative(demo: tuple[Any, Any]) -> None:
    # ported: mlx-lm tests/test_generate.py TestGenerate.test_stream_generate_speculative
    model, tok = demo
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True
    )
    kw = dict(draft_model=model, num_draft_tokens=2, sampler=make_sampler(temp=0.0))
    out = ours(model, tok, prompt, 5, logit_bias={0: -1e9, 2: -1e9}, top_logprobs=3, **kw)
    assert [r.from_draft for r in out] == [True, True, False, True, True]
    same(theirs(model, tok, prompt, 5, logits_processors=make_logits_processors(
        {0: -1e9, 2: -1e9}), **kw), out)
    check_exact(tok, prompt, out)
    check_logprobs(out, 3)


@pytest.mark.parametrize("processed", [False, True])
def test_speculative_with_a_larger_random_target(
    demo: tuple[Any, Any], big: Any, processed: bool
) -> None:
    """The demo model drafts for a random target: many drafts are rejected, and the ids,
    flags, attribution and logprobs still equal mlx-lm's and plain greedy decoding's."""
    draft, tok = demo
    prompt = tok.encode("The capital of France is")
    kw: dict[str, Any] = {"repetition_penalty": 1.3} if processed else {}
    procs = make_logits_processors(repetition_penalty=1.3) if processed else None
    a = theirs(big, tok, prompt, 20, draft_model=draft, num_draft_tokens=3,
               logits_processors=procs)
    b = ours(big, tok, prompt, 20, draft_model=draft, num_draft_tokens=3, top_logprobs=5,
             **kw)
    same(a, b)
    assert not all(r.from_draft for r in b[:-1])  # some drafts were rejected
    plain = ours(big, tok, prompt, 20, top_logprobs=5, **kw)
    assert [r.token for r in plain] == [r.token for r in b]
    assert [r.text for r in plain] == [r.text for r in b]
    assert [[t.index for t in r.last_segment_tokens] for r in plain] == [
        [t.index for t in r.last_segment_tokens] for r in b
    ]
    for p, s in zip(plain, b, strict=True):
        assert s.token_logprob == pytest.approx(p.token_logprob, abs=1e-4)
        assert [a.id for a in s.top_logprobs] == [a.id for a in p.top_logprobs]
    check_exact(tok, prompt, b)
    check_logprobs(b, 5)


def test_input_embeddings_and_prefill_progress(demo: tuple[Any, Any]) -> None:
    # ported: mlx-lm tests/test_generate.py TestGenerate.test_stream_generate_input_embeddings
    # and test_stream_generate_input_embeddings_prefill
    model, tok = demo
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Say 'TEST' and nothing else"}], add_generation_prompt=True
    )
    emb = model.model.embed_tokens(mx.array(prompt))
    calls: dict[str, list[tuple[int, int]]] = {"theirs": [], "ours": []}
    kw: dict[str, Any] = dict(input_embeddings=emb, prefill_step_size=5)
    a = theirs(model, tok, prompt, 8, prompt_progress_callback=lambda *c: calls["theirs"].append(c),
               **kw)
    b = ours(model, tok, prompt, 8, prompt_progress_callback=lambda *c: calls["ours"].append(c),
             **kw)
    same(a, b)
    assert calls["ours"] == calls["theirs"]
    assert len(calls["ours"]) > len(prompt) / 5
    assert calls["ours"][-1] == (len(prompt), len(prompt))
    check_exact(tok, prompt, b)
    # embeddings alone, with an empty prompt: mlx-lm's meaning, no text context
    c = ours(model, tok, [], 8, input_embeddings=emb)
    assert [r.token for r in c] == [r.token for r in b]
    assert c[0].prompt_tokens == len(prompt)


def test_prompt_cache_is_reused_and_extended_across_calls(demo: tuple[Any, Any]) -> None:
    """Two turns on one cache: the second passes only its new tokens, as with mlx-lm."""
    model, tok = demo
    turn1 = tok.encode("User: hi there\nAssistant:")
    turn2 = tok.encode("\nUser: and now?\nAssistant:")
    caches = {"theirs": make_prompt_cache(model), "ours": make_prompt_cache(model)}
    a1 = theirs(model, tok, turn1, 10, prompt_cache=caches["theirs"])
    b1 = ours(model, tok, turn1, 10, prompt_cache=caches["ours"])
    same(a1, b1)
    assert caches["ours"][0].offset == caches["theirs"][0].offset
    a2 = theirs(model, tok, turn2, 10, prompt_cache=caches["theirs"])
    b2 = ours(model, tok, turn2, 10, prompt_cache=caches["ours"], top_logprobs=2)
    same(a2, b2)
    assert caches["ours"][0].offset == caches["theirs"][0].offset
    check_exact(tok, turn2, b2)
    check_logprobs(b2, 2)


def test_trim_cache_with_generate(demo: tuple[Any, Any]) -> None:
    # ported: mlx-lm tests/test_prompt_cache.py TestPromptCache.test_trim_cache_with_generate
    model, tok = demo
    prompt = tok.encode("this is a prompt")
    cache = make_prompt_cache(model)
    last = next(iter(stream_generate(model, tok, prompt, 1, prompt_cache=cache))).token
    first = ours(model, tok, [last], 2, prompt_cache=cache)
    trim_prompt_cache(cache, 3)  # back to just after the prompt
    again = ours(model, tok, [last], 2, prompt_cache=cache)
    assert [r.token for r in first] == [r.token for r in again]
    for x, y in zip(first, again, strict=True):
        assert mx.allclose(x.logprobs, y.logprobs).item()


def test_kv_bits_quantized_cache_head_dim_64(demo: tuple[Any, Any], head64: Any) -> None:
    # after mlx-lm tests/test_prompt_cache.py TestPromptCache.test_cache_to_quantized, via
    # stream_generate's kv_bits / kv_group_size / quantized_kv_start
    _, tok = demo
    prompt = tok.encode("this is a prompt, a longer one")
    kw = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=4)
    a = theirs(head64, tok, prompt, 12, **kw)
    b = ours(head64, tok, prompt, 12, top_logprobs=3, **kw)
    same(a, b)
    check_exact(tok, prompt, b)
    check_logprobs(b, 3)
    for x, y in zip(a, b, strict=True):
        assert mx.allclose(x.logprobs, y.logprobs).item()


def test_max_kv_size_rotating_cache(demo: tuple[Any, Any]) -> None:
    model, tok = demo
    prompt = tok.encode("a rotating cache keeps only the last few tokens of the text")
    same(theirs(model, tok, prompt, 16, max_kv_size=8), ours(model, tok, prompt, 16, max_kv_size=8))
    # a rotating prompt cache never runs out of room: no context cap from its offset
    from mlx_lm.models.cache import RotatingKVCache

    cache = [RotatingKVCache(max_size=8, keep=4) for _ in model.layers]
    for _ in range(3):
        out = ours(model, tok, prompt * 8, 4, prompt_cache=cache, logit_bias={0: -1e9, 2: -1e9})
        assert len(out) == 4
    assert cache[0].offset > model.args.max_position_embeddings


def test_stream_positional_like_mlx_lm(demo: tuple[Any, Any]) -> None:
    """mlx-lm's order: model, tokenizer, prompt, max_tokens, draft_model, stream."""
    from mlx_lm.generate import generation_stream

    model, tok = demo
    a = theirs(model, tok, "hello", 6, None, generation_stream)
    b = ours(model, tok, "hello", 6, None, generation_stream)
    same(a, b)


def test_sentencepiece_style_prompt_context_keeps_the_space() -> None:
    """Aligning in the prompt's context: a continuation that starts a new word keeps its
    space (the text is what the ids add to the prompt), unlike a context-free decode.
    sentencepiece itself is the oracle."""
    from tests.helpers.env import corpus_path

    spm = require("sentencepiece")
    path = str(corpus_path("tokenizers", "llama2", "tokenizer.model"))
    sp = spm.SentencePieceProcessor(model_file=path)
    prompt, world = [1, sp.piece_to_id("▁Hello")], sp.piece_to_id("▁world")
    aligner = Aligner(path, prompt_ids=prompt)
    text = "".join(s.text for s in aligner.push(world) + aligner.finish())
    assert aligner.prompt_text + text == sp.decode([*prompt, world])
    assert text == " world"
    assert "".join(s.text for s in Aligner(path).align([world])) == sp.decode([world])


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    prompt=st.lists(st.integers(3, 3071), min_size=1, max_size=12),
    n=st.integers(1, 12),
    draft=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_property_same_ids_and_exact_attribution(
    demo: tuple[Any, Any], prompt: list[int], n: int, draft: int, seed: int
) -> None:
    """Any prompt ids, length, draft size and seed: mlx-lm's ids and flags, exact text."""
    model, tok = demo
    kw: dict[str, Any] = {"sampler": make_sampler(1.0)}
    if draft:
        kw.update(draft_model=model, num_draft_tokens=draft)
    a = theirs(model, tok, prompt, n, seed=seed, **kw)
    b = ours(model, tok, prompt, n, seed=seed, **kw)
    same(a, b)
    check_exact(tok, prompt, b)


# -- bad input ------------------------------------------------------------------------


def test_bad_mlx_options_raise_at_the_call(demo: tuple[Any, Any]) -> None:
    model, tok = demo
    with pytest.raises(TypeError, match="no_such_option"):
        stream_generate(model, tok, "hi", no_such_option=1)
    with pytest.raises(ValueError, match="sampler"):
        stream_generate(model, tok, "hi", sampler=make_sampler(0.5), temp=0.5)
    with pytest.raises(TypeError, match="sampler must be callable"):
        stream_generate(model, tok, "hi", sampler=3)
    with pytest.raises(ValueError, match="input_embeddings"):
        next(iter(stream_generate(model, tok, "hi", draft_model=model,
                                  input_embeddings=mx.zeros((1, 192)))))


def test_mlx_options_on_another_engine_are_refused(demo: tuple[Any, Any]) -> None:
    from tokentrail.engines import Step

    _, tok = demo

    class Scripted:
        name, vocab_size, context_length = "scripted", 3072, None

        def generate(self, prompt_ids: Any, params: Any, max_tokens: Any) -> Any:
            yield Step(5, -1.0, [], None)

        def peak_memory(self) -> float:
            return 0.0

    with pytest.raises(TypeError, match="draft_model, kv_bits"):
        stream_generate(Scripted(), tok, [1], kv_bits=4, draft_model=object())
    assert [r.token for r in stream_generate(Scripted(), tok, [1], 1)] == [5]


def test_generate_step_recipe_with_aligner(demo: tuple[Any, Any]) -> None:
    """The docs' bring-your-own-loop recipe: mlx-lm's generate_step + Aligner(prompt_ids)."""
    model, tok = demo
    prompt = tok.encode("Once upon a time")
    aligner = Aligner(tok, prompt_ids=prompt)
    ids, pieces = [], []
    steps = generate_step(mx.array(prompt), model, max_tokens=10)
    for token, logprobs in steps:
        ids.append(token)
        pieces += [s.text for s in aligner.push(token, logprobs[token].item())]
    pieces += [s.text for s in aligner.finish()]
    assert aligner.prompt_text + "".join(pieces) == tok.decode(prompt + ids)
    streamed = [r.token for r in ours(model, tok, prompt, 10)]
    assert streamed == ids[: len(streamed)]
