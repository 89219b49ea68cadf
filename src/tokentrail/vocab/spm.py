"""SentencePiece models: compiled following sentencepiece's own decode rules.

Pieces with U+2581 for a space; the dummy prefix stripped while the output is still
empty (`first_pieces`, `first_until_text`); control pieces hidden; `<0xNN>` byte pieces
decoded char by char, each invalid byte one U+FFFD (`spm_runs`). The oracle is
`SentencePieceProcessor.decode`. `sentencepiece_from_pieces` rebuilds a model from a
piece list (GGUF `llama` vocabularies, llama2.c exports).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .core import (
    BYTE_PIECE,
    BYTE_TOKEN,
    TYPE_BYTE,
    TYPE_CONTROL,
    TYPE_NORMAL,
    TYPE_UNKNOWN,
    TokenizerLoadError,
    Vocab,
)


def vocab_from_sentencepiece(sp: Any, name: str = "sentencepiece") -> Vocab:
    """Compile a SentencePieceProcessor, following its own decode rules."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(sp.serialized_model_proto())
    norm = proto.normalizer_spec
    if proto.trainer_spec.treat_whitespace_as_suffix:
        raise TokenizerLoadError(f"{name}: treat_whitespace_as_suffix models are not supported")
    strip_all = norm.remove_extra_whitespaces
    strip_one = norm.add_dummy_prefix or strip_all
    n = sp.get_piece_size()
    pieces: list[bytes | None] = []
    first: dict[int, bytes] = {}
    hidden: set[int] = set()
    byte_ids: set[int] = set()
    names: dict[int, str] = {}
    for i in range(n):
        piece = sp.id_to_piece(i)
        if sp.is_control(i):
            pieces.append(b"")
            hidden.add(i)
            names[i] = piece
        elif sp.is_unknown(i):
            pieces.append(sp.decode([i]).encode("utf-8"))
            names[i] = piece
        elif sp.is_byte(i):
            m = BYTE_TOKEN.match(piece)
            if not m:
                raise TokenizerLoadError(f"{name}: byte piece {piece!r} is malformed")
            pieces.append(bytes([int(m.group(1), 16)]))
            byte_ids.add(i)
        else:
            pieces.append(piece.replace("▁", " ").encode("utf-8"))
            if strip_one and piece.startswith("▁"):
                head = piece.lstrip("▁") if strip_all else piece[1:]
                first[i] = head.replace("▁", " ").encode("utf-8")

    def oracle(ids: Sequence[int], skip: bool) -> str:
        return sp.decode(list(ids))

    return Vocab(
        pieces=pieces,
        name=name,
        hidden=frozenset(hidden),
        byte_ids=frozenset(byte_ids),
        byte_mode="spm_runs",
        first_pieces=first,
        first_until_text=strip_all,
        skipped_breaks_runs=True,
        names=names,
        oracle=oracle,
        source=sp,
    )


def sentencepiece_from_pieces(
    pieces: Sequence[str],
    scores: Sequence[float],
    types: Sequence[int],
    *,
    add_dummy_prefix: bool,
    bos_id: int | None,
    eos_id: int | None,
    where: str,
) -> Any:
    """A SentencePieceProcessor for a BPE vocabulary given as pieces, scores and types.

    The model uses the identity normalizer (no NFKC, spaces kept) and byte fallback when
    the vocabulary has `<0xNN>` byte pieces: the settings of Llama-style SPM models.
    """
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    seen: dict[str, int] = {}
    unk_id = -1
    for i, (piece, score, kind) in enumerate(zip(pieces, scores, types, strict=True)):
        if piece in seen:
            raise TokenizerLoadError(
                f"{where}: piece {piece!r} appears twice (ids {seen[piece]} and {i}); "
                "a SentencePiece model needs unique pieces"
            )
        seen[piece] = i
        if kind not in range(TYPE_NORMAL, TYPE_BYTE + 1):
            raise TokenizerLoadError(f"{where}: token {i} ({piece!r}) has unknown type {kind}")
        if kind == TYPE_BYTE and not BYTE_PIECE.match(piece):
            raise TokenizerLoadError(f"{where}: byte token {i} is {piece!r}, expected <0xNN>")
        if kind == TYPE_UNKNOWN and unk_id < 0:
            unk_id = i
        entry = proto.pieces.add()
        entry.piece = piece
        entry.score = float(score)
        entry.type = kind
    if unk_id < 0:
        raise TokenizerLoadError(f"{where}: no unknown token (<unk>); cannot rebuild the model")
    trainer = proto.trainer_spec
    trainer.model_type = pb.TrainerSpec.BPE
    trainer.vocab_size = len(pieces)
    trainer.byte_fallback = TYPE_BYTE in types
    trainer.unk_id = unk_id
    trainer.bos_id = bos_id if bos_id is not None and types[bos_id] == TYPE_CONTROL else -1
    trainer.eos_id = eos_id if eos_id is not None and types[eos_id] == TYPE_CONTROL else -1
    trainer.pad_id = -1
    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = add_dummy_prefix
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(proto.SerializeToString())
    except Exception as e:  # sentencepiece raises RuntimeError with its own message
        raise TokenizerLoadError(f"{where}: rebuilt SentencePiece model is invalid: {e}") from e
    return sp
