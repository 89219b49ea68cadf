"""Structured output over HTTP: the request fields that constrain a reply, the
``tokentrail`` request options, and the per-choice structure the scheduler applies.

Constraint fields (at most one of them per request; each compiled by llguidance
through `tokentrail.constrain` while the request is read, so a spec that cannot
compile is a 400 naming the field and llguidance's reason, never unconstrained output):

- OpenAI ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
- vLLM ``structured_outputs``: one of ``json`` (a schema), ``regex``, ``choice``,
  ``grammar`` (Lark or GBNF), ``json_object``;
- llama.cpp's top-level ``json_schema`` (a schema) and ``grammar`` (GBNF or Lark).

The ``tokentrail`` object (`TokentrailOptions`) holds this server's own options:
``logprobs`` ("raw", the default: the model's distribution before the mask and the
sampling filters; "processed": the one the token was drawn from), ``fields`` (true: JSON
fields for a reply that parses as JSON; a JSON constraint turns them on anyway) and
``reasoning`` (chat only: a parser name, ``[START, END]`` markers, or false for none,
in place of the server's ``--reasoning-parser`` / ``--reasoning-markers``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from ..errors import APIError, ConstraintError
from ..structure.reasoning import ReasoningFormat, reasoning_format
from .actions import AlarmOptions, BranchOptions, RetryOptions

if TYPE_CHECKING:
    from ..constrain import Constraint
    from ..constrain.compiler import Compiler
    from .metrics import Metrics

R = TypeVar("R")

__all__ = [
    "CONSTRAINT_FIELDS",
    "CompileGate",
    "Structure",
    "StructuredFields",
    "TokentrailOptions",
    "bound",
    "constraint_param",
    "reply_format",
    "structure_of",
    "structure_options",
]

#: The request fields that constrain the output, in the order they are looked at.
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "json_schema", "grammar")

_CONFIG = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)


class TokentrailOptions(BaseModel):
    """The request's ``tokentrail`` object."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)

    logprobs: Literal["raw", "processed"] | None = None
    fields: bool | None = None
    reasoning: (
        str | Annotated[list[str], Field(min_length=2, max_length=2)] | Literal[False] | None
    ) = None
    # Acting on confidence (`tokentrail.server.actions`).
    alarm: AlarmOptions | None = None
    retry: RetryOptions | None = None
    branch: BranchOptions | None = None
    vote: Literal["confidence", "majority"] | None = None
    early_stop: bool | None = None


class StructuredFields(BaseModel):
    """The constraint fields and ``tokentrail`` options chat and completions share."""

    model_config = _CONFIG

    response_format: Any = None
    structured_outputs: Any = None
    json_schema: Any = None
    grammar: Any = None
    tokentrail: TokentrailOptions | None = None


@dataclass(frozen=True)
class Structure:
    """What a request asks of its reply's structure.

    `constraint` is compiled but not yet bound to a tokenizer (the scheduler binds it);
    `reasoning` is the request's own reasoning format, False for none, None for the
    server's default."""

    constraint: Constraint | None = None
    logprobs_mode: str = "raw"
    fields: bool = False
    reasoning: ReasoningFormat | Literal[False] | None = None
    #: With `tools`: "auto", "none", "required" or "named" (a constraint for the last
    #: two, whose fields are the tool calls'); None without tools.
    tool_choice: str | None = None
    #: ``tokentrail.alarm`` (`actions.AlarmOptions`; the stage: `output.alarm`).
    alarm: AlarmOptions | None = None
    #: ``branch``: continue from inside an earlier reply (`tokentrail.branching`).
    branch: BranchOptions | None = None
    #: ``tokentrail.retry`` (field retry, `output.retry`); None: off.
    retry: RetryOptions | None = None

    @property
    def json_constrained(self) -> bool:
        """A JSON constraint of the request's own (not a tool call's): fields go on."""
        c = self.constraint
        tool = self.tool_choice in ("required", "named")
        return c is not None and c.kind in ("json_schema", "json_object") and not tool

    def schema(self) -> Mapping[str, Any] | None:
        """The JSON schema of the constraint (None: none, or not a schema)."""
        c = self.constraint
        if c is None or c.kind != "json_schema":
            return None
        try:
            value = json.loads(c.source)
        except json.JSONDecodeError:
            return None
        return value if isinstance(value, Mapping) else None


def reply_format(
    structure: Structure, server_reasoning: ReasoningFormat | None, chat: bool
) -> ReasoningFormat | None:
    """The reasoning format a choice's reply is split with (None: none): the request's
    own, else the server's; completions have none."""
    fmt = structure.reasoning if chat else False
    if fmt is None:
        fmt = server_reasoning
    return fmt or None


def bound(
    structure: Structure,
    tokenizer: Any,
    server_reasoning: ReasoningFormat | None = None,
    chat: bool = True,
) -> Any:
    """The structure's constraint bound to the model's tokenizer (None: none), or a 400
    naming its field. With a reasoning format (`reply_format`) the constraint applies
    to the content after the reasoning (`Constraint.after_reasoning`), as in vLLM."""
    if structure.constraint is None:
        return None
    try:
        constraint = structure.constraint.bind(tokenizer)
    except ConstraintError as e:
        raise refusal(e) from None
    fmt = reply_format(structure, server_reasoning, chat)
    return constraint if fmt is None else constraint.after_reasoning(fmt.constraint_after)


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def refusal(error: ConstraintError) -> APIError:
    """The 400 for a constraint that does not compile: its field, its one-line reason,
    and code "too_complex" for one over a limit (else "invalid_value")."""
    from ..constrain.compiler import TooComplex

    code = "too_complex" if isinstance(error, TooComplex) else "invalid_value"
    return APIError(400, str(error), param=error.param, code=code)


#: The request fields whose errors count as refused constraints in /metrics.
_REFUSED_PARAMS = frozenset((*CONSTRAINT_FIELDS, "tools", "tool_choice"))


def constraint_param(body: Mapping[str, Any]) -> str | None:
    """The field of a raw request body that asks for compiling (a constraint field, or
    `tools`), None when none does: named in the "too complex" refusal of a compile
    that runs out of time before the body is even parsed."""
    for name in CONSTRAINT_FIELDS:
        value = body.get(name)
        if value is not None and not (name == "response_format" and value == {"type": "text"}):
            return name
    return "tools" if body.get("tools") else None


class CompileGate:
    """Where a request's constraint compiles: `await gate(parse, body, tokenizer)`
    runs `parse()` (a request's parse, which compiles its constraint) and binds that
    constraint to `tokenizer`, on a `constrain.compiler.Compiler`'s pool within its
    time budget (`seconds`), so the event loop and the model's thread never wait on
    llguidance (issue #29); the scheduler then finds the constraint bound (`bound`
    returns it as it is). A request with nothing to compile is parsed at once. APIError
    400 naming the field for a spec that does not compile or is too complex, counted
    in `metrics` (refusals by reason, compile times)."""

    def __init__(self, metrics: Metrics | None = None, seconds: float | None = None) -> None:
        self.metrics = metrics
        self.seconds = seconds
        self._compiler: Compiler | None = None

    def compiler(self) -> Compiler | None:
        """The compile pool, made on first use (None without llguidance)."""
        if self._compiler is None:
            try:
                from ..constrain.compiler import COMPILE_SECONDS, Compiler
            except ImportError:
                return None
            m = self.metrics
            self._compiler = Compiler(
                COMPILE_SECONDS if self.seconds is None else self.seconds,
                on_compile=None if m is None else m.compile_time.observe,
                on_refuse=None if m is None else m.constraint_refused,
            )
        return self._compiler

    async def __call__(self, parse: Callable[[], R], body: Mapping[str, Any], tokenizer: Any) -> R:
        param = constraint_param(body)
        compiler = self.compiler() if param is not None else None
        if param is None or compiler is None:
            return parse()

        def work() -> R:
            req = parse()
            structure = getattr(req, "structure", None)
            c = getattr(structure, "constraint", None)
            if c is not None and tokenizer is not None:
                try:
                    req.structure = replace(structure, constraint=c.bind(tokenizer))  # type: ignore[attr-defined]
                except ConstraintError as e:
                    raise refusal(e) from None
            return req

        try:
            return await compiler.run(work, param=param)
        except ConstraintError as e:  # over the time budget (counted by the compiler)
            raise refusal(e) from None
        except APIError as e:
            if self.metrics is not None and e.status == 400 and e.param in _REFUSED_PARAMS:
                reason = "too_complex" if e.code == "too_complex" else "invalid"
                self.metrics.constraint_refused(reason)
            raise

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()


def _constraint(wire: StructuredFields) -> Constraint | None:
    given = [
        name
        for name in CONSTRAINT_FIELDS
        if getattr(wire, name) is not None
        and not (name == "response_format" and getattr(wire, name) == {"type": "text"})
    ]
    if len(given) > 1:
        raise _bad(given[1], f"give one constraint, not {' and '.join(repr(g) for g in given)}")
    if not given:
        return None
    name = given[0]
    value = getattr(wire, name)
    try:  # llguidance is optional: imported only when a request asks for a constraint
        from ..constrain import constraint_from, from_response_format, from_structured_outputs
    except ImportError as e:
        raise _bad(name, f"'{name}' needs llguidance, which this server lacks: {e}") from None
    try:
        if name == "response_format":
            return from_response_format(value)
        if name == "structured_outputs":
            return from_structured_outputs(value)
        if name == "json_schema":
            return constraint_from(json_schema=value, param=name)
        return constraint_from(grammar=value, param=name)
    except ConstraintError as e:
        raise refusal(e) from None


def _reasoning(value: Any) -> ReasoningFormat | Literal[False] | None:
    if value is None or value is False:
        return value
    try:
        return reasoning_format(tuple(value) if isinstance(value, list | tuple) else value)
    except ValueError as e:
        raise _bad("tokentrail", f"'tokentrail.reasoning': {e}") from None


def structure_of(wire: StructuredFields, chat: bool) -> Structure:
    """The request's `Structure` (APIError 400 naming the field for a bad spec)."""
    options = wire.tokentrail or TokentrailOptions()
    if options.reasoning is not None and not chat:
        raise _bad("tokentrail", "'tokentrail.reasoning' is for chat completions only")
    constraint = _constraint(wire)
    reasoning = _reasoning(options.reasoning)
    if options.retry is not None and (
        constraint is None or constraint.kind not in ("json_schema", "json_object")
    ):
        raise _bad(
            "tokentrail.retry",
            "'tokentrail.retry' retries JSON leaves: it needs a JSON constraint "
            "(response_format json_schema or json_object)",
        )
    return Structure(
        constraint=constraint,
        logprobs_mode=options.logprobs or "raw",
        fields=bool(options.fields),
        reasoning=reasoning,
        alarm=options.alarm,
        branch=options.branch,
        retry=options.retry,
    )


def _ungated(constraint: Constraint) -> APIError:
    return _bad(
        constraint.param,
        f"'{constraint.param}' constrains the content after the server's reasoning "
        "(--reasoning-parser), and this scheduler bound it without that format: send "
        'the reasoning with the request ("tokentrail": {"reasoning": ...}) or '
        'turn it off ("tokentrail": {"reasoning": false})',
    )


def structure_options(
    structure: Structure,
    server_reasoning: ReasoningFormat | None,
    chat: bool,
    scorer_for: Any,
    gated: bool = False,
) -> dict[str, Any]:
    """One choice's structure as `output.processor.OutputProcessor` keywords (reasoning,
    fields, schema, scorer, output_ids; empty: plain text). `scorer_for(output_ids)`
    returns a `ContinuationScorer` or None; it is called only when fields are on.
    `gated`: the caller bound the constraint with `server_reasoning` (`bound(structure,
    tokenizer, server_reasoning, chat)`); else a constraint that would start after the
    server's reasoning is a 400 (never a mask that starts before the reasoning ends)."""
    fmt = reply_format(structure, server_reasoning, chat)
    c = structure.constraint
    from_server = chat and structure.reasoning is None and fmt is not None
    if c is not None and from_server and fmt.constraint_after and not gated:
        raise _ungated(c)
    fields = structure.fields or structure.json_constrained
    if not fields and not fmt:
        return {}
    output_ids: list[int] = []
    return {
        "reasoning": fmt or None,
        "fields": fields,
        "scorer": scorer_for(output_ids) if fields else None,
        "output_ids": output_ids,
        "schema": structure.schema(),
    }
