"""Reasoning channels: segments split into reasoning, content, tool calls and marker text.

`ChannelSplitter` sits after the aligner (and after stop strings). It is fed final
segments one at a time and returns `ChannelSegment`s, each tagged with the channel its
text belongs to: "reasoning", "content", "tool_call", or "markup" for the marker text
itself (`<think>`, `</think>`, `<tool_call>`). Markers are found on text, so a marker cut
across tokens or across segments is found where `text.find(marker)` finds it. A token
that straddles a boundary (`>The` after `</think`) is listed in each channel with only
the bytes of it that went there, so per channel the attributed bytes join to exactly
that channel's text, and no text is in two channels.

Only the shortest tail that could still start a marker is held back, as `StopMatcher`
holds back a stop prefix; text that cannot start a marker goes out at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..errors import StructureError
from ..segment import Confidence, Segment, TokenSpan, confidence_of
from ..stops import merge_spans, split_segment

__all__ = [
    "CHANNELS",
    "REASONING_PARSERS",
    "ChannelSegment",
    "ChannelSplitter",
    "ReasoningFormat",
    "reasoning_format",
    "split_channels",
]

#: Every channel a splitter emits, in the order a reply usually has them.
CHANNELS: tuple[str, ...] = ("reasoning", "content", "tool_call", "markup")


@dataclass(slots=True, eq=False)
class ChannelSegment(Segment):
    """A segment of one channel: its text, the tokens (narrowed to the bytes that went
    into this channel) and `channel`, one of `CHANNELS`."""

    channel: str = "content"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Segment):
            return NotImplemented
        same = self.text == other.text and tuple(self.tokens) == tuple(other.tokens)
        return same and self.channel == getattr(other, "channel", None)

    __hash__ = None  # type: ignore[assignment]

    def to_dict(self) -> dict[str, Any]:
        out = Segment.to_dict(self)
        out["channel"] = self.channel
        return out


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """How a model family marks its reasoning (and, optionally, its tool calls).

    `start`/`end` are the markers that open and close the reasoning (any of several
    spellings; an empty `start` means the reasoning starts with the reply).
    `starts_in_reasoning`: the reply starts inside the reasoning because the chat
    template already opened it (DeepSeek-R1; Qwen3 with thinking on); an opening marker
    the model writes anyway, before any reasoning text, is then taken as markup.
    `tool_call` is a tool-call section's (open, close) markers (close "" runs to the end
    of the reply); `tool_call_ends_reasoning`: an open tool-call marker inside the
    reasoning ends it (Qwen3 may call a tool without closing `</think>`).
    """

    name: str
    start: tuple[str, ...]
    end: tuple[str, ...]
    starts_in_reasoning: bool
    tool_call: tuple[str, str] | None = None
    tool_call_ends_reasoning: bool = False

    def __post_init__(self) -> None:
        if not self.end or not all(isinstance(m, str) and m for m in self.end):
            raise StructureError(f"reasoning format {self.name!r}: the end marker is empty")
        if not self.start and not self.starts_in_reasoning:
            raise StructureError(
                f"reasoning format {self.name!r}: no start marker, so the reasoning must "
                "start with the reply (starts_in_reasoning=True)"
            )
        if self.tool_call is not None and not self.tool_call[0]:
            raise StructureError(f"reasoning format {self.name!r}: empty tool-call marker")

    @property
    def constraint_after(self) -> tuple[str, ...]:
        """The markers after which a constraint (a JSON schema, tools) starts, as in vLLM:
        the end markers when the reply starts in the reasoning; none when it starts as
        content (the constraint then applies from the first token, so the model opens no
        reasoning the grammar does not allow)."""
        return self.end if self.starts_in_reasoning else ()

    @classmethod
    def from_markers(cls, start: str, end: str, name: str = "markers") -> ReasoningFormat:
        """Any other model's markers (`--reasoning-markers START END`): an empty START
        means the reasoning starts with the reply."""
        if not isinstance(start, str) or not isinstance(end, str):
            raise StructureError(f"reasoning markers must be two strings, got {start!r}, {end!r}")
        return cls(name, (start,) if start else (), (end,), starts_in_reasoning=not start)


_THINK = ("<think>",)
_END_THINK = ("</think>",)
_HERMES_TOOLS = ("<tool_call>", "</tool_call>")

#: The named parsers (`--reasoning-parser NAME`), as vLLM names them.
REASONING_PARSERS: Mapping[str, ReasoningFormat] = {
    # The template ends the prompt with "<think>\n": the reply starts in the reasoning.
    "deepseek_r1": ReasoningFormat("deepseek_r1", _THINK, _END_THINK, starts_in_reasoning=True),
    # Thinking on (the default): as DeepSeek-R1, and a tool call may end the reasoning;
    # pass starts_in_reasoning=False when the request had enable_thinking=False.
    "qwen3": ReasoningFormat(
        "qwen3",
        _THINK,
        _END_THINK,
        starts_in_reasoning=True,
        tool_call=_HERMES_TOOLS,
        tool_call_ends_reasoning=True,
    ),
    # Magistral: [THINK]/[/THINK] are control tokens; decode with skip_special_tokens=False.
    "mistral": ReasoningFormat("mistral", ("[THINK]",), ("[/THINK]",), starts_in_reasoning=True),
    # Granite 3.2: plain-text markers, the reply starts as content.
    "granite": ReasoningFormat(
        "granite",
        ("Here is my thought process:", "Here's my thought process:"),
        ("Here is my response:", "Here's my response:"),
        starts_in_reasoning=False,
    ),
}


def reasoning_format(
    parser: str | ReasoningFormat | tuple[str, str], *, starts_in_reasoning: bool | None = None
) -> ReasoningFormat:
    """A `ReasoningFormat` from a parser name, a format, or a (START, END) marker pair;
    `starts_in_reasoning` overrides the format's own (e.g. Qwen3 with thinking off)."""
    if isinstance(parser, ReasoningFormat):
        fmt = parser
    elif isinstance(parser, str):
        fmt = REASONING_PARSERS.get(parser)  # type: ignore[assignment]
        if fmt is None:
            known = ", ".join(sorted(REASONING_PARSERS))
            raise StructureError(
                f"unknown reasoning parser {parser!r}; known: {known} (or give the markers "
                "as (START, END), START may be empty)"
            )
    elif isinstance(parser, tuple) and len(parser) == 2:
        fmt = ReasoningFormat.from_markers(*parser)
    else:
        raise StructureError(
            f"a reasoning parser is a name, a ReasoningFormat or (START, END); got {parser!r}"
        )
    if starts_in_reasoning is not None and starts_in_reasoning != fmt.starts_in_reasoning:
        fmt = replace(fmt, starts_in_reasoning=starts_in_reasoning)
    return fmt


@dataclass(frozen=True, slots=True)
class _Rule:
    """In some channel, `marker` switches to channel `to`; an `opener` counts only
    before any non-space text of the channel (a redundant `<think>` at the start)."""

    marker: str
    to: str
    opener: bool = False


def _rules(fmt: ReasoningFormat) -> dict[str, tuple[_Rule, ...]]:
    """Each channel's markers: where the text can switch to another channel."""
    tools = fmt.tool_call
    content = [_Rule(m, "reasoning") for m in fmt.start]
    reasoning = [_Rule(m, "content") for m in fmt.end]
    if fmt.starts_in_reasoning:
        reasoning += [_Rule(m, "reasoning", opener=True) for m in fmt.start]
    tool_call: list[_Rule] = []
    if tools is not None:
        content.append(_Rule(tools[0], "tool_call"))
        if fmt.tool_call_ends_reasoning:
            reasoning.append(_Rule(tools[0], "tool_call"))
        if tools[1]:
            tool_call.append(_Rule(tools[1], "content"))
    return {"content": tuple(content), "reasoning": tuple(reasoning), "tool_call": tuple(tool_call)}


class ChannelSplitter:
    """Splits a stream of segments into channels.

    >>> splitter = ChannelSplitter("qwen3")                   # doctest: +SKIP
    >>> for segment in aligner.push(token_id, logprob):      # doctest: +SKIP
    ...     for piece in splitter.feed(segment):
    ...         print(piece.channel, piece.text)
    >>> rest = splitter.finish()                              # doctest: +SKIP

    `channel` is the channel the text is in now. Everything emitted is kept, so
    `text(channel)`, `tokens(channel)` and `confidence(channel)` describe a whole channel.
    """

    def __init__(
        self,
        parser: str | ReasoningFormat | tuple[str, str],
        *,
        starts_in_reasoning: bool | None = None,
    ) -> None:
        self.format = reasoning_format(parser, starts_in_reasoning=starts_in_reasoning)
        self._rules = _rules(self.format)
        self.channel = "reasoning" if self.format.starts_in_reasoning else "content"
        self._fresh = True  # the current channel has had only white space so far
        self._held: list[Segment] = []
        self._held_text = ""
        self.segments: list[ChannelSegment] = []

    @property
    def held_text(self) -> str:
        """Text held back because it may be the start of a marker."""
        return self._held_text

    def feed(self, segments: Segment | Iterable[Segment]) -> list[ChannelSegment]:
        """Add one segment (or several); return the channel segments now final."""
        new = [segments] if isinstance(segments, Segment) else list(segments)
        out: list[ChannelSegment] = []
        for seg in new:
            if not self._held and not self._may_start_marker(seg.text):
                self._emit(seg.text, seg.tokens, out)
                continue
            self._held.append(seg)
            self._held_text += seg.text
            self._scan(out)
        self.segments.extend(out)
        return out

    def finish(self) -> list[ChannelSegment]:
        """End of the reply: what is held goes to the current channel."""
        out: list[ChannelSegment] = []
        for seg in self._held:
            self._emit(seg.text, seg.tokens, out)
        self._held = []
        self._held_text = ""
        self.segments.extend(out)
        return out

    def text(self, channel: str) -> str:
        """All text emitted so far in `channel`."""
        return "".join(s.text for s in self.segments if s.channel == channel)

    def tokens(self, channel: str) -> list[TokenSpan]:
        """The tokens of `channel`'s text, a token cut between its segments joined back."""
        return merge_spans(s for s in self.segments if s.channel == channel)

    def confidence(self, channel: str) -> Confidence | None:
        """How sure the model was of `channel`'s text as a whole."""
        return confidence_of(self.tokens(channel))

    # -- internals ---------------------------------------------------------------

    def _may_start_marker(self, text: str) -> bool:
        return any(r.marker[0] in text for r in self._rules[self.channel])

    def _emit(self, text: str, tokens: tuple[TokenSpan, ...], out: list[ChannelSegment]) -> None:
        if not text and not tokens:
            return
        out.append(ChannelSegment(text, tuple(tokens), self.channel))
        if self._fresh and text.strip():
            self._fresh = False

    def _find(self, buf: str) -> tuple[int, _Rule | None]:
        """The first marker in `buf` (the longest of those found at the same place)."""
        best, rule, size = -1, None, 0
        for r in self._rules[self.channel]:
            i = buf.find(r.marker)
            if i < 0 or (r.opener and not (self._fresh and not buf[:i].strip())):
                continue
            if best < 0 or i < best or (i == best and len(r.marker) > size):
                best, rule, size = i, r, len(r.marker)
        return best, rule

    def _keep(self, buf: str) -> int:
        """How many chars at the end of `buf` may still be the start of a marker."""
        keep = 0
        for r in self._rules[self.channel]:
            for start in range(max(0, len(buf) - len(r.marker) + 1), len(buf) - keep):
                if r.marker.startswith(buf[start:]):
                    if not r.opener or (self._fresh and not buf[:start].strip()):
                        keep = len(buf) - start
                    break
        return keep

    def _scan(self, out: list[ChannelSegment]) -> None:
        """Release what the held text now decides: channel text, markers, switches."""
        while True:
            buf = self._held_text
            i, rule = self._find(buf)
            if rule is None:
                for seg in self._cut(len(buf) - self._keep(buf), exact=False):
                    self._emit(seg.text, seg.tokens, out)
                return
            for seg in self._cut(i, exact=True):
                self._emit(seg.text, seg.tokens, out)
            marker = self._cut(len(rule.marker), exact=True)
            spans = merge_spans(marker)
            out.append(ChannelSegment(rule.marker, tuple(spans), "markup"))
            self.channel = rule.to
            self._fresh = True
            if not self._held:
                return

    def _cut(self, pos: int, exact: bool) -> list[Segment]:
        """Take the held text before char `pos` (with its tokens) off the held list.

        A segment whose chars do not map onto its bytes (see `stops.splittable`) is
        held whole when only holding back; at a marker its text is cut and all its
        tokens are listed on both sides, as `StopMatcher` does. (A segment with no
        tokens at all, text alone, is cut anywhere.)
        """
        taken: list[Segment] = []
        offset = 0
        held = self._held
        i = 0
        while i < len(held) and offset < pos:
            seg = held[i]
            end = offset + len(seg.text)
            if end <= pos:
                taken.append(seg)
                offset = end
                i += 1
                continue
            parts = split_segment(seg, pos - offset)
            if parts is not None:
                taken.append(parts[0])
                held[i] = parts[1]
            elif exact or not seg.tokens:
                k = pos - offset
                taken.append(Segment(seg.text[:k], seg.tokens))
                held[i] = Segment(seg.text[k:], seg.tokens)
            break
        # A zero-byte token right at the cut stays with the text after it.
        self._held = held[i:]
        self._held_text = "".join(s.text for s in self._held)
        return taken


def split_channels(
    segments: Iterable[Segment],
    parser: str | ReasoningFormat | tuple[str, str],
    *,
    starts_in_reasoning: bool | None = None,
) -> list[ChannelSegment]:
    """A whole reply's segments split into channel segments (feed each, then finish)."""
    splitter = ChannelSplitter(parser, starts_in_reasoning=starts_in_reasoning)
    out: list[ChannelSegment] = []
    for seg in segments:
        out += splitter.feed(seg)
    return out + splitter.finish()
