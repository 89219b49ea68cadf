"""Tool calls on chat completions: the `tools` and `tool_choice` request fields (the
rules are `structure.tool_choice`'s, shared with `stream_generate`; the reply's calls
come from `output.processor.OutputProcessor` and are written by `formatting`).

The model's chat template renders the tools (`prompting.chat_ids(..., tools=...)`).
With `tool_choice` "auto" the reply is parsed in the model family's own format
(`--tool-call-parser NAME`, else detected from the template by
`structure.detect_tool_parser`); "none" leaves it as text. "required" and a named
function constrain the reply, as vLLM does, to one JSON call
``{"name": ..., "parameters": {...}}`` (the named function's, or any tool's), compiled
by llguidance from a JSON schema, and parse it with the "llama3_json" parser, whatever
the model's own format: the call is always well-formed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import APIError, ConstraintError
from ..structure.tool_choice import CONSTRAINED_PARSER, check_tools, tool_choice_of

__all__ = [
    "CONSTRAINED_PARSER",
    "FunctionSpec",
    "ToolSpec",
    "template_messages",
    "tool_constraint",
    "with_tools",
]

_CONFIG = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)


def _name_field() -> Any:
    return Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")


class FunctionSpec(BaseModel):
    """A tool's `function`: its name, description and JSON-schema parameters."""

    model_config = _CONFIG

    name: str = _name_field()
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    """One entry of `tools`."""

    model_config = _CONFIG

    type: Literal["function"]
    function: FunctionSpec

    def as_template(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI's own shape)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def tool_constraint(tools: Sequence[ToolSpec] | None, tool_choice: Any) -> tuple[Any, str]:
    """(the constraint `tool_choice` puts on the reply or None, the choice as "auto",
    "none", "required" or "named"): `structure.tool_choice.tool_choice_of`, with its
    ConstraintError as a 400 naming `tool_choice` or `tools`."""
    specs = [t.as_template() for t in tools] if tools else None
    try:
        return tool_choice_of(check_tools(specs), tool_choice)
    except ConstraintError as e:
        what = str(e).removeprefix(f"{e.param}: ")
        code = "too_complex" if "too complex" in what else "invalid_value"
        raise APIError(400, what, param=e.param, code=code) from None


def with_tools(structure: Any, tools: Sequence[ToolSpec] | None, tool_choice: Any) -> Any:
    """`structure` (a `structured.Structure`) with the constraint `tool_choice` asks
    for, and the choice ("auto", "none", "required", "named") as `tool_choice`."""
    from dataclasses import replace

    constraint, choice = tool_constraint(tools, tool_choice)
    if constraint is None:
        return replace(structure, tool_choice=choice)
    if structure.constraint is not None:
        raise _bad(
            "tool_choice",
            f"'tool_choice' {choice} constrains the reply to a call; it cannot be combined "
            f"with '{structure.constraint.param}'",
        )
    return replace(structure, constraint=constraint, tool_choice=choice)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant `tool_calls` with their `arguments` strings parsed to objects, as chat
    templates expect them (vLLM does the same)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = dict(m, tool_calls=[_parsed_call(c) for c in calls])
        out.append(m)
    return out


def _parsed_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), str):
        return call
    try:
        args = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": args}}
