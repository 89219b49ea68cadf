"""What `tools` and `tool_choice` ask of a reply, for every entry point.

`tool_choice` "auto" parses the reply in the model family's own format (a configured
parser, else the one the chat template names: `tools.detect_tool_parser`); "none"
leaves it as text. "required" and a named function constrain the reply, as vLLM does,
to one JSON call ``{"name": ..., "parameters": {...}}`` (the named function's, or any
tool's), compiled by llguidance from a JSON schema, and parse it with the
"llama3_json" parser whatever the model's own format, so the call is always
well-formed. Tools are OpenAI's shape (``{"type": "function", "function": {"name",
"description", "parameters"}}``). Bad input is a `ConstraintError` naming the field
(`tools` or `tool_choice`); the server turns it into a 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ConstraintError
from .schema import rebase_refs
from .tools import TOOL_PARSERS, detect_tool_parser

__all__ = [
    "CONSTRAINED_PARSER",
    "MAX_TOOLS",
    "MAX_TOOLS_BYTES",
    "ToolChoice",
    "check_tools",
    "tool_choice_of",
    "tool_parser_for",
    "tools_for",
]

#: The format a constrained call (tool_choice "required" or named) is written in.
CONSTRAINED_PARSER = "llama3_json"

#: "auto", "none", "required" or "named".
ToolChoice = str

_CHOICE_SHAPE = (
    "'tool_choice' must be auto, none, required or "
    '{"type": "function", "function": {"name": ...}}'
)


def _name(tool: Mapping[str, Any]) -> str | None:
    function = tool.get("function") if isinstance(tool, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    return name if isinstance(name, str) else None


def _choice_name(tool_choice: Any, tools: Sequence[Mapping[str, Any]]) -> str | None:
    """The function `tool_choice` names (None for a string choice), checked."""
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none", "required"):
            raise ConstraintError(f"{_CHOICE_SHAPE}, got {tool_choice!r}", "tool_choice")
        return None
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if (
        not isinstance(tool_choice, Mapping)
        or tool_choice.get("type") != "function"
        or not isinstance(name, str)
    ):
        raise ConstraintError(_CHOICE_SHAPE, "tool_choice")
    if name not in {_name(t) for t in tools}:
        raise ConstraintError(
            f"'tool_choice' names {name!r}, which is not in 'tools'", "tool_choice"
        )
    return name


def _call_schema(tool: Mapping[str, Any], at: str = "") -> dict[str, Any]:
    """The schema of one call to `tool`, standing at JSON Pointer `at` of the
    constraint (its parameters' local refs, `#/$defs/...`, moved along with them)."""
    function = tool["function"]
    params = function.get("parameters") or {"type": "object"}
    params = rebase_refs(params, f"{at}/properties/parameters")
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "parameters": params},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


#: The most tools one request may list (OpenAI's own limit).
MAX_TOOLS = 128
#: The most bytes of JSON all of a request's tools may take together.
MAX_TOOLS_BYTES = 256 * 1024


def check_tools(tools: Any) -> list[Mapping[str, Any]] | None:
    """`tools` checked as OpenAI's list of functions, like a schema, before anything
    compiles or renders it (None: no tools): at most `MAX_TOOLS` tools of
    `MAX_TOOLS_BYTES` in all, names unique, each `parameters` a JSON schema of type
    object with a finite instance and sane bounds (`constrain.schema_check`, where
    llguidance is installed). ConstraintError naming `tools`, in one line ("too
    complex" for what is over a limit)."""
    if tools is None:
        return None
    if isinstance(tools, str | bytes) or not isinstance(tools, Sequence):
        raise ConstraintError(
            "'tools' must be a list of {type: function, function: {...}}", "tools"
        )
    if len(tools) > MAX_TOOLS:
        raise ConstraintError(
            f"'tools' lists {len(tools)} tools; at most {MAX_TOOLS} are taken: too complex",
            "tools",
        )
    seen: set[str] = set()
    size = 0
    for i, tool in enumerate(tools):
        name = _name(tool)
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or name is None:
            raise ConstraintError(
                f'\'tools[{i}]\' must be {{"type": "function", "function": '
                f'{{"name": ...}}}}, got {tool!r}'[:300],
                "tools",
            )
        if name in seen:
            raise ConstraintError(
                f"'tools[{i}]' repeats the name {name!r}; names must be unique", "tools"
            )
        seen.add(name)
        params = tool["function"].get("parameters")
        size += _json_size(params, i)
        if size > MAX_TOOLS_BYTES:
            raise ConstraintError(
                f"'tools' take more than {MAX_TOOLS_BYTES} bytes of JSON: too complex", "tools"
            )
        if params is not None:
            _check_parameters(params, i)
    return list(tools) or None


def _json_size(params: Any, i: int) -> int:
    try:
        return len(json.dumps(params)) if params is not None else 0
    except (RecursionError, ValueError, TypeError):
        raise ConstraintError(
            f"'tools[{i}].function.parameters' is not JSON or nests too deeply", "tools"
        ) from None


def _check_parameters(params: Any, i: int) -> None:
    where = f"'tools[{i}].function.parameters'"
    if not isinstance(params, Mapping):
        raise ConstraintError(f"{where} must be a JSON schema", "tools")
    if params.get("type", "object") != "object":
        raise ConstraintError(
            f"{where} must be a JSON schema of type object, got type {params.get('type')!r}",
            "tools",
        )
    try:
        from ..constrain.schema_check import check_schema
    except ImportError:  # llguidance missing: nothing compiles them
        return
    try:
        check_schema(params, "tools")
    except ConstraintError as e:
        raise ConstraintError(f"{where}: {str(e).removeprefix('tools: ')}", "tools") from None


def tool_choice_of(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any) -> tuple[Any, str]:
    """(the constraint `tool_choice` puts on the reply, unbound, or None; the choice as
    "auto", "none", "required" or "named"). ConstraintError naming the field."""
    if tool_choice is None:
        return None, "auto" if tools else "none"
    if not tools:
        raise ConstraintError("'tool_choice' needs 'tools'", "tool_choice")
    name = _choice_name(tool_choice, tools)
    if name is None and tool_choice in ("auto", "none"):
        return None, tool_choice
    chosen = [t for t in tools if name is None or _name(t) == name]
    schema = (
        _call_schema(chosen[0])
        if len(chosen) == 1
        else {"anyOf": [_call_schema(t, f"/anyOf/{i}") for i, t in enumerate(chosen)]}
    )
    try:
        from ..constrain import constraint_from
    except ImportError as e:
        raise ConstraintError(f"this 'tool_choice' needs llguidance: {e}", "tool_choice") from None
    try:
        # the reply is only the call: no blanks before it (they would be blank content)
        call = constraint_from(json_schema=schema, param="tools", leading_whitespace=False)
    except ConstraintError as e:
        raise ConstraintError(f"a tool's parameters do not compile: {e}", "tools") from None
    return call, "required" if name is None else "named"


def tool_parser_for(choice: str | None, configured: str | None, tokenizer: Any) -> str | None:
    """The parser a reply with tools goes through (None: no tools, or tool_choice none).
    ConstraintError naming `tools` when "auto" finds no format."""
    if choice is None or choice == "none":
        return None
    if choice in ("required", "named"):
        return CONSTRAINED_PARSER
    if configured is not None:
        if configured not in TOOL_PARSERS:
            raise ConstraintError(
                f"unknown tool-call parser {configured!r}; "
                f"known: {', '.join(sorted(TOOL_PARSERS))}",
                "tool_parser",
            )
        return configured
    template = getattr(tokenizer, "chat_template", None)
    found = detect_tool_parser(template) if isinstance(template, str) else None
    if found is None:
        raise ConstraintError(
            "this model's chat template names no tool-call format; name one "
            f"(--tool-call-parser / tool_parser=: {', '.join(sorted(TOOL_PARSERS))}), or send "
            "tool_choice 'required' or a named function",
            "tools",
        )
    return found


def tools_for(
    tokenizer: Any,
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: Any,
    tool_parser: str | None = None,
    constraint: Any = None,
) -> tuple[Any, str | None]:
    """For the library's keywords: (the constraint, `constraint` or the call
    `tool_choice` forces, bound to `tokenizer`; the tool-call parser, None without
    tools). ConstraintError naming `tools` or `tool_choice`, ValueError for a forced call
    with another constraint."""
    if tools is None and tool_choice is None:
        return constraint, None
    checked = check_tools(tools)
    call, how = tool_choice_of(checked, tool_choice)
    if call is not None:
        if constraint is not None:
            raise ValueError(
                f"tool_choice {how} constrains the reply to a call; give it without "
                f"{constraint.param}"
            )
        constraint = call.bind(tokenizer)
    return constraint, tool_parser_for(how if checked else None, tool_parser, tokenizer)
