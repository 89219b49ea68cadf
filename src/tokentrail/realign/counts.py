"""How many tokens each folded frame held, when the stream allows telling it.

llama.cpp's OpenAI endpoints fold the bytes of tokens they sent no entry for into the
next entry, without saying how many tokens those were. What can still be known: the
folded bytes can only be spelled by some numbers of tokens of the vocabulary
(`spellings`), and ``usage.completion_tokens`` says how many are missing in all.
`settle` fixes each fold's count when only one count fits; from the first fold whose
count is not determined on, positions are unknown (never guessed).
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


def _sums(options: Sequence[frozenset[int]]) -> set[int]:
    total = {0}
    for opt in options:
        total = {s + c for s in total for c in opt}
    return total


def settle(
    options: Sequence[frozenset[int]], missing: int | None, tail: frozenset[int] = frozenset({0})
) -> list[int | None]:
    """Each fold's token count where it is determined, None from the first that is not.

    `options` are the counts each fold's bytes allow, in stream order; `missing` how many
    tokens the server counted beyond those it listed (None: it did not say); `tail`
    the counts allowed for tokens missing after the last entry (llama.cpp leaves the
    end-of-turn token out of chat logprobs: {0, 1}).
    """
    out: list[int | None] = []
    fixed = 0
    for k, opt in enumerate(options):
        if missing is None:
            fits = set(opt)
        else:
            rest = _sums([*options[k + 1 :], tail])
            fits = {c for c in opt if missing - fixed - c in rest}
        if len(fits) != 1:
            return out + [None] * (len(options) - k)
        (c,) = fits
        out.append(c)
        fixed += c
    return out
