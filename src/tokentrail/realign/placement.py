"""Placing identified tokens in the streamed content around unidentified ones."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .result import RefusedToken
from .wire import REPLACEMENT


@dataclass(slots=True)
class Obs:
    """A token in the stream: identified ("token"), not ("unknown"), or a dropped "gap"."""

    kind: str
    index: int | None
    id: int | None = None
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] | None = None
    #: unknown: the bytes the wire claimed (maybe stand-ins); gap: the exact bytes.
    raw: bytes | None = None
    refused: tuple[RefusedToken, ...] = ()


@dataclass(slots=True)
class Group:
    """A run of queued tokens: unidentified (at least `least` bytes), or identified."""

    unknown: bool
    obs: list[Obs] = field(default_factory=list)
    least: int = 0
    data: bytes = b""
    #: unidentified: a regex their bytes must match, from what the wire claimed (each
    #: U+FFFD stands for one to four bytes, other bytes for themselves).
    pattern: re.Pattern[bytes] | None = None

    def shape(self) -> re.Pattern[bytes]:
        """The regex an unidentified run's bytes must match (`pattern`, built once)."""
        if self.pattern is None:
            parts = []
            for o in self.obs:
                if not o.raw:
                    parts.append(b".*?")
                    continue
                pieces = o.raw.split(REPLACEMENT)
                parts.append(b"(?:.{1,4})".join(re.escape(x) for x in pieces))
            self.pattern = re.compile(b"".join(parts), re.S)
        return self.pattern


#: How many placements `placements` tries before calling the fit ambiguous.
PLACEMENT_BUDGET = 20_000


def placements(rest: bytes, groups: list[Group]) -> list[int] | None:
    """Where each identified group starts in `rest`, if they fit in exactly one way.

    Groups keep their order; an unidentified group's bytes match what the wire claimed
    for it (failing any fit, just its least length); the last group, if identified, ends
    the content (failing that, the content may have been cut short: no anchor).
    """
    n = len(groups)
    budget = [PLACEMENT_BUDGET]

    def fits(g: Group, data: bytes, shaped: bool) -> bool:
        if shaped:
            return g.shape().fullmatch(data) is not None
        return len(data) >= g.least

    def search(
        k: int, pos: int, acc: list[int], anchored: bool, shaped: bool, found: list[list[int]]
    ) -> None:
        # groups[k] is unidentified, starting at `pos`; place the identified one after it.
        budget[0] -= 1
        if budget[0] < 0 or len(found) > 1:
            return
        g = groups[k]
        if k + 1 == n:
            if fits(g, rest[pos:], shaped):
                found.append(list(acc))
            return
        data = groups[k + 1].data
        start = pos
        while len(found) < 2 and budget[0] >= 0:
            i = rest.find(data, start)
            if i < 0:
                return
            if fits(g, rest[pos:i], shaped):
                acc.append(i)
                end = i + len(data)
                if k + 2 < n:
                    search(k + 2, end, acc, anchored, shaped, found)
                elif not anchored or end == len(rest):
                    found.append(list(acc))
                acc.pop()
            if not data:
                return
            start = i + 1

    for anchored in (not groups[-1].unknown, False):
        for shaped in (True, False):
            found: list[list[int]] = []
            search(0, 0, [], anchored, shaped, found)
            if budget[0] < 0 or len(found) > 1:
                return None
            if found:
                return found[0]
    return None


@dataclass(slots=True)
class GapRef:
    """Stands, in the aligner, for bytes whose tokens are unknown."""

    refused: tuple[RefusedToken, ...]
