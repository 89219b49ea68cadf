"""Stop strings matched on streamed text, trimming text and tokens consistently.

`StopMatcher` sits between the aligner and the caller. It releases segments as soon
as their text cannot be the start of a stop string, holds back only the shortest tail
that still could be, and when a stop string appears it returns the text before it
(with the tokens, or parts of tokens, that made that text) and the tokens that carried
the stop string. Matching is on text, so a stop string spread over several tokens,
or covering only part of one, is found at the same place as `text.find(stop)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .segment import Segment, TokenSpan

if TYPE_CHECKING:
    from .vocab import Vocab


@dataclass(frozen=True, slots=True)
class StopMatch:
    """A stop string was found.

    `tokens` are the spans from the first byte of the stop string to the end of the
    text generated so far: the tokens that carried the stop string, then any the
    aligner had emitted after it (all of it is cut from the output).
    """

    stop: str
    tokens: tuple[TokenSpan, ...]


def splittable(segment: Segment) -> bool:
    """Whether char offsets in `segment.text` map exactly onto its tokens' bytes.

    True when the text is the plain UTF-8 decode of the segment's bytes: no U+FFFD
    from invalid bytes, and no bytes dropped by a decode rule (stripped or cleaned-up
    spaces), which shows as a byte count that differs from the text's UTF-8 length.
    """
    if "\ufffd" in segment.text:
        return False
    n = 0
    for t in segment.tokens:
        n += t.end - t.start
    return n == len(segment.text.encode("utf-8"))


def split_segment(segment: Segment, k: int) -> tuple[Segment, Segment] | None:
    """Cut `segment` before char `k`; None when the segment is not `splittable`.

    A token whose bytes straddle the cut appears in both halves with its own byte
    ranges; a zero-byte token exactly at the cut goes to the left half.
    """
    text = segment.text
    if k <= 0:
        return Segment("", ()), segment
    if k >= len(text):
        return segment, Segment("", ())
    if not splittable(segment):
        return None
    cut = len(text[:k].encode("utf-8"))
    left: list[TokenSpan] = []
    right: list[TokenSpan] = []
    pos = 0
    for t in segment.tokens:
        n = t.end - t.start
        if pos + n <= cut:
            left.append(t)
        elif pos >= cut:
            right.append(t)
        else:
            mid = t.start + (cut - pos)
            left.append(t._replace(end=mid))
            right.append(t._replace(start=mid))
        pos += n
    return Segment(text[:k], tuple(left)), Segment(text[k:], tuple(right))


def drop_first_space(segments: list[Segment], open_: bool = True) -> tuple[list[Segment], bool]:
    """`segments` with the stream's first character dropped if it is a space, as mlx-lm's
    byte-level BPE detokenizer drops a reply's first leading space; `open_` says no text
    has come out yet. Returns the segments and whether that is still so.

    The token that carried the space keeps its span, one byte shorter at the start (a
    lone-space token keeps an empty one), so every token is still listed. One space at
    most: mlx-lm holds a lone space back and trims the text it then flushes once."""
    out = []
    for seg in segments:
        if open_ and seg.text:
            if seg.text[0] == " ":
                tokens = list(seg.tokens)
                for i, t in enumerate(tokens):
                    if t.end > t.start:
                        tokens[i] = t._replace(start=t.start + 1)
                        break
                seg = Segment(seg.text[1:], tuple(tokens))
            open_ = False
        out.append(seg)
    return out, open_


def merge_spans(segments: Iterable[Segment]) -> list[TokenSpan]:
    """The spans of consecutive segments, a token cut between them joined back."""
    out: list[TokenSpan] = []
    for seg in segments:
        for t in seg.tokens:
            if out:
                prev = out[-1]
                if prev.index == t.index and prev.end == t.start:
                    out[-1] = prev._replace(end=t.end)
                    continue
            out.append(t)
    return out


class WholeTokens:
    """Each token listed once, in the segment that completes it (its span then covers all
    of its bytes), for a stream whose segments may split a token's bytes: a character
    cut between tokens, a held-back space, a possible stop-string prefix held back.

    A span that stops short of its token's end is held and joined to the token's next
    span; a held token is also released once a later token is listed, and everything at
    the stream's end. A token that also carried the stop string goes to `stop_tokens`
    only. Text is not touched."""

    def __init__(self, vocab: Vocab, texted: bool = False) -> None:
        self._pieces = vocab.pieces
        self._first_pieces = vocab.first_pieces
        self._texted = texted  # some text has come out (the prompt's counts)
        self._carry: dict[int, TokenSpan] = {}

    def __copy__(self) -> WholeTokens:
        clone = object.__new__(WholeTokens)
        clone.__dict__.update(self.__dict__)
        clone._carry = dict(self._carry)
        return clone

    def _complete(self, t: TokenSpan) -> bool:
        """Whether span `t` reaches the end of its token's bytes (of its first piece, for
        a token that may still be decoded as the stream's first)."""
        pieces = self._pieces
        piece = pieces[t.id] if 0 <= t.id < len(pieces) else None
        if t.end >= len(piece or b""):
            return True
        first = None if self._texted else self._first_pieces.get(t.id)
        return first is not None and t.end >= len(first)

    def take(
        self, spans: list[TokenSpan], stop_tokens: list[TokenSpan], last: bool, texted: bool
    ) -> tuple[list[TokenSpan], list[TokenSpan]]:
        """The spans to list for one response (`texted`: its text is not empty) and its
        stop tokens; `last`: the stream ends with it."""
        carry = self._carry
        in_stop = {t.index for t in stop_tokens}
        out: list[TokenSpan] = []
        for t in spans:
            if carry:
                for k in sorted(k for k in carry if k < t.index):
                    out.append(carry.pop(k))
            held = carry.pop(t.index, None)
            if held is not None:
                t = t._replace(start=held.start)
            if t.index in in_stop or not (last or self._complete(t)):
                carry[t.index] = t
            else:
                out.append(t)
        self._texted = self._texted or texted
        if not last:
            return out, stop_tokens
        stops: list[TokenSpan] = []
        for t in stop_tokens:
            held = carry.pop(t.index, None)
            stops.append(t if held is None else t._replace(start=held.start))
        out.extend(carry[k] for k in sorted(carry))
        out.sort(key=lambda t: t.index)
        carry.clear()
        return out, stops


class StopMatcher:
    """Finds the first stop string in a stream of segments.

    >>> matcher = StopMatcher(["\\n\\n", "END"])              # doctest: +SKIP
    >>> released, match = matcher.feed(aligner.push(token))  # doctest: +SKIP

    After a match the matcher is spent; `flush()` returns what is held when the stream
    ends without one.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            stops = [stops]
        checked: list[str] = []
        for s in stops:
            if not isinstance(s, str):
                raise TypeError(f"stop strings must be str, got {type(s).__name__}: {s!r}")
            if not s:
                raise ValueError("stop strings must not be empty")
            if s not in checked:
                checked.append(s)
        # Shortest first: of two stops found at the same place, the shorter ends first.
        self.stops: tuple[str, ...] = tuple(sorted(checked, key=len))
        self._first = frozenset(s[0] for s in self.stops)
        self._held: list[Segment] = []
        self._held_text = ""
        self.match: StopMatch | None = None

    @property
    def held_text(self) -> str:
        return self._held_text

    def feed(self, segments: Iterable[Segment]) -> tuple[list[Segment], StopMatch | None]:
        """Add segments; return (segments now final, the match if a stop string ended)."""
        if self.match is not None:
            raise RuntimeError("StopMatcher already matched a stop string; make a new one")
        new = list(segments)
        if not new:
            return [], None
        text = new[0].text if len(new) == 1 else "".join(s.text for s in new)
        if not self._held and not any(c in text for c in self._first):
            return new, None  # nothing held, and nothing here can start a stop string
        self._held.extend(new)
        buf = self._held_text + text
        self._held_text = buf

        found = -1
        which = ""
        for stop in self.stops:
            i = buf.find(stop)
            if i >= 0 and (found < 0 or i < found):
                found, which = i, stop
        if found >= 0:
            released, tail = self._cut(found, exact=True)
            self.match = StopMatch(which, tuple(merge_spans(tail)))
            return released, self.match

        keep = 0
        for stop in self.stops:
            for start in range(max(0, len(buf) - len(stop) + 1), len(buf)):
                if start >= len(buf) - keep:
                    break
                if stop.startswith(buf[start:]):
                    keep = len(buf) - start
                    break
        released, _ = self._cut(len(buf) - keep, exact=False)
        return released, None

    def flush(self) -> list[Segment]:
        """End of stream without a match: release everything held."""
        out = self._held
        self._held = []
        self._held_text = ""
        return out

    def _cut(self, pos: int, exact: bool) -> tuple[list[Segment], list[Segment]]:
        """Release held text before char `pos`; keep (or, if `exact`, return) the rest.

        A segment that cannot be split at `pos` is held whole when holding back, or,
        for a stop string inside it, released with its text cut and all its tokens
        listed both in the released part and in the stop's tokens.
        """
        released: list[Segment] = []
        rest: list[Segment] = []
        offset = 0
        for i, seg in enumerate(self._held):
            end = offset + len(seg.text)
            if end <= pos:
                released.append(seg)
                offset = end
                continue
            if offset >= pos:
                rest = self._held[i:]
                break
            parts = split_segment(seg, pos - offset)
            if parts is not None:
                left, right = parts
                released.append(left)
                rest = [right, *self._held[i + 1 :]]
            elif exact:
                released.append(Segment(seg.text[: pos - offset], seg.tokens))
                rest = [Segment(seg.text[pos - offset :], seg.tokens), *self._held[i + 1 :]]
            else:
                rest = self._held[i:]
            break
        self._held = rest
        self._held_text = "".join(s.text for s in rest)
        return released, rest
