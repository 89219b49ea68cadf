"""llama2.c `tokenizer.bin`: the export turned back into a sentencepiece model."""

from __future__ import annotations

import math
import struct
from pathlib import Path

from .core import BYTE_PIECE, PieceType, TokenizerLoadError, Vocab
from .spm import sentencepiece_from_pieces, vocab_from_sentencepiece

#: How llama2.c's export writes the BOS and EOS pieces (sentencepiece's <s> and </s>).
_LLAMA2C_CONTROL = {"\n<s>\n": "<s>", "\n</s>\n": "</s>"}

_MAX_PIECE_BYTES = 1 << 16


def _parse_llama2c(data: bytes) -> tuple[list[str], list[float]] | None:
    """Pieces and scores of a llama2.c tokenizer.bin, or None if `data` is not one.

    The layout is int32 max_token_length, then per token float32 score, int32 byte length
    and the bytes. Nothing states the token count, so the file must be consumed exactly,
    every length must be within max_token_length (which the longest piece must reach),
    scores must be finite and pieces valid UTF-8: random binary data fails at once.
    """
    if len(data) < 4:
        return None
    (max_len,) = struct.unpack_from("<i", data, 0)
    if not 0 < max_len <= _MAX_PIECE_BYTES:
        return None
    pieces: list[str] = []
    scores: list[float] = []
    off, end, longest = 4, len(data), 0
    while off < end:
        if off + 8 > end:
            return None
        score, n = struct.unpack_from("<fi", data, off)
        off += 8
        if not (0 < n <= max_len and off + n <= end and math.isfinite(score)):
            return None
        try:
            pieces.append(data[off : off + n].decode("utf-8"))
        except UnicodeDecodeError:
            return None
        scores.append(score)
        longest = max(longest, n)
        off += n
    if len(pieces) < 3 or longest != max_len:
        return None
    return pieces, scores


def try_llama2c(path: Path) -> Vocab | None:
    """Compile a llama2.c `tokenizer.bin`, or return None if the file is not one.

    llama2.c exports a SentencePiece vocabulary with U+2581 written as a space and BOS/EOS
    written as "\\n<s>\\n"/"\\n</s>\\n". The export is turned back into a sentencepiece
    model (identity normalizer, dummy prefix, byte fallback), whose decode is the oracle;
    for Llama 2's tokenizer.bin it equals sentencepiece's decode of tokenizer.model.
    That matches llama2.c's own rule (`<0xNN>` is a raw byte, the leading space of the
    piece after BOS is dropped, <unk>/<s>/</s> are special) for text that starts at BOS;
    unlike llama2.c, sentencepiece drops that space only at the start of the text, never
    after a BOS in the middle, and shows <unk> as " ⁇ " and BOS/EOS as nothing.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TokenizerLoadError(f"cannot read tokenizer file {path}: {e}") from e
    parsed = _parse_llama2c(data)
    if parsed is None:
        return None
    raw, scores = parsed
    pieces: list[str] = []
    types: list[int] = []
    bos_id = eos_id = None
    for i, p in enumerate(raw):
        if p in _LLAMA2C_CONTROL:
            pieces.append(_LLAMA2C_CONTROL[p])
            types.append(PieceType.CONTROL)
            if p == "\n<s>\n":
                bos_id = i
            else:
                eos_id = i
        elif p == "<unk>":
            pieces.append(p)
            types.append(PieceType.UNKNOWN)
        elif BYTE_PIECE.match(p):
            pieces.append(p.upper().replace("0X", "0x"))
            types.append(PieceType.BYTE)
        else:
            pieces.append(p.replace(" ", "\u2581"))
            types.append(PieceType.NORMAL)
    sp = sentencepiece_from_pieces(
        pieces,
        scores,
        types,
        add_dummy_prefix=True,
        bos_id=bos_id,
        eos_id=eos_id,
        where=f"{path} (llama2.c tokenizer)",
    )
    v = vocab_from_sentencepiece(sp, name=str(path))
    v.special = frozenset(i for i, t in enumerate(types) if t == PieceType.CONTROL)
    return v
