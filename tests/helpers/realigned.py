"""Checks on what tokentrail.realign rebuilds (shared by the realign test modules)."""

from __future__ import annotations

from typing import Any


def attributed(result: Any) -> dict[int, int]:
    """index -> id of every token some segment of a `RealignResult` attributes text (or
    nothing) to."""
    out: dict[int, int] = {}
    for seg in result.segments:
        for t in seg.tokens:
            assert out.setdefault(t.index, t.id) == t.id
    return out


def span_key(segments: Any) -> list[tuple[str, list[tuple[int, int, int, int]]]]:
    """(text, [(index, id, start, end) per token]) per segment, to compare segmentations."""
    return [(s.text, [(t.index, t.id, t.start, t.end) for t in s.tokens]) for s in segments]
