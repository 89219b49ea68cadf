"""Less common tokenizer formats: GGUF vocabularies, Mistral Tekken, llama2.c, and the
generic path for decoder pipelines that are not per-token."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .vocab import Vocab


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
    return Vocab(
        pieces=pieces,
        name=name,
        special=frozenset(special),
        names={i: t for i, t in enumerate(tokens) if t is not None and i in special},
        oracle=decode,
        source=source,
        generic=decode,
    )


def vocab_from_gguf(path: Path) -> Vocab:
    raise NotImplementedError("GGUF vocabularies: not yet")


def vocab_from_tekken(obj: Any) -> Vocab:
    raise NotImplementedError("Tekken: not yet")


def try_llama2c(path: Path) -> Vocab | None:
    return None
