"""How many tokens each folded frame held, when the stream allows telling it.

llama.cpp's OpenAI endpoints fold the bytes of tokens they sent no entry for into the
next entry, without saying how many tokens those were. What can still be known: the
folded bytes can only be spelled by some numbers of tokens of the vocabulary
(`spellings`), ``usage.completion_tokens`` says how many are missing in all, and a count
sent mid-stream how many came up to some entry. `solve` states a fold's count, or the
sum of the counts before some entry (which is all a position needs), only when every
reading of the stream agrees on it.
"""

from __future__ import annotations

from collections.abc import Sequence

from .vocabmap import Reverse


def spellings(data: bytes, rev: Reverse, open_end: bool = False) -> frozenset[int]:
    """The numbers of (non-special) vocabulary tokens whose pieces, concatenated, are
    `data` (special tokens add no bytes to a llama.cpp frame). `open_end`: `data` is
    only a prefix of their bytes (a stop string cut the last one short)."""
    n = len(data)
    counts: list[set[int]] = [set() for _ in range(n + 1)]
    counts[0].add(0)
    ends: set[int] = set()
    for i in range(n):
        if not counts[i]:
            continue
        for j in range(i + 1, min(n, i + rev.longest) + 1):
            if data[i:j] in rev.plain:
                counts[j].update(c + 1 for c in counts[i])
        if open_end and any(
            len(p) > n - i and p.startswith(data[i:]) for p in rev.plain
        ):
            ends.update(c + 1 for c in counts[i])
    return frozenset(counts[n] | ends)


#: A fold whose count nothing in its bytes bounds (None in `solve`'s options).
ANY = None


def _shift(values: set[int], opt: frozenset[int] | None, cap: int, over: int | None) -> set[int]:
    """Sums after one more fold; beyond `cap` they are dropped (a known total bounds
    them) or, with `over`, kept as that one value ("more than cap", never stated)."""
    if not values:
        return set()
    top = cap if over is None else over
    if opt is None:  # any count: everything from the least value on (linear, not square)
        return set(range(min(values), top + 1))
    if over is None:
        return {s + c for s in values for c in opt if s + c <= cap}
    return {min(s + c, over) for s in values for c in opt}


def _unshift(values: set[int], opt: frozenset[int] | None) -> set[int]:
    if opt is None:
        return set(range(max(values) + 1)) if values else set()
    return {s - c for s in values for c in opt if s - c >= 0}


def solve(
    options: Sequence[frozenset[int] | None],
    pins: Sequence[int | None],
    missing: int | None,
    tail: frozenset[int] = frozenset({0}),
) -> tuple[list[int | None], list[int | None], bool]:
    """What the stream fixes about folds: (sums, counts, whether any reading fits).

    Fold k held `options[k]` tokens (None: any number); `sums[k]` is how many tokens
    folds 0..k held together, stated only when every assignment the stream allows gives
    the same number (the position of every entry after fold k is its entry count plus
    `sums[k]`), `counts[k]` the same for fold k alone. `pins[k]` (len(options) + 1 of
    them; pins[0] before any fold) is what a count sent mid-stream fixes `sums[k-1]` to
    (None: nothing; pins[0] can only be 0). `missing` is how many tokens the server
    counted beyond its entries in all (None: unknown), `tail` the counts allowed after
    the last entry. The sets are the exact marginals of a chain: forward what the
    folds before allow, backward what the total after allows.
    """
    m = len(options)
    bound = [p for p in pins if p is not None] + ([missing] if missing is not None else [])
    over: int | None = None
    if missing is not None:
        cap = missing
    else:  # room for every fold of bounded count after the last pin; the rest is "over"
        cap = max(bound, default=0) + sum(max(o, default=0) for o in options if o) + 1
        over = cap + 1

    def pinned(k: int, values: set[int]) -> set[int]:
        p = pins[k]
        return values if p is None else values & {p}

    fwd = [pinned(0, {0})]
    for k, opt in enumerate(options):
        fwd.append(pinned(k + 1, _shift(fwd[-1], opt, cap, over)))

    def pinned_back(k: int, values: set[int] | None) -> set[int] | None:
        p = pins[k]
        if p is None:
            return values
        return {p} if values is None else values & {p}

    back: list[set[int] | None] = [None] * (m + 1)
    if missing is not None:
        back[m] = {missing - t for t in tail if missing - t >= 0}
    back[m] = pinned_back(m, back[m])
    for k in range(m - 1, -1, -1):
        after = back[k + 1]
        if after is not None:
            after = _unshift(after, options[k])
        back[k] = pinned_back(k, after)
    feas = [f if b is None else f & b for f, b in zip(fwd, back, strict=True)]
    if any(not f for f in feas):
        return [None] * m, [None] * m, False  # the stream contradicts itself
    sums: list[int | None] = [
        next(iter(f)) if len(f) == 1 and over not in f else None for f in feas[1:]
    ]
    counts: list[int | None] = []
    for k, opt in enumerate(options):
        a_set, b_set = feas[k], feas[k + 1]
        if len(a_set) * len(b_set) > 4096 or over in a_set or over in b_set:
            counts.append(None)  # (unknown is never wrong; this keeps it linear-ish)
            continue
        diffs = {b - a for a in a_set for b in b_set if opt is None or b - a in opt}
        diffs = {d for d in diffs if d >= 0}
        counts.append(next(iter(diffs)) if len(diffs) == 1 else None)
    return sums, counts, True
