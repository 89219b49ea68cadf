"""Reading captured streams: JSON lines or raw SSE (``data: {...}``, ``data: [DONE]``)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from .result import RealignError


def read_chunks(lines: Iterable[str], where: str = "input", start: int = 1) -> Iterator[Any]:
    """Parsed chunks from JSON lines or a raw SSE capture (``data: {...}``, ``data: [DONE]``).

    Blank lines, SSE comments (``:``) and ``event:``/``id:``/``retry:`` fields are
    skipped; ``data: [DONE]`` ends the stream. A line that is not JSON raises
    RealignError naming the line.
    """
    for n, line in enumerate(lines, start):
        s = line.strip()
        if not s or s.startswith(":"):
            continue
        if s.startswith("data:"):
            s = s[len("data:") :].strip()
            if s == "[DONE]":
                return
        elif s.split(":", 1)[0] in ("event", "id", "retry"):
            continue
        try:
            yield json.loads(s)
        except json.JSONDecodeError as e:
            raise RealignError(f"{where} line {n}: not JSON ({e.msg}): {s[:60]!r}") from None
