"""Constraint specs: what the output must match, compiled to an llguidance grammar.

`constraint_from` takes the forms the request APIs use (a JSON schema, "any JSON object",
a regex, a list of choices, a Lark or GBNF grammar) and compiles them with llguidance's
own compilers (`LLMatcher.grammar_from_json_schema`, `grammar_from`); the grammar is
checked with `LLMatcher.validate_grammar` at once, so a schema the library cannot
compile fails here, as a `ConstraintError` naming the request field, before any model
work. Nothing here writes a grammar: llguidance does.

A `Constraint` is frozen and hashable, so it can sit in a `SamplingParams`. It becomes
usable by an engine once bound to the model's tokenizer (`Constraint.bind`), which
builds llguidance's tokenizer once per tokenizer object (see `lltokenizer`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import llguidance as llg

from ..errors import ConstraintError
from .compiler import (
    LIMITS,
    TooComplex,
    cached_spec,
    one_line,
    parser_limits,
    prototype_for,
    reason_of,
    spec_key,
)
from .guide import Guide
from .lltokenizer import lltokenizer_for
from .schema_check import check_schema

__all__ = [
    "Constraint",
    "ConstraintError",
    "Kind",
    "constraint_from",
    "from_response_format",
    "from_structured_outputs",
]

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]



@dataclass(frozen=True, slots=True)
class Constraint:
    """A compiled constraint: llguidance's grammar for one spec.

    `kind` is the form it was given in, `source` that spec as text (for messages),
    `grammar` llguidance's grammar definition, `param` the request field it came from
    (named in errors), `warnings` what llguidance noted while validating it (e.g. a
    keyword ignored by a non-strict schema). `tokenizer` is llguidance's tokenizer once
    bound (`bind`); engines need a bound constraint. `after`: the reasoning's end
    markers when the constraint applies to the content after the reasoning
    (`after_reasoning`; empty: from the first generated token).
    """

    kind: Kind
    source: str
    grammar: str = field(repr=False)
    param: str = "response_format"
    warnings: tuple[str, ...] = ()
    tokenizer: Any = field(default=None, repr=False)
    after: tuple[str, ...] = ()
    #: llguidance's matcher at the start of the grammar once bound (`compiler.
    #: prototype_for`): each sequence's guide starts from a copy, never a compile.
    prototype: Any = field(default=None, repr=False, compare=False)

    @property
    def bound(self) -> bool:
        """Whether the constraint knows the model's tokenizer (engines need that)."""
        return self.tokenizer is not None

    def bind(self, tokenizer: Any) -> Constraint:
        """This constraint for `tokenizer` (a transformers, mlx-lm or tokentrail
        tokenizer; llguidance's tokenizer is built once per tokenizer object and cached).
        Builds llguidance's matcher under `compiler.LIMITS` and its first mask (cached
        per grammar and tokenizer), raising `ConstraintError` (`compiler.TooComplex` for
        a limit) with llguidance's reason in one line. Slow for a large grammar: a
        server binds on its compile pool (`compiler.Compiler`), not the model's thread."""
        lltok = lltokenizer_for(tokenizer)
        if lltok is self.tokenizer:
            return self
        matcher = prototype_for(self.grammar, lltok, self.param)
        return replace(self, tokenizer=lltok, prototype=matcher)

    def after_reasoning(self, ends: Sequence[str] = ()) -> Constraint:
        """This constraint applied to the content after the reasoning, which ends at any
        of `ends` (the reasoning format's end markers, for a reply that starts in the
        reasoning): the mask is off until one of them has been generated, as vLLM's
        structured outputs with a reasoning parser. No `ends`: from the first token."""
        ends = tuple(ends)
        if not all(isinstance(e, str) and e for e in ends):
            raise ValueError(f"reasoning end markers must be non-empty strings, got {ends!r}")
        return self if ends == self.after else replace(self, after=ends)

    def guide(self) -> Guide:
        """A fresh matcher at the start of the grammar, for one sequence."""
        return Guide(self)


def _check(kind: Kind, source: str, grammar: str, param: str) -> Constraint:
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(
        grammar, limits=parser_limits()
    )
    if is_error:
        what = {"json_schema": "the JSON schema", "json_object": "the JSON object grammar",
                "regex": "the regex", "choice": "the choices", "grammar": "the grammar"}[kind]
        raise _refusal(param, f"cannot compile {what}", messages[0] if messages else "")
    return Constraint(kind, source, grammar, param, tuple(one_line(m) for m in messages))


def _refusal(param: str, what: str, raw: str) -> ConstraintError:
    """The error for llguidance's message `raw`: one line, "too complex" for a limit."""
    if reason_of(raw) == "too_complex":
        return TooComplex(f"{param}: too complex: {one_line(raw)}", param)
    return ConstraintError(f"{param}: {what}: {one_line(raw)}", param)


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            value = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ConstraintError(f"{param}: the JSON schema is not valid JSON: {e}", param) from e
        except RecursionError:
            raise TooComplex(f"{param}: too complex: the JSON schema nests too deeply",
                             param) from None  # fmt: skip
    else:
        value = schema
    if not isinstance(value, Mapping | bool):
        raise ConstraintError(
            f"{param}: a JSON schema must be an object (or true/false), got "
            f"{type(value).__name__}", param,
        )
    check_schema(value, param)  # no finite instance, absurd bounds, nesting: refused here
    return json.dumps(value)  # key order kept: llguidance emits properties in order


def _json_schema(
    schema: Any, strict: bool | None, any_whitespace: bool, param: str, lead: bool = True
) -> Constraint:
    text = _schema_text(schema, param)
    # strict (the default, and OpenAI's `strict: true`): every keyword is enforced, and
    # one llguidance does not implement is an error. `strict: false` (OpenAI: the schema
    # is a hint) lets llguidance ignore such keywords, noted in `warnings`.
    options = {"whitespace_flexible": any_whitespace, "lenient": strict is False}
    try:
        # The schema's own errors are named from the schema alone, never the wrapper.
        _check("json_schema", text, _json_grammar(text, options, False), param)
        grammar = _json_grammar(text, options, lead)
    except ConstraintError:
        raise
    except ValueError as e:
        raise _refusal(param, "cannot compile the JSON schema", str(e)) from e
    return _check("json_schema", text, grammar, param)


#: The whitespace a JSON constraint takes before its value. JSON allows it (RFC 8259's
#: `ws`), and models merge it into their first token (` {"`, `\n{`, `</think>\n\n{`);
#: compact JSON (llguidance's `whitespace_flexible` off) takes none anywhere, so such a
#: token would be masked out. At most 2 characters (` {"`, `\n\n{`), so a model cannot
#: put off its answer with blanks.
LEADING_WHITESPACE = r"[ \t\r\n]{1,2}"


def _json_grammar(text: str, options: Mapping[str, Any], lead: bool = True) -> str:
    """llguidance's grammar for the JSON schema `text` with compile `options`, after
    optional leading whitespace: a Lark grammar (llguidance's own syntax) whose value
    is the schema inlined with `%json`, the options as its `x-guidance` (a schema's own
    `x-guidance` wins, as with `grammar_from_json_schema`'s defaults). Everything after
    the whitespace is llguidance's JSON compiler's, untouched."""
    value = json.loads(text)
    if not lead or not isinstance(value, Mapping):  # (true / false: nothing to lead)
        return llg.LLMatcher.grammar_from_json_schema(text, defaults=dict(options))
    own = value.get("x-guidance")
    merged = {**options, **(own if isinstance(own, Mapping) else {})}
    schema = json.dumps({**value, "x-guidance": merged})
    lark = f"start: LEAD? value\nLEAD: /{LEADING_WHITESPACE}/\nvalue: %json {schema}\n"
    return llg.grammar_from("lark", lark)


def _choice(choice: Any, param: str) -> Constraint:
    if isinstance(choice, str) or not isinstance(choice, Sequence) or not choice:
        raise ConstraintError(f"{param}: choice must be a non-empty list of strings", param)
    if not all(isinstance(c, str) for c in choice):
        raise ConstraintError(f"{param}: every choice must be a string, got {choice!r}", param)
    if len(choice) > LIMITS.max_items_in_row:  # one Earley row per choice: over the limit
        raise TooComplex(f"{param}: too complex: {len(choice)} choices; at most "
                         f"{LIMITS.max_items_in_row}", param)  # fmt: skip
    text = json.dumps(list(choice))
    return _check("choice", text, llg.grammar_from("choice", text), param)


def constraint_from(
    json_schema: Any = None,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
    json_object: bool = False,
    *,
    strict: bool | None = None,
    any_whitespace: bool = False,
    leading_whitespace: bool = True,
    param: str = "response_format",
) -> Constraint | None:
    """The `Constraint` for one of: `json_schema` (a dict or JSON text), `regex` (Rust
    regex syntax, matched in full), `choice` (the output is exactly one of the strings),
    `grammar` (Lark or GBNF, as llguidance reads them) or `json_object` (any JSON
    object). None when none is given; a `ConstraintError` naming `param` when more than
    one is, or when llguidance cannot compile it.

    `strict=False` (OpenAI's `strict: false`) lets llguidance skip schema keywords it
    does not implement; otherwise they are errors. JSON is compact unless
    `any_whitespace` (llguidance's `whitespace_flexible`), which small models can loop in;
    either way up to two blanks may come before the value (`LEADING_WHITESPACE`) unless
    `leading_whitespace=False` (a reply that is only a tool call: blanks there would be
    blank content). Compiled specs are cached (`compiler.cached_spec`): the same spec
    again is the same `Constraint`.
    """
    args = (json_schema, regex, choice, grammar, json_object, strict, any_whitespace,
            leading_whitespace, param)  # fmt: skip
    return cached_spec(spec_key(*args), lambda: _build(*args))


def _build(
    json_schema: Any, regex: Any, choice: Any, grammar: Any, json_object: bool,
    strict: bool | None, any_whitespace: bool, leading_whitespace: bool, param: str,
) -> Constraint | None:
    """`constraint_from`'s work, uncached."""
    given = [name for name, value in (("json_schema", json_schema), ("regex", regex),
             ("choice", choice), ("grammar", grammar)) if value is not None]
    if json_object:
        given.append("json_object")
    if not given:
        return None
    if len(given) > 1:
        raise ConstraintError(f"{param}: give one constraint, got {' and '.join(given)}", param)
    if json_object:
        options = {"whitespace_flexible": any_whitespace}
        text = '{"type": "object"}'
        return _check("json_object", text, _json_grammar(text, options, leading_whitespace),
                      param)  # fmt: skip
    if json_schema is not None:
        return _json_schema(json_schema, strict, any_whitespace, param, leading_whitespace)
    if choice is not None:
        return _choice(choice, param)
    if regex is not None:
        if not isinstance(regex, str):
            raise ConstraintError(f"{param}: regex must be a string, got {regex!r}", param)
        return _check("regex", regex, llg.LLMatcher.grammar_from_regex(regex), param)
    if not isinstance(grammar, str):
        raise ConstraintError(f"{param}: grammar must be a string, got {grammar!r}", param)
    try:
        compiled = llg.grammar_from("grammar", grammar)
    except ValueError as e:
        raise _refusal(param, "cannot compile the grammar", str(e)) from e
    return _check("grammar", grammar, compiled, param)


def from_response_format(value: Any, param: str = "response_format") -> Constraint | None:
    """OpenAI's `response_format`: {"type": "text"} (None), {"type": "json_object"}, or
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not isinstance(value.get("type"), str):
        raise ConstraintError(f"{param} must be an object with a type, got {value!r}", param)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return constraint_from(json_object=True, param=param)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping) or "schema" not in spec:
            raise ConstraintError(f"{param}.json_schema must be an object with a schema", param)
        strict = spec.get("strict")
        return constraint_from(
            json_schema=spec["schema"], strict=None if strict is None else bool(strict),
            param=param,
        )
    raise ConstraintError(
        f"{param}.type must be text, json_object or json_schema, got {kind!r}", param
    )


def from_structured_outputs(value: Any, param: str = "structured_outputs") -> Constraint | None:
    """vLLM's `structured_outputs`: one of `json` (a schema), `regex`, `choice`,
    `grammar`, `json_object` (true)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConstraintError(f"{param} must be an object, got {value!r}", param)
    known = {"json", "regex", "choice", "grammar", "json_object"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConstraintError(f"{param}: unknown field {', '.join(unknown)}", param)
    return constraint_from(
        json_schema=value.get("json"), regex=value.get("regex"), choice=value.get("choice"),
        grammar=value.get("grammar"), json_object=bool(value.get("json_object")), param=param,
    )
