"""Tool calls parsed in a model family's own output format, with their tokens.

Formats (`TOOL_PARSERS`, named as vLLM's `--tool-call-parser`):
- "hermes" (Hermes, Qwen2.5/Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- "llama3_json" (Llama 3.x): the reply is `{"name": ..., "parameters": {...}}` (optionally
  after `<|python_tag|>`; several calls separated by `;`);
- "mistral": `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, and the newer
  `[TOOL_CALLS]name[ARGS]{...}` (optionally `name[CALL_ID]id[ARGS]{...}`). Its markers are
  control tokens: decode with `skip_special_tokens=False`.

Each call's name and arguments come with their fields (see `fields`): the name at
`/tool_calls/N/function/name`, each argument leaf at `/tool_calls/N/arguments/<pointer>`,
with the tokens behind them narrowed to their bytes. `ToolCallStream` gives the same
calls in pieces as segments arrive (the shape of OpenAI's `delta.tool_calls`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import StructureError
from ..segment import Segment, TokenSpan
from .fields import ContinuationScorer, FieldBuilder, JsonField, TokenPlacement
from .jsonscan import JsonLeaf, JsonScanner, json_pointer

__all__ = [
    "TOOL_PARSERS",
    "Found",
    "Parsed",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallResult",
    "call_arguments",
    "call_of",
    "detect_tool_parser",
    "leaf_field",
    "parse_tool_calls",
    "parser_for",
    "tool_schemas",
]

#: name -> (the text that opens a call, what the format is for).
TOOL_PARSERS: dict[str, tuple[str, str]] = {
    "hermes": ("<tool_call>", "Hermes / Qwen: <tool_call>{json}</tool_call>"),
    "llama3_json": ("{", 'Llama 3: {"name": ..., "parameters": {...}}'),
    "mistral": ("[TOOL_CALLS]", "Mistral: [TOOL_CALLS][{...}] or [TOOL_CALLS]name[ARGS]{...}"),
}
_ARG_KEYS = ("arguments", "parameters")
Path = tuple[str | int, ...]


def tool_schemas(
    tools: Iterable[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]] | None,
) -> dict[str, Mapping[str, Any]]:
    """Each tool's `parameters` schema by its name, from OpenAI's `tools` list
    (`{"type": "function", "function": {"name", "parameters"}}`, or the bare function)
    or from a map of name to schema already. A tool without a schema is left out."""
    if tools is None:
        return {}
    if isinstance(tools, Mapping):
        return {k: v for k, v in tools.items() if isinstance(v, Mapping)}
    out: dict[str, Mapping[str, Any]] = {}
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping):
            continue
        name, params = function.get("name"), function.get("parameters")
        if isinstance(name, str) and isinstance(params, Mapping):
            out[name] = params
    return out


@dataclass(slots=True)
class ToolCall:
    """One call: `arguments` is the arguments' exact JSON text in the output (OpenAI's
    `function.arguments` string), `start`/`end` the call's char span (markers included),
    `tokens` the call's tokens, `fields` its name's and arguments' fields."""

    id: str
    name: str
    arguments: str
    start: int
    end: int
    tokens: tuple[TokenSpan, ...] = ()
    fields: list[JsonField] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's `message.tool_calls[i]`."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ToolCallResult:
    """A reply's tool calls and its `content`: the text outside them."""

    content: str
    calls: list[ToolCall]

    @property
    def fields(self) -> list[JsonField]:
        return [f for call in self.calls for f in call.fields]


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a streamed call (OpenAI's `delta.tool_calls[i]`): `id` and `name` in
    the first piece of a call, then `arguments` text in pieces."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
        if self.name is not None:
            function["name"] = self.name
        if self.arguments:
            function["arguments"] = self.arguments
        out["function"] = function
        return out


@dataclass(slots=True)
class Found:
    """A call found in text, maybe unfinished (streaming): where its parts are."""

    start: int
    end: int | None = None  # None: not finished yet
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    call_id: str | None = None
    name_span: tuple[int, int] | None = None  # a name that is not a JSON string (Mistral)
    args_string: str | None = None  # arguments the model wrote as a JSON string
    error: bool = False  # the text there is not JSON
    #: leaf, field path, char0, the leaf's path inside the arguments (None: the name)
    leaves: list[tuple[JsonLeaf, str, int, Path | None]] = field(default_factory=list)


def _scan(text: str, pos: int) -> tuple[JsonScanner, list[JsonLeaf]]:
    """The JSON value at char `pos`, read as far as the text goes."""
    scanner = JsonScanner()
    return scanner, scanner.feed(text[pos:])


def _object_call(text: str, pos: int, n: int, prefix: tuple = ()) -> Found:
    """Call `n`, the object {"name": ..., "arguments": {...}} at `prefix` in the JSON
    value at char `pos`."""
    scanner, leaves = _scan(text, pos)
    found = Found(pos + scanner.opened.get(prefix, 0))
    k = len(prefix)
    for leaf in leaves:
        if leaf.path[:k] != prefix or len(leaf.path) == k:
            continue
        path = leaf.path[k:]
        if path == ("name",):
            found.name = json.loads(text[pos + leaf.start : pos + leaf.end])
            found.leaves.append((leaf, f"/tool_calls/{n}/function/name", pos, None))
        elif path[0] in _ARG_KEYS:
            if len(path) == 1 and text[pos + leaf.start] == '"':
                found.args_string = json.loads(text[pos + leaf.start : pos + leaf.end])
            at = f"/tool_calls/{n}/arguments{json_pointer(path[1:])}"
            found.leaves.append((leaf, at, pos, path[1:]))
    for key in _ARG_KEYS:
        if (*prefix, key) in scanner.opened:
            found.args_start = pos + scanner.opened[(*prefix, key)]
            span = scanner.containers.get((*prefix, key))
            found.args_end = None if span is None else pos + span[1]
    span = scanner.containers.get(prefix)
    found.end = None if span is None else pos + span[1]
    found.error = scanner.error is not None
    return found


_SPACE = re.compile(r"\s*")
#: (the calls found, the content ranges, where the text after the last call starts).
Parsed = tuple[list[Found], list[tuple[int, int]], int]


def _after_space(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()  # type: ignore[union-attr]


def _hermes(text: str) -> Parsed:
    """<tool_call>{json}</tool_call>, any number of times, content around them."""
    calls: list[Found] = []
    content: list[tuple[int, int]] = []
    pos = 0
    while (i := text.find("<tool_call>", pos)) >= 0:
        content.append((pos, i))
        found = _object_call(text, _after_space(text, i + 11), len(calls))
        calls.append(found)
        if found.end is None:
            return calls, content, i
        pos = found.end
        close = re.compile(r"\s*</tool_call>").match(text, pos)
        if close is None:
            if "</tool_call>".startswith(text[pos:].lstrip()):  # the tag still arriving
                return calls, content, len(text)
            continue  # no closing tag: what follows is content
        pos = close.end()
    content.append((pos, len(text)))
    return calls, content, len(text)


def _llama3(text: str) -> Parsed:
    """Call objects {"name": ..., "parameters": {...}} in the reply (after an optional
    `<|python_tag|>`), `;` between several; other text around them is content."""
    calls: list[Found] = []
    content: list[tuple[int, int]] = []
    pos = _after_space(text, 0)
    if text.startswith("<|python_tag|>", pos):
        content.append((0, pos))
        pos += 14
    elif "<|python_tag|>".startswith(text[pos:]) and text[pos:]:
        return [], [(0, pos)], pos  # may still become the tag (the blanks before: content)
    since = pos if content else 0
    while (i := text.find("{", pos)) >= 0:
        found = _object_call(text, i, len(calls))
        if found.end is None and not found.error:  # still arriving: maybe a call
            content.append((since, i))
            calls.append(found)
            return calls, content, i
        if found.error or found.name is None or not _has_args(found):
            pos = i + 1  # JSON in prose, not a call
            continue
        content.append((since, i))
        calls.append(found)
        since = pos = found.end  # type: ignore[assignment]
        if re.compile(r"\s*;?\s*").fullmatch(text, pos):  # a separator, or the end
            return calls, content, pos
        sep = re.compile(r"\s*;?\s*(?=\{)").match(text, pos)
        if sep is not None:
            since = pos = sep.end()
    content.append((since, len(text)))
    return calls, content, len(text)


def _has_args(found: Found) -> bool:
    return found.args_start is not None or found.args_string is not None


_MISTRAL_NAME = re.compile(r"([^\[\]{}\s]+)(?:\[CALL_ID\]([^\[]*))?\[ARGS\]")


def _mistral(text: str) -> Parsed:
    """[TOOL_CALLS] then a JSON array of calls, or name[ARGS]{json} (repeated)."""
    i = text.find("[TOOL_CALLS]")
    if i < 0:
        return [], [(0, len(text))], len(text)
    calls: list[Found] = []
    pos = _after_space(text, i + 12)
    if text.startswith("[", pos):  # the older array form
        scanner, _ = _scan(text, pos)
        while (len(calls),) in scanner.opened:
            calls.append(_object_call(text, pos, len(calls), prefix=(len(calls),)))
        if scanner.end is None:
            return calls, [(0, i)], i
        return calls, [(0, i), (pos + scanner.end, len(text))], len(text)
    marker = i
    while m := _MISTRAL_NAME.match(text, pos):
        scanner, leaves = _scan(text, m.end())
        n = len(calls)
        found = Found(m.start(), name=m.group(1), args_start=m.end(), call_id=m.group(2))
        found.name_span = m.span(1)
        found.leaves = [
            (leaf, f"/tool_calls/{n}/arguments{json_pointer(leaf.path)}", m.end(), leaf.path)
            for leaf in leaves
        ]
        calls.append(found)
        if scanner.end is None:
            return calls, [(0, i)], marker
        found.end = found.args_end = m.end() + scanner.end
        pos = found.end
        if not text.startswith("[TOOL_CALLS]", pos):
            return calls, [(0, i), (pos, len(text))], len(text)
        marker, pos = pos, pos + 12
    return calls, [(0, i)], marker


_FORMATS: dict[str, Callable[[str], Parsed]] = {
    "hermes": _hermes,
    "llama3_json": _llama3,
    "mistral": _mistral,
}


def parser_for(name: str) -> Callable[[str], Parsed]:
    found = _FORMATS.get(name)
    if found is None:
        known = ", ".join(sorted(_FORMATS))
        raise StructureError(f"unknown tool-call parser {name!r}; known: {known}")
    return found


def leaf_field(
    text: str,
    entry: tuple[JsonLeaf, str, int, Path | None],
    placement: TokenPlacement,
    scorer: Any,
    schema: Mapping[str, Any] | None,
) -> JsonField | None:
    """The field of one leaf of a call (`Found.leaves` entry: leaf, path, char0, its path
    inside the arguments or None for the name), its allowed values from the called
    tool's `parameters` `schema`."""
    leaf, path, char0, inside = entry
    builder = FieldBuilder(placement, None if inside is None else schema, None, scorer,
                           path_of=lambda _p, at=path: at)  # fmt: skip
    byte0 = len(text[:char0].encode("utf-8", "surrogatepass"))
    # the leaf's path inside the arguments, where the parameters schema applies
    return builder.field(text, leaf if inside is None else replace(leaf, path=inside),
                         char0, byte0)  # fmt: skip


def call_of(
    text: str,
    found: Found,
    n: int,
    placement: TokenPlacement,
    scorer: Any,
    schemas: Mapping[str, Mapping[str, Any]],
    known: Mapping[str, JsonField] | None = None,
) -> ToolCall:
    """A finished call with its tokens and fields; its arguments' allowed values come
    from the called tool's `parameters` schema in `schemas` (by name). `known`: fields
    already built (by path), taken as they are."""
    fields: list[JsonField] = []
    schema = schemas.get(found.name or "")
    for entry in found.leaves:
        made = (known or {}).get(entry[1]) or leaf_field(text, entry, placement, scorer, schema)
        if made is not None:
            fields.append(made)
    if found.name_span is not None:
        a, b = found.name_span
        a8, b8 = (len(text[:x].encode("utf-8", "surrogatepass")) for x in (a, b))
        name = JsonField(f"/tool_calls/{n}/function/name", text[a:b], text[a:b],
                         placement.narrow(a8, b8), a, b)  # fmt: skip
        fields.insert(0, name)
    args = call_arguments(text, found)
    s8, e8 = (len(text[:x].encode("utf-8", "surrogatepass")) for x in (found.start, found.end))
    return ToolCall(
        found.call_id or f"call_{n}",
        found.name or "",
        args,
        found.start,
        found.end or len(text),
        placement.narrow(s8, e8),
        fields,
    )


def call_arguments(text: str, found: Found) -> str:
    """OpenAI's `arguments` string: the arguments' JSON text as written (so far)."""
    if found.args_start is not None:
        return text[found.args_start : found.args_end or len(text)]
    if found.args_string is not None:  # already serialised: passed on once decoded
        s = found.args_string
        return s if _is_json(s) else json.dumps(s)
    return "{}"


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def parse_tool_calls(
    text: str,
    segments: Iterable[Segment] | TokenPlacement,
    parser: str,
    *,
    scorer: ContinuationScorer | None = None,
    tools: Iterable[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]] | None = None,
    known: Mapping[str, JsonField] | None = None,
) -> ToolCallResult:
    """A whole reply's tool calls in format `parser` (see `TOOL_PARSERS`), with their
    tokens and fields. A call left unfinished (the reply was cut off) is not a call: its
    text is returned in `content`, as vLLM does.

    `tools` (OpenAI's `tools` list, or a map of name to `parameters` schema) give each
    argument the values its tool's schema allows (`enum`, `const`, `boolean`, through
    `$ref`/`anyOf`/`allOf`: `structure.schema`), and with `scorer` their alternatives;
    a boolean argument has true and false whatever the schema says. `known`: fields
    already built by path (a stream's), taken as they are."""
    parse = parser_for(parser)
    placement = TokenPlacement.of(segments)
    schemas = tool_schemas(tools)
    found, content, tail = parse(text)
    calls = [
        call_of(text, f, n, placement, scorer, schemas, known)
        for n, f in enumerate(found)
        if f.start < tail and f.end is not None and f.name is not None and not f.error
    ]
    rest = "".join(text[a:b] for a, b in content) + text[tail:]
    return ToolCallResult("" if not rest.strip() else rest, calls)


def detect_tool_parser(template: str) -> str | None:
    """The tool-call format a chat template asks the model for, or None if it names none."""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ('"parameters"' in template and "<|eom_id|>" in template):
        return "llama3_json"
    return None
