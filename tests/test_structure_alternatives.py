"""Boolean and enum alternatives are consistent with the tokens actually generated.

A value can be written in a tokenization the tokenizer would not choose (a sampler or a
grammar took ` tr` + `ue` where `encode(" true")` is one token). The chosen value's
probability must then be that of the tokens written, from the leaf's first token on;
another value's is that of its canonical encoding. Oracle: the model's own logits from
a direct forward pass (MLX or transformers) over prompt + output, read here.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.helpers.env import require
from tests.helpers.real_tokenizers import DEMO


@pytest.fixture(scope="module", params=["mlx", "torch"])
def loaded(request: pytest.FixtureRequest) -> tuple[str, Any, Any]:
    require("mlx_lm" if request.param == "mlx" else "torch")
    import tokentrail

    model, tok = tokentrail.load(engine=request.param)
    return request.param, model, tok


def _oracle(kind: str, model: Any, ids: list[int], n: int) -> list[float]:
    """The model's raw logprob of each of ids[n:] at its place (one forward pass)."""
    if kind == "mlx":
        import mlx.core as mx

        logits = model(mx.array(ids)[None])[0].astype(mx.float32)
        rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return [rows[p - 1, ids[p]].item() for p in range(n, len(ids))]
    import torch

    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)
    return [rows[p - 1, ids[p]].item() for p in range(n, len(ids))]


def _enc(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _split(tok: Any, text: str) -> list[int] | None:
    """`text` in a tokenization other than the tokenizer's own (two encoded halves)."""
    canon = _enc(tok, text)
    for cut in range(2, len(text)):
        ids = _enc(tok, text[:cut]) + _enc(tok, text[cut:])
        if ids != canon and tok.decode(ids) == text:
            return ids
    return None


def test_chosen_value_is_scored_on_its_generated_tokens(loaded: tuple[str, Any, Any]) -> None:
    import tokentrail
    from tokentrail.engines import engine_for
    from tokentrail.engines.scoring import scorer_for
    from tokentrail.structure import json_fields

    kind, model, tok = loaded
    prompt = _enc(tok, "Answer in JSON.\n")
    head = _enc(tok, '{"ok":')
    written = _split(tok, " true")
    if written is None:
        pytest.skip("' true' has one tokenization in this vocabulary")
    out = head + written + _enc(tok, "}")
    aligner = tokentrail.Aligner(str(DEMO))
    segments = [s for i in out for s in aligner.push(i)] + aligner.finish()
    text = "".join(s.text for s in segments)
    assert text == tok.decode(out)
    scorer, why = scorer_for(engine_for(model), tok, prompt, list(out))
    assert why is None
    (field,) = json_fields(text, segments, scorer=scorer)
    assert field.value is True and [t.id for t in field.tokens] == written
    probs = {a.value: a.probability for a in field.alternatives or ()}
    ids = prompt + out
    at = len(prompt) + len(head)
    lps = _oracle(kind, model, ids, at)[: len(written)]
    assert probs[True] == pytest.approx(math.exp(math.fsum(lps)), rel=2e-3)
    # the other value: its canonical encoding after the same prefix
    other = _enc(tok, " false")
    lp_false = _oracle(kind, model, prompt + head + other, at)
    assert probs[False] == pytest.approx(math.exp(math.fsum(lp_false)), rel=2e-3)
    # ... and the canonical ` true` would have given another number than what was written
    canon = _oracle(kind, model, prompt + head + _enc(tok, " true"), at)
    assert math.exp(math.fsum(canon)) != pytest.approx(probs[True], rel=1e-3)
