"""When a constraint starts: after the reasoning's end marker.

A constraint given together with a reasoning format applies to the content after the
reasoning, as vLLM's structured outputs do with a reasoning parser: while the model
reasons its logits are not masked, and the grammar starts once the reasoning's end
marker has been generated. `ReasoningGate` is the watch one sequence keeps for that
marker; `Guide` drives it, so every engine that drives a guide gets the same rule.

The marker is found on the bytes of the generated tokens, as llguidance's tokenizer
decodes them (`LLTokenizer.decode_bytes`: a special token gives its name, so Qwen3's
`</think>` or Mistral's `[/THINK]` count whether or not they are special tokens), so a
marker cut across several tokens is found in the token that completes it. Only the
last `len(marker) - 1` bytes are kept between tokens (O(1) per token).

What the token that completes the marker has after it (`>{"` after `</think`: the tail)
is content: `Guide` feeds those bytes to the grammar (llguidance works on bytes, so
the tail is tokenized with llguidance's own tokenizer and consumed; any tokenization
of the same bytes reaches the same grammar state). Any tail the grammar rejects cannot
start a valid reply, and is an error (the token was drawn unmasked, while reasoning).

Whitespace between the marker and the content is the one exception: models write
`</think>\n\n` before their answer. A JSON constraint takes up to two blanks before its
value (`spec.LEADING_WHITESPACE`), a regex or a choice none. So leading whitespace of
the tail that the grammar does not take is content text the grammar skips, and when
the grammar has taken nothing yet, one whitespace-only token (`WHITESPACE`: its bytes
are all space, tab, CR or LF) is allowed next to what the grammar allows, and skipped
the same way. One, so a model cannot loop on blank lines before its answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .kept import lltok_memo

__all__ = ["WHITESPACE", "ReasoningGate", "blank_words", "whitespace_ids"]

#: The bytes a whitespace-only token may hold.
WHITESPACE = b" \t\r\n"


def whitespace_ids(lltok: Any) -> np.ndarray:
    """A bool array over llguidance's vocabulary: the ids whose bytes are non-empty
    whitespace (special tokens never are). Built once per tokenizer, and let go with it."""
    return lltok_memo(lltok, "whitespace_ids", _whitespace_ids)


def _whitespace_ids(lltok: Any) -> np.ndarray:
    out = np.zeros(int(lltok.vocab_size), dtype=np.bool_)
    for i in range(out.size):
        b = lltok.decode_bytes([i])
        out[i] = bool(b) and not b.strip(WHITESPACE) and not lltok.is_special_token(i)
    return out


def blank_words(lltok: Any) -> np.ndarray:
    """`whitespace_ids` packed as llguidance's int32 bitmask words (bit `i % 32` of word
    `i // 32`), to OR into a mask."""
    ids = whitespace_ids(lltok)
    words = np.zeros(((ids.size + 31) // 32) * 4, dtype=np.uint8)
    packed = np.packbits(ids, bitorder="little")
    words[: packed.size] = packed
    return words.view(np.int32)


class ReasoningGate:
    """One sequence's watch for the end of its reasoning: `feed` each generated token;
    it returns None while the reasoning goes on, and the bytes after the end marker
    (the content's first bytes, maybe b"") from the token that completes it."""

    __slots__ = ("carry", "ends", "keep", "lltok")

    def __init__(self, ends: Sequence[str], lltok: Any) -> None:
        if not ends or not all(isinstance(e, str) and e for e in ends):
            raise ValueError(f"a reasoning gate needs non-empty end markers, got {ends!r}")
        self.ends = tuple(e.encode("utf-8") for e in ends)
        self.keep = max(map(len, self.ends)) - 1
        self.carry = b""
        self.lltok = lltok

    def feed(self, token: int) -> bytes | None:
        """The bytes after the end marker when `token` completes it, else None."""
        data = self.carry + self.lltok.decode_bytes([int(token)])
        found = [(i, len(e)) for e in self.ends if (i := data.find(e)) >= 0]
        if found:
            at, n = min(found, key=lambda f: (f[0], -f[1]))  # first, then longest
            return data[at + n :]
        self.carry = data[-self.keep :] if self.keep else b""
        return None
