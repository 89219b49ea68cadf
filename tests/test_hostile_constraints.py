"""Hostile constraints at the library level (issue #29): one-line errors, schema checks
that refuse a `$ref` cycle with no way out or absurd bounds without recursion, the
compile budget, the matcher cache, and a failing row leaving MLX's batch alone.

Real llguidance, the real demo model and its tokenizer; no mocks.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.env import require

require("llguidance")

from tokentrail.constrain import ConstraintError, constraint_from  # noqa: E402
from tokentrail.constrain.compiler import (  # noqa: E402
    Compiler,
    TooComplex,
    one_line,
    prototype_for,
)
from tokentrail.constrain.schema_check import MAX_DEPTH, check_schema  # noqa: E402


@pytest.fixture(scope="module")
def mlx_demo() -> tuple[Any, Any]:
    require("mlx_lm")
    import tokentrail

    return tokentrail.load()


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


TREE = {  # recursive, with a finite instance: a node whose children list may be empty
    "type": "object",
    "properties": {"name": {"type": "string"},
                   "children": {"type": "array", "items": {"$ref": "#"}}},
    "required": ["name", "children"],
}
LINKED = {  # recursive through $defs, ending at null
    "$defs": {"node": {"type": "object", "properties": {
        "next": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/node"}]}}, "required": ["next"]}},
    "$ref": "#/$defs/node",
}
NO_WAY_OUT = {
    "required self-reference": {"type": "object", "properties": {"a": {"$ref": "#"}},
                                "required": ["a"]},
    "bare self-reference": {"$ref": "#"},
    "mutual $defs": {"$defs": {
        "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
        "b": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1}},
        "$ref": "#/$defs/a"},
    "allOf cycle": {"$defs": {"x": {"allOf": [{"$ref": "#/$defs/x"}, {"type": "object"}]}},
                    "$ref": "#/$defs/x"},
    "anyOf of cycles": {"$defs": {"x": {"anyOf": [{"$ref": "#/$defs/x"}, {
        "type": "array", "prefixItems": [{"$ref": "#/$defs/x"}], "minItems": 1}]}},
        "$ref": "#/$defs/x"},
}


@pytest.mark.parametrize("schema", [TREE, LINKED], ids=["tree", "linked list"])
def test_recursive_schema_with_a_finite_instance_compiles(schema: dict[str, Any]) -> None:
    check_schema(schema, "response_format")
    c = constraint_from(json_schema=schema)
    assert c is not None and c.kind == "json_schema"


@pytest.mark.parametrize("name", sorted(NO_WAY_OUT))
def test_ref_cycle_with_no_way_out_is_refused_in_one_line(name: str) -> None:
    with pytest.raises(ConstraintError) as e:
        constraint_from(json_schema=NO_WAY_OUT[name])
    message = str(e.value)
    assert e.value.param == "response_format"
    assert "\n" not in message and "no finite instance" in message


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "string", "minLength": 1_000_000_000}, "'minLength' is 1e+09"),
        ({"type": "array", "minItems": 500_000_000, "maxItems": 1_000_000_000}, "'minItems'"),
        ({"type": "object", "properties": {"a": {"type": "array", "minItems": 10**7}}},
         "/properties/a"),
        (_nested(5_000), f"more than {MAX_DEPTH} levels"),
    ],
    ids=["minLength 1e9", "maxItems 1e9 minItems 5e8", "nested bound", "5000 deep"],
)
def test_absurd_bounds_and_depth_are_too_complex(schema: Any, words: str) -> None:
    with pytest.raises(TooComplex) as e:  # never a RecursionError
        constraint_from(json_schema=schema, param="json_schema")
    assert e.value.param == "json_schema"
    assert "\n" not in str(e.value) and "too complex" in str(e.value) and words in str(e.value)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"regex": "(ab"}, "unclosed group"),
        ({"json_schema": {"$ref": "#/$defs/missing"}}, "does not exist"),
        ({"grammar": "start: foo\nfoo: (("}, "grammar"),
        ({"json_schema": {"type": "string", "format": "no-such-format"}}, "format"),
    ],
    ids=["regex", "dangling $ref", "lark", "unknown format"],
)
def test_llguidance_errors_come_back_in_one_line(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ConstraintError) as e:
        constraint_from(**kwargs, param="structured_outputs")
    message = str(e.value)
    assert "\n" not in message and words in message
    assert message.startswith("structured_outputs: ")
    assert message.count("cannot compile") <= 1  # the reason once, not wrapped twice


def test_one_line_cuts_llguidance_state() -> None:
    raw = ("the grammar matcher failed: lexer error: too many expressions constructed\n<state>\n"
           "Tokens: ⟦a⟧\n1 tokens, 0 bytes; grm_prefix: \"\"\n</state>")
    expected = "the grammar matcher failed: lexer error: too many expressions constructed"
    assert one_line(raw) == expected
    assert one_line("x " * 500).endswith("…") and len(one_line("x " * 500)) <= 240


def test_too_many_choices_are_too_complex() -> None:
    with pytest.raises(TooComplex, match="20000 choices"):
        constraint_from(choice=[f"c{i}" for i in range(20_000)])


def test_compile_budget_refuses_before_the_work_ends() -> None:
    """A 50,000-value enum takes llguidance a second or more: with a 10 ms budget the
    caller hears "too complex" at once, and the refusal is counted."""
    refused: list[str] = []
    compiler = Compiler(0.01, on_refuse=refused.append)
    schema = {"enum": [f"budget{i}" for i in range(50_000)]}  # never compiled before: no cache

    async def go() -> float:
        tic = time.perf_counter()
        with pytest.raises(TooComplex, match=r"too complex: compiling it took over 0\.01 s"):
            await compiler.run(constraint_from, schema, param="response_format")
        return time.perf_counter() - tic

    try:
        assert asyncio.run(go()) < 5.0  # the budget, not the compile (generous: busy CI)
    finally:
        compiler.close()
    assert refused == ["too_complex"]


def test_compile_reports_time_and_errors() -> None:
    times: list[float] = []
    refused: list[str] = []
    compiler = Compiler(30, on_compile=times.append, on_refuse=refused.append)

    async def go() -> None:
        c = await compiler.run(constraint_from, None, "[ab]+", param="structured_outputs")
        assert c is not None and c.kind == "regex"
        with pytest.raises(ConstraintError):
            await compiler.run(constraint_from, None, "(ab", param="structured_outputs")

    try:
        asyncio.run(go())
    finally:
        compiler.close()
    assert len(times) == 1 and times[0] >= 0
    assert refused == ["invalid"]


def test_the_same_spec_compiles_once() -> None:
    schema = {"type": "object", "properties": {"once": {"type": "integer"}}}
    first = constraint_from(json_schema=schema)
    assert constraint_from(json_schema=dict(schema)) is first
    assert constraint_from(json_schema=schema, param="json_schema") is not first  # its own field


def test_bound_constraints_share_one_matcher(mlx_demo: tuple[Any, Any]) -> None:
    """Bound twice, one compiled matcher (cached by grammar and tokenizer); each guide
    walks a copy of it."""
    _, tok = mlx_demo
    c = constraint_from(regex="(yes|no)")
    a, b = c.bind(tok), c.bind(tok)
    assert a.prototype is b.prototype is prototype_for(c.grammar, a.tokenizer, c.param)
    g1, g2 = a.guide(), a.guide()
    yes = tok.encode("yes", add_special_tokens=False)
    for t in yes:
        assert g1.allowed(a.tokenizer.vocab_size)[t]
        g1.advance(t)
    assert g1.done and not g2.done  # the copies do not share state


#: A grammar that compiles and starts, then outgrows llguidance's 2,000 items per row.
LEFT_RECURSIVE = "\n".join(["start: r0", *(f'r{i}: r{i} "+" r{i + 1} | r{i + 1}'
                                              for i in range(2_000)), 'r2000: "x"'])


_leaf = st.sampled_from([
    {"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "null"},
    {"type": "string", "minLength": 10**9}, {"type": "array", "minItems": 10**8},
    {"type": "nonsense"}, {"type": 5}, {"$ref": "#"}, {"$ref": "#/nowhere"},
    {"enum": list(range(3))}, {"type": "string", "pattern": "^(a+)+$"}, True, False, [], 7,
])


def _schemas() -> st.SearchStrategy[Any]:
    return st.recursive(
        _leaf,
        lambda inner: st.one_of(
            st.builds(lambda p, r: {"type": "object", "properties": p, "required": r},
                      st.dictionaries(st.sampled_from("abc"), inner, max_size=3),
                      st.lists(st.sampled_from("abcd"), max_size=3)),
            st.builds(lambda i, n: {"type": "array", "items": i, "minItems": n}, inner,
                      st.integers(0, 2)),
            st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=1, max_size=3)),
            st.builds(lambda xs: {"allOf": xs}, st.lists(inner, min_size=1, max_size=2)),
        ),
        max_leaves=12,
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=_schemas())
def test_any_schema_compiles_or_is_refused_in_one_line(schema: Any) -> None:
    """Whatever the schema, `constraint_from` compiles it or raises a ConstraintError
    naming the field in one line: never another exception, never a RecursionError."""
    try:
        c = constraint_from(json_schema=schema, param="json_schema")
    except ConstraintError as e:
        assert e.param == "json_schema"
        assert "\n" not in str(e) and str(e).startswith("json_schema: ")
    else:
        assert c is not None and json.loads(c.source) == schema


def _beside(batch: Any, plain: int, other: int | None, n: int) -> tuple[list[int], list[Exception]]:
    """Step `batch` until `plain` has `n` tokens (60 steps at most): its tokens, and the
    errors reported, each for `other` (the failing row) only."""
    got: list[int] = []
    errors: list[Exception] = []
    for _ in range(60):
        for uid, step in batch.step():
            if isinstance(step, Exception):
                assert uid == other
                errors.append(step)
            elif uid == plain:
                got.append(step.token)
        if len(got) >= n or not len(batch):
            break
    return got, errors


def test_failing_row_leaves_the_mlx_batch_alone(mlx_demo: tuple[Any, Any]) -> None:
    """A sequence whose grammar fails mid-way (a left-recursive grammar that outgrows
    llguidance's row limit after a few tokens) ends with its error; the plain greedy
    sequence beside it gets the tokens it gets alone, and the batch stays in step."""
    require("mlx_lm")
    from tokentrail.engines import engine_for
    from tokentrail.engines.mlx.batch import MLXBatch
    from tokentrail.sampling import make_params

    model, tok = mlx_demo
    engine = engine_for(model)
    bad = constraint_from(grammar=LEFT_RECURSIVE).bind(tok)
    prompt = tok.encode("Once upon a time", add_special_tokens=False)
    greedy = make_params(temp=0.0)

    def run(with_bad: bool) -> tuple[list[int], list[Exception]]:
        batch = MLXBatch(model, max_batch=4, vocab_size=engine.vocab_size, prompt_cache_bytes=0)
        try:
            plain = batch.add(prompt, greedy, 24)
            guided = make_params(temp=0.0, constraint=bad)
            other = batch.add(prompt, guided, 24) if with_bad else None
            return _beside(batch, plain, other, 24)
        finally:
            batch.close()

    alone, _ = run(False)
    beside, errors = run(True)
    assert beside == alone and len(alone) == 24
    assert len(errors) == 1
    assert "\n" not in str(errors[0]) and "too complex" in str(errors[0])


def test_failing_row_leaves_the_llamacpp_batch_alone(demo: tuple[Any, Any]) -> None:
    """The same on the llama.cpp batch (the demo model's GGUF): the failed sequence is
    `(uid, error)` and gone; the greedy one beside it decodes what it decodes alone."""
    from tokentrail.sampling import make_params

    engine, tok = demo
    bad = constraint_from(grammar=LEFT_RECURSIVE).bind(tok)
    prompt = tok.encode("Once upon a time")

    def run(with_bad: bool) -> tuple[list[int], list[Exception]]:
        batch = engine.open_batch(2, n_ctx=512, prompt_cache_bytes=0)
        try:
            plain = batch.add(prompt, make_params(temp=0.0), 24)
            other = (batch.add(prompt, make_params(temp=0.0, constraint=bad), 24)
                     if with_bad else None)  # fmt: skip
            return _beside(batch, plain, other, 24)
        finally:
            batch.close()

    alone, _ = run(False)
    beside, errors = run(True)
    assert beside == alone and len(alone) == 24
    assert len(errors) == 1 and "\n" not in str(errors[0])


def _tools(*specs: dict[str, Any]) -> list[Any]:
    from tokentrail.server.tool_calls import ToolSpec

    return [ToolSpec.model_validate({"type": "function", "function": f}) for f in specs]


@pytest.mark.parametrize(
    ("tools", "words"),
    [
        ([{"name": f"t{i}"} for i in range(129)], "at most 128"),
        ([{"name": "a"}, {"name": "a"}], "repeats the name 'a'"),
        ([{"name": "a", "parameters": {"type": "string"}}], "type object"),
        ([{"name": "a", "parameters": {"type": "object", "properties": {"x": {"$ref": "#"}},
                                       "required": ["x"]}}], "no finite instance"),
        ([{"name": "a", "parameters": {"type": "object", "properties": {
            "x": {"type": "string", "minLength": 10**9}}}}], "too complex"),
        ([{"name": "a", "parameters": {"type": "object", "description": "x" * 300_000}}],
         "bytes of JSON"),
    ],
    ids=["count", "duplicate", "not an object", "cycle", "bound", "size"],
)
def test_tool_lists_are_checked_like_schemas(tools: list[dict[str, Any]], words: str) -> None:
    from tokentrail.errors import APIError
    from tokentrail.server.tool_calls import tool_constraint

    with pytest.raises(APIError) as e:
        tool_constraint(_tools(*tools), "auto")
    assert e.value.status == 400 and e.value.param == "tools"
    assert "\n" not in e.value.message and words in e.value.message


def test_a_sound_tool_list_passes() -> None:
    from tokentrail.server.tool_calls import tool_constraint

    tools = _tools({"name": "get", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}, {"name": "ping"})
    assert tool_constraint(tools, "auto") == (None, "auto")
    call, choice = tool_constraint(tools, {"type": "function", "function": {"name": "get"}})
    assert choice == "named" and call is not None and call.param == "tools"


def test_one_sequence_whose_grammar_fails_ends_with_the_error(mlx_demo: tuple[Any, Any]) -> None:
    """Outside a batch (`stream_generate`) the failure is raised: the sequence ends, it
    never goes on unconstrained."""
    import tokentrail

    model, tok = mlx_demo
    texts: list[str] = []
    with pytest.raises(TooComplex, match="too complex"):
        for r in tokentrail.stream_generate(model, tok, "Once upon a time", max_tokens=24,
                                            grammar=LEFT_RECURSIVE):
            texts.append(r.text)
    assert all(set(t) <= set("x+") for t in texts)  # what came was the grammar's
