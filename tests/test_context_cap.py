"""The context cap of `stream_generate` (issue 20): only where the model would fail.

mlx-lm's caches grow as needed and rotary positions have no end, so an MLX model with
rotary positions runs past `max_position_embeddings` exactly as `mlx_lm.stream_generate`
does. A model that looks positions up in a learned table (GPT-2's `wpe`) cannot: there
`max_tokens` is cut to the room the prompt (and the prompt cache) leave, the stream ends
with "length", and a prompt that fills the table is refused. `cap_to_context=False`
turns the cap off for a caller that manages its own prompt cache.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.env import require

mx = require("mlx.core")
mlx_lm = require("mlx_lm")

import tokentrail  # noqa: E402
from tokentrail.generate import DEMO_MODEL  # noqa: E402

POSITIONS = 64


@pytest.fixture(scope="module")
def demo() -> tuple[Any, Any]:
    return tokentrail.load(DEMO_MODEL)


@pytest.fixture(scope="module")
def gpt2(demo: tuple[Any, Any]) -> Any:
    """A one-layer GPT-2 (random weights) with a 64-position table, on the demo vocabulary."""
    from mlx_lm.models import gpt2

    args = gpt2.ModelArgs(
        model_type="gpt2", n_ctx=POSITIONS, n_embd=32, n_head=2, n_layer=1,
        n_positions=POSITIONS, layer_norm_epsilon=1e-5, vocab_size=demo[0].args.vocab_size,
    )
    mx.random.seed(0)
    model = gpt2.Model(args)
    mx.eval(model.parameters())
    return model


def _prompt(tokenizer: Any, n: int) -> list[int]:
    ids = tokenizer.encode("The for statement is used to iterate over a sequence. " * 60)
    return ids[:n]


def test_rotary_model_runs_past_its_context_as_mlx_lm_does(demo: tuple[Any, Any]) -> None:
    """The issue's case: 480 prompt tokens in a 512 context, a non-rotating prompt
    cache, max_tokens=100: mlx-lm gives 100 tokens, and so does tokentrail."""
    from mlx_lm.models.cache import make_prompt_cache

    model, tok = demo
    assert model.args.max_position_embeddings == 512
    ids = _prompt(tok, 480)
    no_eos = {e: -1e9 for e in tok.eos_token_ids}
    from mlx_lm.sample_utils import make_logits_processors

    processors = make_logits_processors(logit_bias=no_eos)
    theirs = list(mlx_lm.stream_generate(model, tok, ids, 100, logits_processors=processors))
    cache = make_prompt_cache(model)
    ours = list(
        tokentrail.stream_generate(model, tok, ids, 100, prompt_cache=cache, logit_bias=no_eos)
    )
    assert [r.token for r in ours] == [r.token for r in theirs]
    assert len(ours) == 100 and ours[-1].finish_reason == "length" == theirs[-1].finish_reason
    # a whole context of prompt is no error either
    assert len(list(tokentrail.stream_generate(model, tok, _prompt(tok, 512), 3))) == 3


def test_learned_positions_cap_max_tokens(demo: tuple[Any, Any], gpt2: Any) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    tok = demo[1]
    no_eos = {e: -1e9 for e in tok.eos_token_ids}
    out = list(tokentrail.stream_generate(gpt2, tok, _prompt(tok, 50), 100, logit_bias=no_eos))
    assert len(out) == POSITIONS - 50 and out[-1].finish_reason == "length"
    # tokens already in the prompt cache count too
    cache = make_prompt_cache(gpt2)
    list(tokentrail.stream_generate(gpt2, tok, _prompt(tok, 20), 4, prompt_cache=cache))
    before = cache[0].offset
    more = list(
        tokentrail.stream_generate(
            gpt2, tok, _prompt(tok, 30), 100, prompt_cache=cache, logit_bias=no_eos
        )
    )
    assert len(more) == POSITIONS - before - 30 and more[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="context"):
        tokentrail.stream_generate(gpt2, tok, _prompt(tok, POSITIONS), 1)


def test_cap_to_context_false_turns_the_cap_off(demo: tuple[Any, Any], gpt2: Any) -> None:
    tok = demo[1]
    no_eos = {e: -1e9 for e in tok.eos_token_ids}
    out = list(
        tokentrail.stream_generate(
            gpt2, tok, _prompt(tok, 50), 20, cap_to_context=False, logit_bias=no_eos
        )
    )
    # With the cap, generation would end after the 14 tokens the 64 positions leave. Off,
    # it goes on past them; what a learned-position model computes there is undefined
    # (MLX reads past the table), so how far it gets before a garbage EOS or the limit
    # varies from run to run: only "past the cap, never past max_tokens" is fixed.
    assert POSITIONS - 50 < len(out) <= 20
    assert out[-1].finish_reason in ("length", "stop")
