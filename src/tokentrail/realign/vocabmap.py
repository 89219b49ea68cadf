"""The vocabulary read backwards: bytes and token names to ids."""

from __future__ import annotations

import weakref
from dataclasses import replace

from ..vocab import Vocab

_PLAIN, _BYTE, _SPECIAL, _HIDDEN = range(4)


class Reverse:
    """bytes -> ids, and token names -> ids, for one vocabulary."""

    def __init__(self, vocab: Vocab) -> None:
        ranked: dict[bytes, list[tuple[int, int]]] = {}
        for i, piece in enumerate(vocab.pieces):
            if not piece:
                continue
            if i in vocab.hidden:
                rank = _HIDDEN
            elif i in vocab.special:
                rank = _SPECIAL
            elif i in vocab.byte_ids:
                rank = _BYTE
            else:
                rank = _PLAIN
            ranked.setdefault(piece, []).append((rank, i))
        self.ids: dict[bytes, tuple[int, ...]] = {}
        self.plain: dict[bytes, int] = {}
        longest = 1
        for piece, cands in ranked.items():
            cands.sort()
            self.ids[piece] = tuple(i for _, i in cands)
            if cands[0][0] <= _BYTE:
                self.plain[piece] = cands[0][1]
                longest = max(longest, len(piece))
        self.longest = longest
        self.names: dict[str, int] = {}
        for i, name in vocab.names.items():
            self.names.setdefault(name, i)
        for i in sorted(vocab.special | vocab.hidden):
            piece = vocab.pieces[i] if 0 <= i < len(vocab.pieces) else None
            if piece:
                self.names.setdefault(piece.decode("utf-8", "replace"), i)

    def split(self, data: bytes) -> list[int] | None:
        """Some ids (longest match first) whose pieces spell `data`, or None."""
        out = []
        pos = 0
        while pos < len(data):
            for n in range(min(self.longest, len(data) - pos), 0, -1):
                tid = self.plain.get(data[pos : pos + n])
                if tid is not None:
                    out.append(tid)
                    pos += n
                    break
            else:
                return None
        return out


_REVERSE: weakref.WeakKeyDictionary[Vocab, Reverse] = weakref.WeakKeyDictionary()
_CONTINUED: weakref.WeakKeyDictionary[Vocab, Vocab] = weakref.WeakKeyDictionary()


def reverse(vocab: Vocab) -> Reverse:
    """The `Reverse` of `vocab`, built once per vocabulary (held while `vocab` lives)."""
    rev = _REVERSE.get(vocab)
    if rev is None:
        rev = _REVERSE[vocab] = Reverse(vocab)
    return rev


def continued(vocab: Vocab) -> Vocab:
    """The vocabulary decoding a continuation: no first-token rules (no leading strip).

    Built once per vocabulary (held while `vocab` lives)."""
    out = _CONTINUED.get(vocab)
    if out is None:
        out = replace(vocab, first_pieces={}, strip_leading=0)
        out.name = f"{vocab.name} (continuation)"
        _CONTINUED[vocab] = out
    return out
