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
from ..stops import splittable
from .fields import ContinuationScorer, FieldBuilder, JsonField, TokenPlacement
from .jsonscan import JsonLeaf, JsonScanner, json_pointer

__all__ = [
    "TOOL_PARSERS",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallResult",
    "ToolCallStream",
    "detect_tool_parser",
    "parse_tool_calls",
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
class _Found:
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


def _object_call(text: str, pos: int, n: int, prefix: tuple = ()) -> _Found:
    """Call `n`, the object {"name": ..., "arguments": {...}} at `prefix` in the JSON
    value at char `pos`."""
    scanner, leaves = _scan(text, pos)
    found = _Found(pos + scanner.opened.get(prefix, 0))
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
_Parsed = tuple[list[_Found], list[tuple[int, int]], int]


def _after_space(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()  # type: ignore[union-attr]


def _hermes(text: str) -> _Parsed:
    """<tool_call>{json}</tool_call>, any number of times, content around them."""
    calls: list[_Found] = []
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


def _llama3(text: str) -> _Parsed:
    """Call objects {"name": ..., "parameters": {...}} in the reply (after an optional
    `<|python_tag|>`), `;` between several; other text around them is content."""
    calls: list[_Found] = []
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


def _has_args(found: _Found) -> bool:
    return found.args_start is not None or found.args_string is not None


_MISTRAL_NAME = re.compile(r"([^\[\]{}\s]+)(?:\[CALL_ID\]([^\[]*))?\[ARGS\]")


def _mistral(text: str) -> _Parsed:
    """[TOOL_CALLS] then a JSON array of calls, or name[ARGS]{json} (repeated)."""
    i = text.find("[TOOL_CALLS]")
    if i < 0:
        return [], [(0, len(text))], len(text)
    calls: list[_Found] = []
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
        found = _Found(m.start(), name=m.group(1), args_start=m.end(), call_id=m.group(2))
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


_FORMATS: dict[str, Callable[[str], _Parsed]] = {
    "hermes": _hermes,
    "llama3_json": _llama3,
    "mistral": _mistral,
}


def _parser(name: str) -> Callable[[str], _Parsed]:
    found = _FORMATS.get(name)
    if found is None:
        known = ", ".join(sorted(_FORMATS))
        raise StructureError(f"unknown tool-call parser {name!r}; known: {known}")
    return found


def _call(
    text: str,
    found: _Found,
    n: int,
    placement: TokenPlacement,
    scorer: Any,
    schemas: Mapping[str, Mapping[str, Any]],
) -> ToolCall:
    """A finished call with its tokens and fields; its arguments' allowed values come
    from the called tool's `parameters` schema in `schemas` (by name)."""
    fields: list[JsonField] = []
    schema = schemas.get(found.name or "")
    for leaf, path, char0, inside in found.leaves:
        builder = FieldBuilder(placement, None if inside is None else schema, None, scorer,
                               path_of=lambda _p, at=path: at)  # fmt: skip
        byte0 = len(text[:char0].encode("utf-8", "surrogatepass"))
        # the leaf's path inside the arguments, where the parameters schema applies
        made = builder.field(text, leaf if inside is None else replace(leaf, path=inside),
                             char0, byte0)  # fmt: skip
        if made is not None:
            fields.append(made)
    if found.name_span is not None:
        a, b = found.name_span
        a8, b8 = (len(text[:x].encode("utf-8", "surrogatepass")) for x in (a, b))
        name = JsonField(f"/tool_calls/{n}/function/name", text[a:b], text[a:b],
                         placement.narrow(a8, b8), a, b)  # fmt: skip
        fields.insert(0, name)
    args = _arguments(text, found)
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


def _arguments(text: str, found: _Found) -> str:
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
) -> ToolCallResult:
    """A whole reply's tool calls in format `parser` (see `TOOL_PARSERS`), with their
    tokens and fields. A call left unfinished (the reply was cut off) is not a call: its
    text is returned in `content`, as vLLM does.

    `tools` (OpenAI's `tools` list, or a map of name to `parameters` schema) give each
    argument the values its tool's schema allows (`enum`, `const`, `boolean`, through
    `$ref`/`anyOf`/`allOf`: `structure.schema`), and with `scorer` their alternatives;
    a boolean argument has true and false whatever the schema says."""
    parse = _parser(parser)
    placement = TokenPlacement.of(segments)
    schemas = tool_schemas(tools)
    found, content, tail = parse(text)
    calls = [
        _call(text, f, n, placement, scorer, schemas)
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


class ToolCallStream:
    """Tool calls in pieces as segments arrive: `feed` returns (content text now final,
    call pieces); `finish` returns the last ones, and `result` is then the whole parse
    (as `parse_tool_calls`). Text that may still open a call is held back.

    Each feed parses the reply so far again (calls are short); what was emitted is
    never taken back, so a call cut off at the end has had its pieces streamed although
    `result` counts its text as content. `tools` and `scorer` give the calls' fields
    their allowed values and alternatives, as in `parse_tool_calls`.
    """

    def __init__(
        self,
        parser: str,
        *,
        tools: Iterable[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]] | None = None,
        scorer: ContinuationScorer | None = None,
    ) -> None:
        self.parser = parser
        self.tools = tool_schemas(tools)
        self.scorer = scorer
        self._parse = _parser(parser)
        self._open = TOOL_PARSERS[parser][0]
        self._segments: list[Segment] = []
        self._text = ""
        self._content_out = 0
        self._started: set[int] = set()
        self._args_out: dict[int, int] = {}
        self.result: ToolCallResult | None = None
        self._tokens = _TokenHold()

    def feed(self, segments: Segment | Iterable[Segment]) -> tuple[str, list[ToolCallDelta]]:
        new = [segments] if isinstance(segments, Segment) else list(segments)
        self._segments += new
        self._text += "".join(s.text for s in new)
        for seg in new:
            self._tokens.add(seg)
        return self._step(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        out = self._step(final=True)
        self.result = parse_tool_calls(
            self._text, self._segments, self.parser, scorer=self.scorer, tools=self.tools
        )
        return out

    def released_tokens(self) -> list[TokenSpan]:
        """The tokens released as content since the last call, in order, each once.

        A token is released when content text it wrote is given out (`feed`'s
        content), so a token whose text the parser holds (it may open a call) waits,
        and one whose bytes all went into calls (or their markers) is never released.
        A token that wrote content and call text both (`>` + `\n` after a call) is
        released with its content. A token with no bytes is released in its place in
        the order. After `finish` every token is decided."""
        return self._tokens.take(final=self.result is not None)

    def _step(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        text = self._text
        found, content, tail = self._parse(text)
        ranges = list(content)
        if final:
            ranges.append((tail, len(text)))
        elif content and content[-1][1] == len(text):
            ranges = _trimmed(ranges, _held(text, self._open))
        joined = "".join(text[a:b] for a, b in ranges)
        piece = joined[self._content_out :]
        if piece:
            self._tokens.emitted(text, _sources(ranges, self._content_out, len(joined)))
        self._content_out = max(self._content_out, len(joined))
        deltas: list[ToolCallDelta] = []
        for n, f in enumerate(found):
            if f.name is None or (f.args_start is None and f.end is None):
                break  # the name and the start of the arguments come first
            if n not in self._started:
                self._started.add(n)
                deltas.append(ToolCallDelta(n, f.call_id or f"call_{n}", f.name))
            if f.args_start is not None or f.end is not None:
                args = _arguments(text, f)
                done = self._args_out.get(n, 0)
                if len(args) > done:
                    deltas.append(ToolCallDelta(n, arguments=args[done:]))
                    self._args_out[n] = len(args)
        return piece, deltas


def _held(text: str, marker: str) -> int:
    """How many chars at the end of `text` may start `marker`."""
    for start in range(max(0, len(text) - len(marker) + 1), len(text)):
        if marker.startswith(text[start:]):
            return len(text) - start
    return 0


def _trimmed(ranges: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """`ranges` less their last `n` chars."""
    out = list(ranges)
    while n > 0 and out:
        a, b = out.pop()
        if b - a > n:
            out.append((a, b - n))
        n -= b - a
    return out


def _sources(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """Where chars [lo, hi) of the ranges' joined text stand in the text."""
    out: list[tuple[int, int]] = []
    pos = 0
    for a, b in ranges:
        s, e = max(lo, pos), min(hi, pos + b - a)
        if s < e:
            out.append((a + s - pos, a + e - pos))
        pos += b - a
    return out


class _TokenHold:
    """The content tokens a `ToolCallStream` has not released yet, placed on the bytes
    of its text, and the byte ranges of that text given out as content."""

    def __init__(self) -> None:
        self._queue: list[tuple[int, int, TokenSpan]] = []  # byte range in the text, span
        self._head = 0  # the first token not decided yet
        self._size = 0  # bytes of the text so far
        self._out: list[tuple[int, int]] = []  # byte ranges given out, in order
        self._chars = (0, 0)  # a (char, byte) offset pair, to place the next range
        self._last = -1  # the last token index released

    def add(self, segment: Segment) -> None:
        raw = len(segment.text.encode("utf-8", "surrogatepass"))
        base = self._size
        pos = base
        exact = splittable(segment)
        for t in segment.tokens:
            n = t.end - t.start
            self._queue.append((pos, pos + n, t) if exact else (base, base + raw, t))
            pos += n
        self._size += raw

    def _byte(self, text: str, char: int) -> int:
        c0, b0 = self._chars
        if char < c0:
            c0, b0 = 0, 0
        b = b0 + len(text[c0:char].encode("utf-8", "surrogatepass"))
        self._chars = (char, b)
        return b

    def emitted(self, text: str, ranges: list[tuple[int, int]]) -> None:
        for a, b in ranges:
            a8, b8 = self._byte(text, a), self._byte(text, b)
            if self._out and self._out[-1][1] == a8:
                self._out[-1] = (self._out[-1][0], b8)
            else:
                self._out.append((a8, b8))

    def _wrote_content(self, s: int, e: int) -> bool:
        for a, b in reversed(self._out):
            if a < e:
                return b > s
        return False

    def take(self, final: bool) -> list[TokenSpan]:
        frontier = self._size if final else (self._out[-1][1] if self._out else 0)
        out: list[TokenSpan] = []
        queue, k = self._queue, self._head
        while k < len(queue):
            s, e, span = queue[k]
            if e > s and not self._wrote_content(s, e):
                if e > frontier:
                    break  # still held: content or a call, not known yet
            elif span.index > self._last:
                out.append(span)
                self._last = span.index
            k += 1
        self._head = k
        if k > 4096:
            del queue[:k]
            self._head = 0
        return out
