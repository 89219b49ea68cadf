"""Constrained decoding through llguidance on every in-process engine.

Oracles, never our own output: `jsonschema` validates every JSON output, Python's `re`
matches regex outputs in full; the model's own logits (a full forward pass of the MLX /
transformers model over prompt + output, llama-cpp-python's `Llama.scores` with
`logits_all=True`) give the raw logprobs; llguidance's own `LLMatcher`, replayed over
the output, gives each step's allowed set, hence the allowed mass and the processed
distribution. Models: the demo model (MLX, torch) and SmolLM2-135M-Instruct (llama.cpp).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np
import pytest

llg = pytest.importorskip(
    "llguidance", reason="llguidance is not installed: pip install -e '.[constrain]'"
)
jsonschema = pytest.importorskip(
    "jsonschema", reason="jsonschema is not installed: pip install -e '.[dev]'"
)

from tests.helpers.rigs import ENGINES, LIMIT, Rig, chat_ids, drain, open_rig  # noqa: E402
from tokentrail.constrain import (  # noqa: E402
    ConstraintError,
    constraint_from,
    from_response_format,
    from_structured_outputs,
)
from tokentrail.sampling import make_params  # noqa: E402


@pytest.fixture(scope="module", params=ENGINES)
def rig(request: pytest.FixtureRequest) -> Rig:
    return open_rig(request)


SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "colour": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
        },
        "required": ["ok", "colour", "tags"],
        "additionalProperties": False,
    },
]
REGEX = r"(yes|no), [0-9]{1,3}"
CHOICES = ["Paris", "London", "Berlin", "Rome"]


# -- specs and errors ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"json_schema": {"type": "frobnicate"}}, "frobnicate"),
        ({"json_schema": "{not json"}, "not valid JSON"),
        ({"json_schema": [1, 2]}, "must be an object"),
        ({"regex": "a(b"}, "unclosed group"),
        ({"grammar": "start: undefined_rule"}, "undefined_rule"),
        ({"choice": []}, "non-empty"),
        ({"choice": ["a", 3]}, "string"),
        ({"regex": "a", "choice": ["a"]}, "regex and choice"),
    ],
)
def test_a_spec_that_cannot_compile_raises_naming_the_field(kwargs: Any, reason: str) -> None:
    with pytest.raises(ConstraintError, match=re.escape(reason)) as e:
        constraint_from(**kwargs)
    assert isinstance(e.value, ValueError)
    assert e.value.param == "response_format"
    assert str(e.value).startswith("response_format")


def test_request_forms() -> None:
    assert constraint_from() is None
    assert from_response_format({"type": "text"}) is None
    c = from_response_format(
        {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[0], "strict": True}}
    )
    assert c is not None and c.kind == "json_schema" and json.loads(c.source) == SCHEMAS[0]
    assert from_response_format({"type": "json_object"}).kind == "json_object"
    with pytest.raises(ConstraintError, match="frob"):
        from_response_format({"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}})
    with pytest.raises(ConstraintError, match="type"):
        from_response_format({"type": "xml"})
    assert from_structured_outputs({"choice": CHOICES}).kind == "choice"
    assert from_structured_outputs({"regex": REGEX}).kind == "regex"
    with pytest.raises(ConstraintError) as e:
        from_structured_outputs({"grammar": "root ::= (", "regex": "a"})
    assert e.value.param == "structured_outputs"
    # frozen and hashable, so it can sit in a SamplingParams
    assert hash(constraint_from(regex=REGEX)) == hash(constraint_from(regex=REGEX))
    with pytest.raises(ValueError, match="logprobs_mode"):
        make_params(logprobs_mode="cooked")


def test_strict_false_lets_llguidance_skip_unknown_keywords() -> None:
    schema = {"type": "string", "format": "not-a-format"}
    with pytest.raises(ConstraintError, match="not-a-format"):
        constraint_from(json_schema=schema)
    assert constraint_from(json_schema=schema, strict=False).kind == "json_schema"


# -- the engines -----------------------------------------------------------------------


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "flags"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_outputs_validate(rig: Rig, schema: Any, seed: int) -> None:
    c = constraint_from(json_schema=schema)
    steps = rig.run(chat_ids(rig.tok, "Reply in JSON."), c, temp=0.9, seed=seed)
    jsonschema.validate(json.loads(rig.text(steps)), schema)


@pytest.mark.parametrize("seed", [0, 1])
def test_regex_choice_and_json_object_outputs_match(rig: Rig, seed: int) -> None:
    ids = chat_ids(rig.tok, "Answer.")
    kw = {"temp": 1.0, "seed": seed}
    assert re.fullmatch(REGEX, rig.text(rig.run(ids, constraint_from(regex=REGEX), **kw)))
    assert rig.text(rig.run(ids, constraint_from(choice=CHOICES), **kw)) in CHOICES
    gbnf = constraint_from(grammar='root ::= ("yes" | "no") " " [0-9]')
    assert re.fullmatch(r"(yes|no) [0-9]", rig.text(rig.run(ids, gbnf, **kw)))
    lark = constraint_from(grammar='start: /[ab]{1,6}/ "."\n%llguidance {}\n')
    assert re.fullmatch(r"[ab]{1,6}\.", rig.text(rig.run(ids, lark, **kw)))
    # any object: unbounded, so greedy and asked for a short one (small models ramble on:
    # SmolLM2 under llama.cpp's flash attention goes on listing keys after "Paris")
    short = chat_ids(rig.tok, 'Return the JSON object {"ok": true} and nothing else.')
    obj = json.loads(rig.text(rig.run(short, constraint_from(json_object=True), 160)))
    assert isinstance(obj, dict)


def _oracle_masks(rig: Rig, c: Any, tokens: list[int], width: int) -> list[np.ndarray]:
    """llguidance's own allowed set at each step, replaying `tokens` from the start."""
    bound = c.bind(rig.tok)
    matcher = llg.LLMatcher(bound.tokenizer, bound.grammar)
    masks = []
    for t in tokens:
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:width].astype(bool)
        masks.append(np.pad(allowed, (0, width - allowed.size)))
        assert matcher.consume_token(t)
    return masks


def test_raw_logprobs_are_the_models_and_allowed_mass_is_the_masks(rig: Rig) -> None:
    c = constraint_from(json_schema=SCHEMAS[0])
    ids = chat_ids(rig.tok, "A person, as JSON.")
    steps = rig.run(ids, c, temp=0.8, seed=3, top_logprobs=5)
    tokens = [s.token for s in steps]
    want = rig.oracle(ids + tokens, len(ids))[: len(steps)]
    masks = _oracle_masks(rig, c, tokens, want.shape[1])
    forced = 0
    for s, row, allowed in zip(steps, want, masks, strict=True):
        assert s.distribution == "raw"
        assert allowed[s.token]
        assert s.logprob == pytest.approx(row[s.token], abs=2e-3)
        assert [i for i, _ in s.top_logprobs] == list(np.argsort(-row, kind="stable")[:5])
        mass = float(np.exp(row[allowed]).sum())
        assert 0 < s.allowed_mass <= 1 + 1e-6
        assert s.allowed_mass == pytest.approx(mass, rel=2e-3, abs=1e-7)
        forced += mass < 0.5
    assert forced, "the schema never fought the model: the test would not see a wrong mass"


@pytest.mark.parametrize("temp", [0.0, 0.7])
def test_processed_logprobs_are_the_masked_distribution(rig: Rig, temp: float) -> None:
    c = constraint_from(json_schema=SCHEMAS[1])
    ids = chat_ids(rig.tok, "Flags, as JSON.")
    steps = rig.run(ids, c, temp=temp, seed=5, top_logprobs=20, logprobs_mode="processed")
    tokens = [s.token for s in steps]
    raw = rig.oracle(ids + tokens, len(ids))[: len(steps)]
    masks = _oracle_masks(rig, c, tokens, raw.shape[1])
    for s, row, allowed in zip(steps, raw, masks, strict=True):
        assert s.distribution == "processed"
        scaled = row[allowed] / (temp or 1.0)
        lse = float(np.log(np.exp(scaled - scaled.max()).sum()) + scaled.max())
        assert s.logprob == pytest.approx(row[s.token] / (temp or 1.0) - lse, abs=3e-3)
        assert all(allowed[i] for i, _ in s.top_logprobs)
        if allowed.sum() <= 20:  # the whole allowed set is listed: it sums to 1
            assert len(s.top_logprobs) == allowed.sum()
            assert math.fsum(math.exp(lp) for _, lp in s.top_logprobs) == pytest.approx(1, abs=1e-3)


def test_unbound_or_foreign_constraints(rig: Rig) -> None:
    c = constraint_from(choice=CHOICES)
    ids = chat_ids(rig.tok, "A city.")
    if type(rig.engine).__name__ == "LlamaCppEngine":  # binds to its own vocabulary
        steps = list(rig.engine.generate(ids, make_params(constraint=c), 8))
        assert rig.tok.decode([s.token for s in steps if s.token not in rig.eos]) in CHOICES
    else:
        with pytest.raises(ValueError, match="bind"):
            list(rig.engine.generate(ids, make_params(constraint=c), 4))
    with pytest.raises(TypeError, match="Constraint"):
        make_params(constraint="json")


def test_batch_rows_each_follow_their_own_constraint(rig: Rig) -> None:
    from tokentrail.engines.batch import open_batch

    try:
        batch = open_batch(rig.engine, 3)
    except (TypeError, NotImplementedError, AttributeError) as e:
        pytest.skip(f"{type(rig.engine).__name__} has no batch: {e}")
    ids = chat_ids(rig.tok, "Reply.")
    specs = [constraint_from(json_schema=SCHEMAS[0]), None, constraint_from(choice=CHOICES)]
    jobs = [
        make_params(
            constraint=None if c is None else c.bind(rig.tok), temp=0.9, seed=i, top_logprobs=2
        )
        for i, c in enumerate(specs)
    ]
    uids = [batch.add(ids, p, LIMIT) for p in jobs]
    got = drain(batch, rig.eos)
    batch.close()
    person = json.loads(rig.text(got[uids[0]]))
    jsonschema.validate(person, SCHEMAS[0])
    assert rig.text(got[uids[2]]) in CHOICES
    assert all(s.allowed_mass is None for s in got[uids[1]])
    assert all(0 < s.allowed_mass <= 1 + 1e-6 for s in got[uids[0]])
    # greedy rows in a batch give the tokens of their solo run
    greedy = constraint_from(json_schema=SCHEMAS[1]).bind(rig.tok)
    solo = [s.token for s in rig.run(ids, greedy)]
    batch = open_batch(rig.engine, 2)
    uid = batch.add(ids, make_params(constraint=greedy), LIMIT)
    batch.add(chat_ids(rig.tok, "Other."), make_params(temp=0.5, seed=1), 8)
    assert [s.token for s in drain(batch, rig.eos)[uid]] == solo
    batch.close()
