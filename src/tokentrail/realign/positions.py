"""Token positions in a stream whose server folded tokens without counting them.

llama.cpp's OpenAI endpoints send no entry for a token whose text it holds back (a
character left incomplete, a possible stop string) and put that token's bytes on the
next entry, without saying how many tokens they were. The realigner numbers entries as
they come (their "raw" index); the true position of an entry is its raw index plus the
tokens every fold before it held. `number` works out what the stream fixes about that:
the counts each fold's bytes allow (`counts.spellings`), counts sent mid-stream (an
``usage`` or llama.cpp ``timings.predicted_n`` on a chunk with entries: that many tokens
up to its last entry) and ``usage.completion_tokens`` at the end. A position is stated
only when every reading of the stream agrees on it (`counts.solve`): after a fold whose
count is unknown, positions are None until a count pins them again. Never a guess.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .counts import ANY, solve, spellings
from .result import RefusedToken
from .vocabmap import Reverse


@dataclass(slots=True)
class Fold:
    """Bytes a server put on the entry at raw index `at` for tokens it sent no entry for
    (`ref` None: no bytes, only tokens that may have gone unlisted there)."""

    at: int
    ref: RefusedToken | None
    data: bytes
    #: The entry's own bytes were not at the end (a stop string cut it off): the last
    #: folded token may run on past `data`.
    cut: bool


def end_tokens(finish: str | None, chat: bool, cut: bool) -> frozenset[int]:
    """How many tokens may follow the last entry unlisted, from how the stream ended.

    llama.cpp sends no entry for tokens that leave the text inside a character, and if
    the stream ends there (a length stop) their bytes are never sent: up to 3 tokens of a
    4-byte character, plus an end token after them. On a chat stream it also lists no
    entry for a token that adds no text (`number`'s `unlisted`), so there only the least
    count matters: one end-of-turn token when it stopped (unless a stop string cut the
    last entry short, which then is the last token), none otherwise."""
    if chat:
        return frozenset({1} if finish == "stop" and not cut else {0})
    return frozenset(range(4 if finish == "length" else 5))


class Numbering:
    """Raw entry index -> true position (None: unknown), and each fold's refusals."""

    def __init__(
        self,
        folds: Sequence[Fold],
        sums: Sequence[int | None],
        counts: Sequence[int | None],
        unknown_from: int | None,
    ) -> None:
        self._ats = [f.at for f in folds]
        self._sums = [0, *sums]  # _sums[k]: tokens held by the first k folds
        self.unknown_from = unknown_from
        self.refused: dict[int, tuple[RefusedToken, ...]] = {}
        for k, (f, c) in enumerate(zip(folds, counts, strict=True)):
            base = self._sums[k]
            if f.ref is None:
                continue
            # Unlisted tokens beside the folded ones (room at the same entry) could come
            # first: the folded ones' places are known only when that room is empty.
            beside = k + 1 < len(folds) and folds[k + 1].ref is None and folds[k + 1].at == f.at
            if beside and counts[k + 1] != 0:
                c = None
            if c is None or base is None or (unknown_from is not None and f.at >= unknown_from):
                why = f"{f.ref.reason}; how many tokens it held cannot be told"
                self.refused[id(f.ref)] = (RefusedToken(None, why, f.ref.reported),)
            else:
                self.refused[id(f.ref)] = tuple(
                    RefusedToken(f.at + base + j, f.ref.reason, f.ref.reported) for j in range(c)
                )
        self.end_sum = self._sums[-1] if unknown_from is None else None

    def index(self, i: int) -> int | None:
        """The true position of the entry at raw index `i` (prompt tokens: as they are)."""
        if i < 0:
            return i
        if self.unknown_from is not None and i >= self.unknown_from:
            return None
        k = sum(1 for at in self._ats if at <= i)
        s = self._sums[k]
        return None if s is None else i + s

    @property
    def first_unknown(self) -> int | None:
        """The first raw index whose position is not stated (None: all are)."""
        if self.unknown_from is not None:
            return self.unknown_from
        pairs = zip(self._ats, self._sums[1:], strict=True)
        return next((at for at, s in pairs if s is None), None)


def number(
    folds: Sequence[Fold],
    pins: Mapping[int, int],
    entries: int,
    total: int | None,
    rev: Reverse,
    tail: frozenset[int] = frozenset({0, 1}),
    unlisted: bool = False,
) -> Numbering:
    """What the stream fixes about positions.

    `pins` maps a raw index to the count a chunk sent after that entry; `entries` is the
    number of entries, `total` ``usage.completion_tokens`` at the end (None: not sent),
    `tail` the tokens that may follow the last entry unlisted (`end_tokens`). A fold cut
    short by a stop string is read so only at the last entry; anywhere else its count
    is bounded by nothing in its bytes. `unlisted`: tokens that add no text may have no
    entry anywhere (llama.cpp's chat streams: a special token sampled mid-stream), which
    only the counts can reveal; then a position is stated only where the counts leave
    no room for one.
    """
    folds = list(folds)
    if unlisted and (total is not None or pins):
        # Room for such tokens before every entry and after the last (sorted stably:
        # a fold's own bytes and the room beside it both come before its entry).
        folds += [Fold(i, None, b"", False) for i in range(entries + 1)]
        folds.sort(key=lambda f: f.at)
        tail = frozenset({min(tail)})
    options = [
        (ANY if f.ref is None or (f.cut and f.at != entries - 1) else spellings(f.data, rev, f.cut))
        for f in folds
    ]
    at_pin: list[int | None] = [None] * (len(folds) + 1)
    clash = False
    for i, count in pins.items():
        k = sum(1 for f in folds if f.at <= i)
        value = count - (i + 1)
        if (at_pin[k] is not None and at_pin[k] != value) or (k == 0 and value != 0):
            clash = True
        at_pin[k] = value
    missing = None if total is None else total - entries
    sums, counts, feasible = solve(options, at_pin, missing, tail)
    unknown_from = 0 if clash or not feasible else None
    return Numbering(folds, sums, counts, unknown_from)
