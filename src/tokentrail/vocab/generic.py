"""The generic path: decoder pipelines that are not per-token plus known rules.

The aligner re-decodes with the library's own decode (slower, still exact on the final
text); per-token bytes are kept only for display and attribution.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .core import Vocab, special_names


def generic_vocab(
    tokens: list[str | None],
    special: set[int],
    decode: Callable[[Sequence[int], bool], str],
    name: str,
    cleanup: bool = False,
    source: Any = None,
) -> Vocab:
    """A Vocab for an unknown decoder: per-token bytes for display, decode for text."""
    pieces: list[bytes | None] = []
    for i, t in enumerate(tokens):
        if t is None:
            pieces.append(None)
            continue
        try:
            pieces.append(decode([i], False).encode("utf-8"))
        except Exception:  # a decoder may refuse a lone token; fall back to its string
            pieces.append(t.encode("utf-8"))
    names = special_names(tokens, special)
    # The decode is both the oracle and the text path: nothing here is per-token.
    return Vocab(pieces=pieces, name=name, special=frozenset(special), names=names,
                 oracle=decode, source=source, generic=decode)
