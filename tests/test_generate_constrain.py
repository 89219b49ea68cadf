"""`stream_generate(..., json_schema=, regex=, choice=)`: constrained output through the
library's own entry point on MLX and torch, checked with jsonschema and `re`."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers.env import require

SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "ok": {"type": "boolean"}},
    "required": ["city", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=["mlx", "torch"])
def loaded(request: pytest.FixtureRequest):
    require("llguidance", "constrained decoding")
    require("mlx_lm" if request.param == "mlx" else "torch")
    import tokentrail

    return tokentrail.load(engine=request.param)


@pytest.mark.parametrize("seed", [0, 7])
def test_json_schema_validates_and_carries_fields(loaded, seed: int) -> None:
    jsonschema = require("jsonschema")
    import tokentrail

    model, tok = loaded
    rs = list(tokentrail.stream_generate(model, tok, "Where?", max_tokens=60, temp=0.9,
                                         seed=seed, json_schema=SCHEMA, top_logprobs=3))
    text = "".join(r.text for r in rs)
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    assert rs[-1].finish_reason == "stop"
    by_path = {f.path: f for f in rs[-1].all_fields}
    assert set(by_path) == {"/city", "/ok"}
    assert by_path["/city"].value == value["city"]
    # the enum's alternatives are the allowed values, with probabilities (not top-k)
    alts = by_path["/city"].alternatives
    if alts is not None:
        assert {a.value for a in alts} == {"Paris", "Rome", "Oslo"}
        assert all(0.0 <= a.probability <= 1.0 for a in alts)


def test_regex_and_choice(loaded) -> None:
    import tokentrail

    model, tok = loaded
    out = "".join(r.text for r in tokentrail.stream_generate(
        model, tok, "Code:", max_tokens=12, regex=r"[0-9]{3}-[a-z]{2}"))
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out), out
    out = "".join(r.text for r in tokentrail.stream_generate(
        model, tok, "Pick", max_tokens=8, temp=1.0, seed=1, choice=["left", "right"]))
    assert out in {"left", "right"}


def test_bad_constraints_are_errors_naming_the_keyword(loaded) -> None:
    import tokentrail
    from tokentrail.errors import ConstraintError

    model, tok = loaded
    with pytest.raises(ConstraintError) as e:
        tokentrail.stream_generate(model, tok, "Hi", json_schema={"type": "frob"})
    assert e.value.param == "json_schema" and "frob" in str(e.value)
    with pytest.raises(ValueError, match="one constraint"):
        tokentrail.stream_generate(model, tok, "Hi", regex="a", choice=["a"])


def _early_marker(tok, tokens: list[int]) -> str:
    """Two tokens' text the greedy reply writes early, found first where they stand."""
    for i in range(1, min(12, len(tokens) - 2)):
        marker = tok.decode(tokens[i : i + 2])
        text = tok.decode(tokens[: i + 2])
        if marker.strip() and text.index(marker) == len(tok.decode(tokens[:i])):
            return marker
    pytest.skip(f"no early marker in {tok.decode(tokens)!r}")


def test_json_schema_applies_after_the_reasoning(loaded) -> None:
    """reasoning=("", END) with a schema: the reasoning is the model's own unconstrained
    greedy text up to END (END cut from that text), the content after it validates."""
    jsonschema = require("jsonschema")
    import tokentrail

    model, tok = loaded
    prompt = "The capital of France is"
    free = list(tokentrail.stream_generate(model, tok, prompt, max_tokens=16))
    text = "".join(r.text for r in free)
    marker = _early_marker(tok, [r.token for r in free])
    rs = list(
        tokentrail.stream_generate(
            model, tok, prompt, max_tokens=80, reasoning=("", marker), json_schema=SCHEMA
        )
    )
    last = rs[-1]
    assert last.finish_reason == "stop"
    assert last.reasoning == text[: text.index(marker)]
    jsonschema.validate(json.loads(last.content), SCHEMA)
    assert {f.path for f in last.all_fields} == {"/city", "/ok"}
    # a reasoning that never ends is never masked: the free text, cut at max_tokens
    rs = list(
        tokentrail.stream_generate(
            model,
            tok,
            prompt,
            max_tokens=16,
            reasoning=("", "\u2603never\u2603"),
            json_schema=SCHEMA,
        )
    )
    assert rs[-1].finish_reason == free[-1].finish_reason and rs[-1].reasoning == text
    assert rs[-1].content == ""
