"""Tool calls on chat completions: the `tools` and `tool_choice` request fields, the
constraint `required` and a named function put on the reply, and `ToolReply`, which
turns one choice's content into OpenAI's `delta.tool_calls` / `message.tool_calls`.

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
from ..segment import Segment, TokenSpan
from ..structure.tools import TOOL_PARSERS, ToolCallStream, detect_tool_parser, parse_tool_calls

__all__ = [
    "CONSTRAINED_PARSER",
    "FunctionSpec",
    "ToolReply",
    "ToolSpec",
    "check_tools",
    "template_messages",
    "tool_constraint",
    "tool_parser_for",
    "with_tools",
]

#: The format a constrained call (tool_choice "required" or named) is written in.
CONSTRAINED_PARSER = "llama3_json"
#: The most tools one request may list (OpenAI's own limit).
MAX_TOOLS = 128
#: The most bytes of JSON all of a request's tools may take together.
MAX_TOOLS_BYTES = 256 * 1024

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


def _choice_name(tool_choice: Any, tools: Sequence[ToolSpec]) -> str | None:
    """The function `tool_choice` names (None for a string choice), checked."""
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none", "required"):
            raise _bad("tool_choice", f"'tool_choice' must be auto, none, required or "
                       f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                       f"got {tool_choice!r}")  # fmt: skip
        return None
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function" or not (
        isinstance(name, str)
    ):
        raise _bad("tool_choice", "'tool_choice' must be auto, none, required or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}")  # fmt: skip
    if name not in {t.function.name for t in tools}:
        raise _bad("tool_choice", f"'tool_choice' names {name!r}, which is not in 'tools'")
    return name


def check_tools(tools: Sequence[ToolSpec]) -> None:
    """A tool list checked like a schema before anything compiles or renders it: at most
    `MAX_TOOLS` tools of `MAX_TOOLS_BYTES` in all, names unique, each `parameters` a
    JSON schema with a finite instance and sane bounds (`constrain.schema_check`).
    APIError 400 naming `tools`, in one line."""
    if len(tools) > MAX_TOOLS:
        raise _bad("tools", f"'tools' lists {len(tools)} tools; at most {MAX_TOOLS} are taken")
    seen: set[str] = set()
    size = 0
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            raise _bad("tools", f"'tools[{i}]' repeats the name {name!r}; names must be unique")
        seen.add(name)
        params = tool.function.parameters
        try:
            size += len(json.dumps(params)) if params is not None else 0
        except (RecursionError, ValueError):
            raise _bad("tools", f"'tools[{i}].function.parameters' nests too deeply") from None
        if size > MAX_TOOLS_BYTES:
            raise _bad("tools", f"'tools' take more than {MAX_TOOLS_BYTES} bytes of JSON")
        if params is None:
            continue
        if params.get("type", "object") != "object":
            raise _bad("tools", f"'tools[{i}].function.parameters' must be a JSON schema of "
                       f"type object, got type {params.get('type')!r}")  # fmt: skip
        try:
            from ..constrain.schema_check import check_schema
        except ImportError:  # pragma: no cover - llguidance missing: nothing compiles them
            continue
        try:
            check_schema(params, "tools")
        except ConstraintError as e:
            what = str(e).removeprefix("tools: ")
            code = "too_complex" if "too complex" in what else "invalid_value"
            raise APIError(400, f"'tools[{i}].function.parameters': {what}", param="tools",
                           code=code) from None  # fmt: skip


def _call_schema(tool: ToolSpec) -> dict[str, Any]:
    params = tool.function.parameters or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "parameters": params},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def tool_constraint(tools: Sequence[ToolSpec] | None, tool_choice: Any) -> tuple[Any, str]:
    """(the constraint `tool_choice` puts on the reply or None, the choice as "auto",
    "none", "required" or "named"). APIError 400 naming `tool_choice` or `tools`."""
    if tools:
        check_tools(tools)
    if tool_choice is None:
        return None, "auto" if tools else "none"
    if not tools:
        raise _bad("tool_choice", "'tool_choice' needs 'tools'")
    name = _choice_name(tool_choice, tools)
    if name is None and tool_choice in ("auto", "none"):
        return None, tool_choice
    chosen = [t for t in tools if name is None or t.function.name == name]
    schema = _call_schema(chosen[0]) if len(chosen) == 1 else {
        "anyOf": [_call_schema(t) for t in chosen]
    }
    try:
        from ..constrain import constraint_from
    except ImportError as e:
        raise _bad("tool_choice", f"this 'tool_choice' needs llguidance: {e}") from None
    try:
        # the reply is only the call: no blanks before it (they would be blank content)
        call = constraint_from(json_schema=schema, param="tools", leading_whitespace=False)
        return call, "required" if name is None else "named"
    except ConstraintError as e:
        what = str(e).removeprefix("tools: ")
        code = "too_complex" if "too complex" in what else "invalid_value"
        raise APIError(400, f"a tool's parameters do not compile: {what}", param="tools",
                       code=code) from None  # fmt: skip


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


def tool_parser_for(choice: str, configured: str | None, tokenizer: Any) -> str | None:
    """The parser a reply with tools goes through (None: no parsing, tool_choice none).
    APIError 400 naming `tools` when "auto" finds none."""
    if choice == "none":
        return None
    if choice in ("required", "named"):
        return CONSTRAINED_PARSER
    if configured is not None:
        return configured
    template = getattr(tokenizer, "chat_template", None)
    found = detect_tool_parser(template) if isinstance(template, str) else None
    if found is None:
        raise _bad(
            "tools",
            "this model's chat template names no tool-call format; start the server with "
            f"--tool-call-parser ({', '.join(sorted(TOOL_PARSERS))}), or send "
            "tool_choice 'required' or a named function",
        )
    return found


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


class ToolReply:
    """One choice's content through a tool-call parser: `feed` takes a step's content
    segments and returns (content text now final, `delta.tool_calls` pieces);
    `finish` the last ones. Afterwards `calls` are the whole parse's calls (dicts of
    `message.tool_calls`) and `fields` their fields."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.stream = ToolCallStream(parser)
        self.segments: list[Segment] = []
        self.result: Any = None

    def feed(self, segments: list[Segment]) -> tuple[str, list[dict[str, Any]]]:
        self.segments += segments
        piece, deltas = self.stream.feed(segments)
        return piece, [d.to_dict() for d in deltas]

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        piece, deltas = self.stream.finish()
        text = "".join(s.text for s in self.segments)
        self.result = parse_tool_calls(text, self.segments, self.parser)
        return piece, [d.to_dict() for d in deltas]

    def released(self) -> list[TokenSpan]:
        """The content tokens the parser let through since the last call, in order
        (`ToolCallStream.released_tokens`): a token whose text may still open a call
        waits, one that wrote only call text never comes; `logprobs.content` lists
        these (the calls' fields and the extension's segments list every token)."""
        return self.stream.released_tokens()

    @property
    def calls(self) -> list[dict[str, Any]]:
        return [] if self.result is None else [c.to_dict() for c in self.result.calls]

    @property
    def content(self) -> str:
        return "" if self.result is None else self.result.content
