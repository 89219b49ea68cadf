"""The end of a stream: the tokens its counts say were generated but never described.

`Counts` is the part of the `Realigner` (`tokentrail.realign.core`) that settles them
once the stream has ended: ``usage.completion_tokens`` and the counts sent mid-stream
against the entries read (`positions.number` where folds left positions open), and
the bound on how many undescribed tokens a stream's counts are believed about.
"""

from __future__ import annotations

from collections.abc import Callable

from ..segment import Segment, TokenSpan
from .positions import Fold, Numbering, end_tokens, number
from .result import POSITION_UNKNOWN, RealignedSegment, RefusedToken
from .vocabmap import Reverse

__all__ = ["MAX_UNDESCRIBED", "Counts"]

#: How many tokens a stream's counts may say the server generated without describing
#: them or sending their bytes (llama.cpp's folds send theirs in the next frame; tokens
#: cut off by a stop string and a chat stream's unlisted end token are a few): past
#: that, a count is broken or hostile. `tokens_predicted` beyond it is refused, a usage
#: total beyond it is not believed; neither is enumerated (a billion refused records).
MAX_UNDESCRIBED = 4096


class Counts:
    """Settling a stream's counts at its end (a base of `Realigner`, whose reading of
    the frames sets these fields)."""

    _n: int
    _total: int | None
    _total_at: int
    _total_pin: bool
    _pins: dict[int, int]
    _multi: bool
    _chat: bool
    _llama: bool
    _finish: str | None
    _stop_cut_at: int
    _open_gaps: list[Fold]
    _trailing: list[TokenSpan]
    _refused: list[RefusedToken]
    _rev: Reverse
    _warn: Callable[[str], None]

    def _settle_counts(self, segments: list[Segment]) -> list[Segment]:
        """At the end: account for tokens the server counted but never described.

        ``usage.completion_tokens`` says how many tokens there were. Without open gaps,
        the missing ones come after every entry (llama.cpp leaves the end-of-turn token
        out of chat logprobs): they are refused at their indices. With open gaps (folded
        frames that did not say how many tokens they held), `positions.number` works
        out what the stream fixes: each entry's position is stated only when every
        reading of its bytes and counts agrees on it, else None (never a shifted one);
        a count sent mid-stream or the total at the end can fix positions again after a
        fold whose own count stays unknown.
        """
        total = None if self._multi or self._total_at != self._n else self._total
        pins = {} if self._multi else self._pins
        if total is not None and total > self._n + MAX_UNDESCRIBED:
            self._warn(f"usage.completion_tokens is {total}, but the stream described "
                       f"{self._n} tokens: not believed")
            total = None
        pins = {at: n for at, n in pins.items() if n <= at + 1 + MAX_UNDESCRIBED}
        # llama.cpp's chat streams list no entry for a token that adds no text: only
        # the counts can show one, so they are read even when nothing was folded.
        unlisted = self._chat and self._llama
        if not self._open_gaps and not (unlisted and (total is not None or pins)):
            return self._count_tail(segments, total)
        folds = self._open_gaps
        self._open_gaps = []
        tail = end_tokens(self._finish, self._chat, self._stop_cut_at == self._n - 1)
        end = None if self._total_pin else total  # (a count with entries is a pin only)
        numbering = number(folds, pins, self._n, end, self._rev, tail, unlisted=unlisted)
        first = numbering.first_unknown
        if numbering.unknown_from is not None:
            self._warn(
                "the server's token counts contradict its entries (tokens it neither listed "
                "nor folded into an entry?): positions are unknown (index null)"
            )
        elif first is not None:
            self._warn(
                f"the server sent fewer entries than tokens without saying where (frames "
                f"folded into the next entry; on a chat stream, tokens with no text), and "
                f"neither their bytes nor its counts tell it: the positions of tokens from "
                f"stream index {first} on are unknown (index null) until a count fixes them"
            )
        out = [self._renumber(seg, numbering) for seg in segments]
        cut = self._renumber(RealignedSegment("", tuple(self._trailing)), numbering)
        self._trailing = list(cut.tokens)
        renamed = numbering.refused
        self._refused = [r for x in self._refused for r in renamed.get(id(x), (x,))]
        if numbering.end_sum is not None:
            self._n += numbering.end_sum
            if total is not None and total > self._n:
                out = self._count_tail(out, total)
        self._n = max(self._n, total or 0)
        return out

    def _renumber(self, seg: Segment, numbering: Numbering) -> Segment:
        """`seg` with its tokens at their true positions (None where not known)."""
        spans = tuple(
            TokenSpan(numbering.index(t.index), t.id, t.start, t.end, t.logprob, t.top_logprobs)  # type: ignore[arg-type]
            for t in seg.tokens
        )
        renamed = numbering.refused
        refs = tuple(r for x in getattr(seg, "refused", ()) for r in renamed.get(id(x), (x,)))
        unknown = POSITION_UNKNOWN if any(t.index is None for t in spans) else None
        return RealignedSegment(seg.text, spans, refs, unknown)

    def _count_tail(self, segments: list[Segment], total: int | None) -> list[Segment]:
        """Tokens counted after every entry (no open gaps): refused at their indices."""
        if total is None:
            return segments
        missing = total - self._n
        if missing > 0:
            why = (
                "the server counted it (usage.completion_tokens) but sent no logprobs "
                "entry for it (llama.cpp leaves the end-of-turn token out of chat "
                "logprobs)"
            )
            extra = tuple(RefusedToken(i, why) for i in range(self._n, total))
            self._refused.extend(extra)
            segments.append(RealignedSegment("", (), extra))
            self._n = total
        elif missing < 0:
            self._warn(f"usage.completion_tokens is {total}, but the stream held {self._n}")
        return segments
