"""How the aligner turns bytes into text where they are not plain UTF-8.

The decoding rules of the tokenizer families (`DECODE_ERRORS`: one U+FFFD per invalid
byte as sentencepiece writes it, or tokenizers' replacement), how a token's bytes are
shown where they make no complete character (`show_bytes`, ``<0xNN>``), what an
alternative shows after the half character the stream holds (`completed_char`), and
transformers' clean-up of spaces applied to a stream exactly (`CleanupStream`).
`tokentrail.align.Aligner` applies them.
"""

from __future__ import annotations

import codecs

from .vocab.core import cleanup

__all__ = ["DECODE_ERRORS", "CleanupStream", "completed_char", "show_bytes"]


def _replace_one_byte(err: UnicodeDecodeError) -> tuple[str, int]:
    """Error handler: each invalid byte becomes one U+FFFD (sentencepiece's rule)."""
    return "\ufffd", err.start + 1


# Registered on import; codecs' registry is process-wide, and the names are
# tokentrail's own so no other code can mean something else by them.
codecs.register_error("tokentrail-per-byte", _replace_one_byte)

#: The decoder's error handler for each `Vocab.byte_mode`.
DECODE_ERRORS = {"stream": "replace", "spm_runs": "tokentrail-per-byte", "hf_runs": "strict"}


def _hex_bytes(err: UnicodeDecodeError) -> tuple[str, int]:
    """Error handler: bytes that make no complete character written as `<0xNN>`."""
    return "".join(f"<0x{b:02X}>" for b in err.object[err.start : err.end]), err.end


codecs.register_error("tokentrail-hex", _hex_bytes)


def show_bytes(raw: bytes) -> str:
    """`raw` as readable text: bytes that make no complete character as `<0xNN>`."""
    return raw.decode("utf-8", "tokentrail-hex")


def completed_char(held: bytes, raw: bytes, alone: str) -> str:
    """What `raw` shows after `held`, the incomplete UTF-8 start of one character: that
    character when `raw` completes it (then the rest of `raw`), else `alone`."""
    lead = held[0]
    size = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    cut = size - len(held)
    if len(raw) < cut:
        return alone  # still no complete character
    try:
        char = (held + raw[:cut]).decode("utf-8")
    except UnicodeDecodeError:  # the held bytes do not continue with these
        return alone
    return char + show_bytes(raw[cut:])


class CleanupStream:
    """transformers' clean-up of spaces, applied to a stream of text chunks exactly.

    Every rule deletes spaces in a pattern of at most 4 characters that starts with a
    space. A cut with three non-space characters before it is never spanned by a match
    at any stage, so cleaning both sides separately equals cleaning the whole text;
    everything after the last such cut is held back.
    """

    def __init__(self) -> None:
        self._chunks: list[tuple[str, int]] = []  # (text, global byte end)

    def feed(self, text: str, end: int, final: bool = False) -> tuple[str, int | None]:
        """Add text ending at byte `end`; return (clean final text, byte end or None)."""
        if text or end:
            self._chunks.append((text, end))
        held = "".join(t for t, _ in self._chunks)
        if final:
            self._chunks.clear()
            return cleanup(held), None
        cut = len(held)
        while cut > 0:
            lo = max(0, cut - 3)
            j = held.rfind(" ", lo, cut)
            if j < 0:
                break
            cut = j
        if cut == 0:
            return "", None
        # Map the cut back to a byte position, walking chunks from the end.
        tail = len(held) - cut
        keep: list[tuple[str, int]] = []
        byte_end = None
        for text_i, end_i in reversed(self._chunks):
            if tail == 0:
                byte_end = end_i
                break
            if len(text_i) <= tail:
                keep.append((text_i, end_i))
                tail -= len(text_i)
                continue
            rest = text_i[len(text_i) - tail :]
            if "\ufffd" in rest:  # invalid bytes: the char -> byte map is not exact
                return "", None
            keep.append((rest, end_i))
            byte_end = end_i - len(rest.encode("utf-8"))
            tail = 0
            break
        if byte_end is None:
            return "", None
        keep.reverse()
        self._chunks = keep
        return cleanup(held[:cut]), byte_end
