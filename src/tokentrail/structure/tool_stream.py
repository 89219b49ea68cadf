"""Tool calls streamed: `ToolCallStream` gives a reply's calls in pieces as its final
segments arrive (OpenAI's `delta.tool_calls` shape), the content around them, the
content tokens it lets through, and each call's fields as soon as their last character
has arrived. The formats and the whole-reply parse are `tools`'.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..segment import Segment, TokenSpan
from ..stops import merge_spans, splittable
from .fields import ContinuationScorer, JsonField, TokenPlacement
from .reasoning import ChannelSegment
from .tools import (
    TOOL_PARSERS,
    ToolCallDelta,
    ToolCallResult,
    call_arguments,
    leaf_field,
    parse_tool_calls,
    parser_for,
    tool_schemas,
)

__all__ = ["ToolCallStream"]


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
        self._parse = parser_for(parser)
        self._open = TOOL_PARSERS[parser][0]
        self._segments: list[Segment] = []
        self._text = ""
        self._content_out = 0
        self._started: set[int] = set()
        self._args_out: dict[int, int] = {}
        self.result: ToolCallResult | None = None
        self._tokens = _TokenHold()
        self._placement = TokenPlacement()
        #: Fields built so far, by path, and those not handed out yet (`take_fields`).
        self._fields: dict[str, JsonField] = {}
        self._fresh: list[JsonField] = []
        #: The text decided so far (chars, and the same point in bytes), and the channel
        #: parts decided since the last `take_parts`.
        self._decided = (0, 0)
        self._parts: list[ChannelSegment] = []
        self._channel = "content"

    def feed(self, segments: Segment | Iterable[Segment]) -> tuple[str, list[ToolCallDelta]]:
        new = [segments] if isinstance(segments, Segment) else list(segments)
        self._segments += new
        self._text += "".join(s.text for s in new)
        for seg in new:
            self._tokens.add(seg)
            self._placement.add(seg)
        return self._step(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        out = self._step(final=True)
        self.result = parse_tool_calls(
            self._text, self._placement, self.parser, scorer=self.scorer, tools=self.tools,
            known=self._fields,
        )  # fmt: skip
        for call in self.result.calls:
            for f in call.fields:
                if f.path not in self._fields:
                    self._fields[f.path] = f
                    self._fresh.append(f)
        return out

    @property
    def channel(self) -> str:
        """"tool_call" while the text decided last is a call's, else "content"."""
        return self._channel

    def take_parts(self) -> list[ChannelSegment]:
        """The reply's text decided since the last call, as channel parts in order:
        "content" where the parser let it through, "tool_call" for a call's text (its
        markers included), each with its tokens narrowed to the bytes that went there.
        Text is decided once nothing later can change which it is (a call's is once the
        call is complete; content that may still open a call waits), so the parts lag the
        text as the content does."""
        out, self._parts = self._parts, []
        return out

    def take_fields(self) -> list[JsonField]:
        """The calls' fields completed since the last call, in order: a field is given
        once its last character has arrived (the name's and each argument's), so each
        comes with the piece of text that completes it; after `finish`, the rest of the
        finished calls' (a Mistral name). The whole parse's calls hold the same ones."""
        out, self._fresh = self._fresh, []
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
        self._decide(text, ranges, found, tail, final)
        joined = "".join(text[a:b] for a, b in ranges)
        piece = joined[self._content_out :]
        if piece:
            self._tokens.emitted(text, _sources(ranges, self._content_out, len(joined)))
        self._content_out = max(self._content_out, len(joined))
        deltas: list[ToolCallDelta] = []
        for n, f in enumerate(found):
            if f.name is not None and not f.error:
                self._leaf_fields(text, f)
            if f.name is None or (f.args_start is None and f.end is None):
                break  # the name and the start of the arguments come first
            if n not in self._started:
                self._started.add(n)
                deltas.append(ToolCallDelta(n, f.call_id or f"call_{n}", f.name))
            if f.args_start is not None or f.end is not None:
                args = call_arguments(text, f)
                done = self._args_out.get(n, 0)
                if len(args) > done:
                    deltas.append(ToolCallDelta(n, arguments=args[done:]))
                    self._args_out[n] = len(args)
        return piece, deltas

    def _decide(
        self,
        text: str,
        ranges: list[tuple[int, int]],
        found: list[Any],
        tail: int,
        final: bool,
    ) -> None:
        """Add the parts of the text decided now: content `ranges` and, between them, the
        complete calls (see `take_parts`)."""
        if final:
            frontier = len(text)
        else:
            frontier = ranges[-1][1] if ranges else 0
            for f in found:
                if f.end is not None and f.name is not None and not f.error and f.start < tail:
                    frontier = max(frontier, f.end)
        start = self._decided[0]
        pos = start
        for a, b in ranges if frontier > start else ():
            a, b = max(a, start), min(b, frontier)
            if a >= b:
                continue
            if a > pos:
                self._part(text, pos, a, "tool_call")
            self._part(text, a, b, "content")
            pos = b
        if pos < frontier:
            self._part(text, pos, frontier, "tool_call")
        if final:  # zero-byte tokens at the very end (an EOS) go with the last part
            end = self._placement.empty_at(self._decided[1])
            if end:
                last = self._parts[-1] if self._parts else ChannelSegment("", (), self._channel)
                merged = ChannelSegment(last.text, (*last.tokens, *end), last.channel)
                self._parts[-1:] = [merged]

    def _part(self, text: str, a: int, b: int, channel: str) -> None:
        c0, b0 = self._decided
        a8 = b0 + len(text[c0:a].encode("utf-8", "surrogatepass"))
        b8 = a8 + len(text[a:b].encode("utf-8", "surrogatepass"))
        self._decided = (b, b8)
        self._channel = channel
        # the zero-byte tokens at its start (none were in the part before), then its bytes'
        tokens = (*self._placement.empty_at(a8), *self._placement.narrow(a8, b8))
        if self._parts and self._parts[-1].channel == channel:  # one part per run
            last = self._parts[-1]
            self._parts[-1] = ChannelSegment(last.text + text[a:b], tuple(merge_spans(
                [last, Segment(text[a:b], tokens)])), channel)  # fmt: skip
            return
        self._parts.append(ChannelSegment(text[a:b], tokens, channel))

    def _leaf_fields(self, text: str, found: Any) -> None:
        """Build the fields of `found`'s leaves that are complete and new."""
        schema = self.tools.get(found.name or "")
        for entry in found.leaves:
            if entry[1] in self._fields:
                continue
            made = leaf_field(text, entry, self._placement, self.scorer, schema)
            if made is not None:
                self._fields[entry[1]] = made
                self._fresh.append(made)


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
