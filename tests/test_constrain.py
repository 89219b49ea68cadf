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
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

llg = pytest.importorskip(
    "llguidance", reason="llguidance is not installed: pip install -e '.[constrain]'"
)
jsonschema = pytest.importorskip(
    "jsonschema", reason="jsonschema is not installed: pip install -e '.[dev]'"
)

from tokentrail.constrain import (  # noqa: E402
    ConstraintError,
    constraint_from,
    from_response_format,
    from_structured_outputs,
)
from tokentrail.engines.base import Step  # noqa: E402
from tokentrail.sampling import make_params  # noqa: E402

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "ok": {"type": "boolean"},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2}},
     "required": ["ok", "colour", "tags"], "additionalProperties": False},
]
REGEX = r"(yes|no), [0-9]{1,3}"
CHOICES = ["Paris", "London", "Berlin", "Rome"]
LIMIT = 64


# -- specs and errors ------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"json_schema": {"type": "frobnicate"}}, "frobnicate"),
    ({"json_schema": "{not json"}, "not valid JSON"),
    ({"json_schema": [1, 2]}, "must be an object"),
    ({"regex": "a(b"}, "unclosed group"),
    ({"grammar": "start: undefined_rule"}, "undefined_rule"),
    ({"choice": []}, "non-empty"),
    ({"choice": ["a", 3]}, "string"),
    ({"regex": "a", "choice": ["a"]}, "regex and choice"),
])
def test_a_spec_that_cannot_compile_raises_naming_the_field(kwargs: Any, reason: str) -> None:
    with pytest.raises(ConstraintError, match=re.escape(reason)) as e:
        constraint_from(**kwargs)
    assert isinstance(e.value, ValueError)
    assert e.value.param == "response_format"
    assert str(e.value).startswith("response_format")


def test_request_forms() -> None:
    assert constraint_from() is None
    assert from_response_format({"type": "text"}) is None
    c = from_response_format({"type": "json_schema",
                              "json_schema": {"name": "p", "schema": SCHEMAS[0], "strict": True}})
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


def _ids(tok: Any, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                  add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def _eos(tok: Any) -> set[int]:
    ids = getattr(tok, "eos_token_ids", None)
    return set(ids) if ids else {tok.eos_token_id}


class Rig:
    """One engine with its tokenizer and an oracle for the model's own logprobs."""

    def __init__(self, engine: Any, tok: Any, oracle: Callable[[list[int], int], np.ndarray]):
        self.engine, self.tok, self.oracle = engine, tok, oracle
        self.eos = _eos(tok)

    def run(self, ids: list[int], constraint: Any, limit: int = LIMIT, **kw: Any) -> list[Step]:
        """Steps until the first EOS (included), at most `limit`."""
        c = None if constraint is None else constraint.bind(self.tok)
        out = []
        for step in self.engine.generate(ids, make_params(constraint=c, **kw), limit):
            out.append(step)
            if step.token in self.eos:
                break
        return out

    def text(self, steps: list[Step]) -> str:
        assert steps[-1].token in self.eos, "the grammar did not end the stream"
        return self.tok.decode([s.token for s in steps[:-1]])


def _mlx_rig() -> Rig:
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install -e '.[mlx]'")
    import mlx.core as mx

    import tokentrail
    from tokentrail.engines import engine_for

    model, tok = tokentrail.load()

    def oracle(ids: list[int], n_prompt: int) -> np.ndarray:
        logits = model(mx.array(ids)[None])[0, n_prompt - 1 :].astype(mx.float32)
        return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    return Rig(engine_for(model), tok, oracle)


def _torch_rig() -> Rig:
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
    import tokentrail
    from tokentrail.engines import engine_for

    model, tok = tokentrail.load(None, engine="torch")

    def oracle(ids: list[int], n_prompt: int) -> np.ndarray:
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids])).logits[0, n_prompt - 1 :].float()
        return torch.log_softmax(logits, dim=-1).numpy()

    return Rig(engine_for(model), tok, oracle)


@pytest.fixture(scope="module", params=["mlx", "torch", "llamacpp"])
def rig(request: pytest.FixtureRequest) -> Rig:
    if request.param == "mlx":
        return _mlx_rig()
    if request.param == "torch":
        return _torch_rig()
    engine, tok = request.getfixturevalue("smol")
    ref = request.getfixturevalue("smol_ref")

    def oracle(ids: list[int], n_prompt: int) -> np.ndarray:
        ref.reset()  # teacher-forced as the engine decodes: the prompt, then one at a time
        ref.eval(ids[:n_prompt])
        for t in ids[n_prompt:]:
            ref.eval([t])
        logits = np.asarray(ref.scores[n_prompt - 1 : len(ids)], dtype=np.float64)
        m = logits.max(axis=-1, keepdims=True)
        return logits - m - np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))

    return Rig(engine, tok, oracle)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "flags"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_outputs_validate(rig: Rig, schema: Any, seed: int) -> None:
    c = constraint_from(json_schema=schema)
    steps = rig.run(_ids(rig.tok, "Reply in JSON."), c, temp=0.9, seed=seed)
    jsonschema.validate(json.loads(rig.text(steps)), schema)


@pytest.mark.parametrize("seed", [0, 1])
def test_regex_choice_and_json_object_outputs_match(rig: Rig, seed: int) -> None:
    ids = _ids(rig.tok, "Answer.")
    kw = {"temp": 1.0, "seed": seed}
    assert re.fullmatch(REGEX, rig.text(rig.run(ids, constraint_from(regex=REGEX), **kw)))
    assert rig.text(rig.run(ids, constraint_from(choice=CHOICES), **kw)) in CHOICES
    gbnf = constraint_from(grammar='root ::= ("yes" | "no") " " [0-9]')
    assert re.fullmatch(r"(yes|no) [0-9]", rig.text(rig.run(ids, gbnf, **kw)))
    lark = constraint_from(grammar='start: /[ab]{1,6}/ "."\n%llguidance {}\n')
    assert re.fullmatch(r"[ab]{1,6}\.", rig.text(rig.run(ids, lark, **kw)))
    # any object: unbounded, so greedy and asked for a short one (small models ramble on)
    short = _ids(rig.tok, 'Return the JSON object {"city": "Paris"} and nothing else.')
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
    ids = _ids(rig.tok, "A person, as JSON.")
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
    ids = _ids(rig.tok, "Flags, as JSON.")
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
    ids = _ids(rig.tok, "A city.")
    if type(rig.engine).__name__ == "LlamaCppEngine":  # binds to its own vocabulary
        steps = list(rig.engine.generate(ids, make_params(constraint=c), 8))
        assert rig.tok.decode([s.token for s in steps if s.token not in rig.eos]) in CHOICES
    else:
        with pytest.raises(ValueError, match="bind"):
            list(rig.engine.generate(ids, make_params(constraint=c), 4))
    with pytest.raises(TypeError, match="Constraint"):
        make_params(constraint="json")


def _drain(batch: Any, eos: set[int]) -> dict[int, list[Step]]:
    got: dict[int, list[Step]] = {}
    done: set[int] = set()
    for _ in range(4 * LIMIT):
        if not len(batch):
            break
        for uid, step in batch.step():
            if uid in done:
                continue
            got.setdefault(uid, []).append(step)
            if step.token in eos:
                done.add(uid)
                batch.remove(uid)
    return got


def test_batch_rows_each_follow_their_own_constraint(rig: Rig) -> None:
    from tokentrail.engines.batch import open_batch

    try:
        batch = open_batch(rig.engine, 3)
    except (TypeError, NotImplementedError, AttributeError) as e:
        pytest.skip(f"{type(rig.engine).__name__} has no batch: {e}")
    ids = _ids(rig.tok, "Reply.")
    specs = [constraint_from(json_schema=SCHEMAS[0]), None, constraint_from(choice=CHOICES)]
    jobs = [make_params(constraint=None if c is None else c.bind(rig.tok), temp=0.9, seed=i,
                        top_logprobs=2) for i, c in enumerate(specs)]
    uids = [batch.add(ids, p, LIMIT) for p in jobs]
    got = _drain(batch, rig.eos)
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
    batch.add(_ids(rig.tok, "Other."), make_params(temp=0.5, seed=1), 8)
    assert [s.token for s in _drain(batch, rig.eos)[uid]] == solo
    batch.close()
