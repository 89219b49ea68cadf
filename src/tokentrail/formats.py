"""Less common tokenizer formats: GGUF vocabularies, Mistral Tekken, llama2.c, and the
generic path for decoder pipelines that are not per-token.

Each format is compiled through a real tokenizer library whose decode is the reference
("oracle") the aligner reproduces, so that no decode rule is re-invented here:

- GGUF: the tokenizer transformers builds from the file, or, where transformers cannot
  build one, a sentencepiece model (SPM vocabularies) or a tokenizers pipeline (byte-level
  BPE, WordPiece) rebuilt from the file's tokens, scores, types and merges.
- Tekken: mistral-common's `Tekkenizer.decode`.
- llama2.c `tokenizer.bin`: a sentencepiece model rebuilt from the exported pieces.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import re
import struct
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .loaders import (
    TokenizerLoadError,
    vocab_from_hf_tokenizer,
    vocab_from_sentencepiece,
    vocab_from_transformers,
)
from .vocab import Vocab

log = logging.getLogger(__name__)

# llama.cpp's token types; the numbering is sentencepiece's ModelProto.SentencePiece.Type.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


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


# -- sentencepiece models rebuilt from a piece list ----------------------------------------


def _sentencepiece_from_pieces(
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
        if kind not in (_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE):
            raise TokenizerLoadError(f"{where}: token {i} ({piece!r}) has unknown type {kind}")
        if kind == _BYTE and not _BYTE_PIECE.match(piece):
            raise TokenizerLoadError(f"{where}: byte token {i} is {piece!r}, expected <0xNN>")
        if kind == _UNKNOWN and unk_id < 0:
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
    trainer.byte_fallback = _BYTE in types
    trainer.unk_id = unk_id
    trainer.bos_id = bos_id if bos_id is not None and types[bos_id] == _CONTROL else -1
    trainer.eos_id = eos_id if eos_id is not None and types[eos_id] == _CONTROL else -1
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


# -- GGUF ---------------------------------------------------------------------------------


@dataclasses.dataclass
class _GGUFTokenizer:
    """The `tokenizer.ggml.*` metadata of a GGUF file."""

    path: Path
    architecture: str
    model: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    add_space_prefix: bool
    pre: str = ""
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def ids_of(self, kind: int) -> set[int]:
        return {i for i, t in enumerate(self.types) if t == kind}


def _gguf_value(field: Any, key: str, path: Path) -> Any:
    """One metadata value from a gguf ReaderField (works across gguf package versions)."""
    from gguf import GGUFValueType

    kind = field.types[0] if field.types else None
    try:
        if kind == GGUFValueType.STRING:
            return bytes(field.parts[field.data[0]]).decode("utf-8")
        if kind == GGUFValueType.ARRAY:
            if field.types[1] == GGUFValueType.STRING:
                return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            return [field.parts[i][0].item() for i in field.data]
        return field.parts[field.data[0]][0].item()
    except UnicodeDecodeError as e:
        raise TokenizerLoadError(f"{path}: GGUF key {key} is not valid UTF-8: {e}") from e


def _read_gguf(path: Path) -> _GGUFTokenizer:
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise TokenizerLoadError(
            f"{path} is a GGUF file; reading it needs the gguf package "
            "(pip install 'tokentrail[gguf]')"
        ) from e
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/IndexError on damaged files
        raise TokenizerLoadError(f"{path}: not a readable GGUF file: {e}") from e
    meta = {
        key: _gguf_value(field, key, path)
        for key, field in reader.fields.items()
        if key.startswith("tokenizer.ggml.") or key == "general.architecture"
    }

    def need(key: str) -> Any:
        if key not in meta:
            raise TokenizerLoadError(f"{path}: GGUF file has no {key}; it holds no tokenizer")
        return meta[key]

    tokens = need("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise TokenizerLoadError(
            f"{path}: {len(tokens)} tokens but {len(types)} token types in the GGUF metadata"
        )
    scores = meta.get("tokenizer.ggml.scores")
    if scores is not None and len(scores) != len(tokens):
        raise TokenizerLoadError(f"{path}: {len(tokens)} tokens but {len(scores)} scores")

    def token_id(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is None:
            return None
        if not 0 <= int(value) < len(tokens):
            raise TokenizerLoadError(f"{path}: {key} {value} is outside the {len(tokens)} tokens")
        return int(value)

    return _GGUFTokenizer(
        path=path,
        architecture=str(meta.get("general.architecture", "")),
        model=str(need("tokenizer.ggml.model")),
        tokens=tokens,
        types=[int(t) for t in types],
        scores=[float(s) for s in scores] if scores is not None else None,
        merges=meta.get("tokenizer.ggml.merges"),
        bos_id=token_id("bos_token_id"),
        eos_id=token_id("eos_token_id"),
        unk_id=token_id("unknown_token_id"),
        add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
        pre=str(meta.get("tokenizer.ggml.pre", "")),
        meta=meta,
    )


def _gguf_transformers(path: Path) -> Any | None:
    """The tokenizer transformers builds from a GGUF file, or None where it cannot.

    The file is linked alone into a temporary folder so that no other tokenizer file
    beside it (a tokenizer_config.json, a tokenizer.json) changes what transformers builds.
    """
    missing = [m for m in ("transformers", "torch") if importlib.util.find_spec(m) is None]
    if missing:
        raise TokenizerLoadError(
            f"{path}: reference='transformers' decodes GGUF files with transformers' GGUF "
            f"tokenizer, which needs {' and '.join(missing)} (pip install 'tokentrail[gguf]'); "
            "reference='llama.cpp' (the default) needs neither"
        )
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="tokentrail-gguf-") as tmp:
        folder, name = path.parent, path.name
        try:
            (Path(tmp) / name).symlink_to(path.resolve())
            folder = Path(tmp)
        except OSError:  # no symlinks on this system: load from the file's own folder
            pass
        try:
            return AutoTokenizer.from_pretrained(str(folder), gguf_file=name, local_files_only=True)
        except Exception as e:  # transformers raises ValueError/KeyError for what it lacks
            log.info("%s: transformers cannot build this tokenizer (%s); rebuilding it", path, e)
            return None


def _gguf_bpe(info: _GGUFTokenizer) -> Any:
    """A tokenizers byte-level BPE (GPT-2 style) from a `gpt2` GGUF vocabulary.

    Control tokens become special added tokens and user-defined ones plain added tokens,
    at their own ids; the decoder is ByteLevel, as for any GPT-2 style tokenizer.json.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if not info.merges:
        raise TokenizerLoadError(f"{info.path}: byte-level BPE GGUF without merges")
    vocab = {t: i for i, t in enumerate(info.tokens)}
    if len(vocab) != len(info.tokens):
        raise TokenizerLoadError(f"{info.path}: the GGUF token list has duplicate tokens")
    merges = []
    for m in info.merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise TokenizerLoadError(f"{info.path}: malformed merge {m!r}")
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    for kind, special in ((_CONTROL, True), (_USER_DEFINED, False)):
        ids = sorted(info.ids_of(kind))
        added = [AddedToken(info.tokens[i], special=special, normalized=False) for i in ids]
        if special:
            tok.add_special_tokens(added)
        else:
            tok.add_tokens(added)
    return tok


def _gguf_wordpiece(info: _GGUFTokenizer) -> Any:
    """A tokenizers WordPiece (BERT uncased) from a `bert` GGUF vocabulary.

    llama.cpp writes BERT vocabularies with U+2581 before word-initial pieces and without
    the `##` of continuation pieces, leaving `[...]` tokens alone; this undoes that so the
    standard WordPiece decoder (with its clean-up of spaces) applies.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab: dict[str, int] = {}
    for i, t in enumerate(info.tokens):
        if t.startswith("[") and t.endswith("]"):
            word = t
        elif t.startswith("\u2581"):
            word = t[1:]
        else:
            word = "##" + t
        if word in vocab:
            raise TokenizerLoadError(
                f"{info.path}: tokens {vocab[word]} and {i} both map to WordPiece {word!r}"
            )
        vocab[word] = i
    unk = info.tokens[info.unk_id] if info.unk_id is not None else "[UNK]"
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    control = sorted(info.ids_of(_CONTROL))
    tok.add_special_tokens([AddedToken(info.tokens[i], special=True) for i in control])
    return tok


def _restrict_to_file(v: Vocab, info: _GGUFTokenizer, origin: str) -> Vocab:
    """Fit a compiled Vocab to the GGUF file: its ids only, its control tokens special.

    A converter may add tokens the file does not have (transformers adds `<|endoftext|>`
    and a second BOS to DeepSeek Coder) or miss that a token is control (it leaves
    DeepSeek's `<｜begin▁of▁sentence｜>` as a normal token). The file is the authority:
    ids past its token list are rejected, and its control tokens are special. The oracle
    drops such tokens before decoding when special tokens are skipped, which is what
    tokenizers does with its own special tokens.
    """
    n = len(info.tokens)
    control = info.ids_of(_CONTROL)
    extra = frozenset(control - v.special - v.hidden)
    base = v.oracle
    oracle = base
    if extra and base is not None:

        def oracle(ids: Sequence[int], skip: bool) -> str:
            if skip:
                ids = [i for i in ids if i not in extra]
            return base(ids, skip)

    special = frozenset(i for i in v.special | control if i < n)
    hidden = frozenset(i for i in v.hidden if i < n)
    names = {i: info.tokens[i] for i in special | hidden}
    return dataclasses.replace(
        v,
        pieces=v.pieces[:n],
        name=f"{info.path} ({origin})",
        special=special,
        hidden=hidden,
        byte_ids=frozenset(i for i in v.byte_ids if i < n),
        first_pieces={i: b for i, b in v.first_pieces.items() if i < n},
        names=names,
        oracle=oracle,
        generic=oracle if v.generic is not None else None,
    )


class GGUFEncoder:
    """Encodes text for a GGUF vocabulary compiled with the llama.cpp reference.

    Decoding never needs it; `encode` (the CLI's `--text`, `--prompt-text`) uses the
    tokenizer rebuilt from the file (see `vocab_from_gguf`), built on first use. With
    `add_special_tokens`, BOS/EOS are added as the file's `add_bos_token` /
    `add_eos_token` say (llama.cpp's defaults: BOS for `llama` and `bert` vocabularies).
    """

    def __init__(self, info: _GGUFTokenizer) -> None:
        self.info = info
        self._vocab: Vocab | None = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self._vocab is None:
            self._vocab = vocab_from_gguf(
                self.info.path, use_transformers=False, reference="transformers"
            )
        ids = self._vocab.encode(text)
        if add_special_tokens:
            meta, model = self.info.meta, self.info.model
            add_bos = meta.get("tokenizer.ggml.add_bos_token", model in ("llama", "bert"))
            if add_bos and self.info.bos_id is not None:
                ids = [self.info.bos_id, *ids]
            if meta.get("tokenizer.ggml.add_eos_token", False) and self.info.eos_id is not None:
                ids = [*ids, self.info.eos_id]
        return ids


def vocab_from_gguf(path: Path, use_transformers: bool = True, reference: str = "auto") -> Vocab:
    """Compile the vocabulary of a GGUF file (llama.cpp) into a Vocab.

    `reference` says whose decode the text equals:

    - "auto" or "llama.cpp": llama.cpp's, the concatenation of every token's
      `llama_token_to_piece`, computed from the file's metadata alone (see
      `tokentrail.gguf_llamacpp`); needs only the gguf reader.
    - "transformers": the tokenizer transformers builds from the file
      (`AutoTokenizer.from_pretrained(folder, gguf_file=name)`), which needs transformers
      and torch (`pip install 'tokentrail[gguf]'`; a missing one is an error, never a
      silent change of decode). Where transformers cannot build this tokenizer (with
      transformers 5: anything but Llama SPM, DeepSeek Coder and Falcon byte-level BPE),
      the tokenizer is rebuilt from the file's metadata as transformers would convert it:
      `llama` (SPM) vocabularies as a sentencepiece BPE model with byte fallback and the
      identity normalizer (Baichuan), `gpt2` ones as a tokenizers byte-level BPE, `bert`
      ones as a tokenizers WordPiece (BGE). `use_transformers=False` forces the rebuild.
      Either way the GGUF's token count and control tokens are authoritative.
    """
    path = Path(path)
    if reference not in ("auto", "llama.cpp", "transformers"):
        raise ValueError(
            f"reference must be 'auto', 'llama.cpp' or 'transformers' for a GGUF file, "
            f"got {reference!r}"
        )
    info = _read_gguf(path)
    if not info.tokens:
        raise TokenizerLoadError(f"{path}: the GGUF token list is empty")
    if reference in ("auto", "llama.cpp"):
        from .gguf_llamacpp import UnsupportedGGUF, llamacpp_vocab

        try:
            v = llamacpp_vocab(str(path), info.model, info.pre, info.tokens, info.types, info.meta)
        except (UnsupportedGGUF, ValueError) as e:
            raise TokenizerLoadError(f"{path}: {e}") from e
        v.source = GGUFEncoder(info)
        return v
    if info.model in ("llama", "gpt2") and use_transformers:
        tok = _gguf_transformers(path)
        if tok is not None:
            return _restrict_to_file(vocab_from_transformers(tok), info, "transformers")
    if info.model == "llama":
        scores = info.scores or [0.0] * len(info.tokens)
        sp = _sentencepiece_from_pieces(
            info.tokens,
            scores,
            info.types,
            add_dummy_prefix=info.add_space_prefix,
            bos_id=info.bos_id,
            eos_id=info.eos_id,
            where=str(path),
        )
        return _restrict_to_file(vocab_from_sentencepiece(sp), info, "sentencepiece")
    if info.model == "gpt2":
        v = vocab_from_hf_tokenizer(_gguf_bpe(info), name=str(path))
        return _restrict_to_file(v, info, "tokenizers BPE")
    if info.model == "bert":
        v = vocab_from_hf_tokenizer(_gguf_wordpiece(info), name=str(path))
        return _restrict_to_file(v, info, "tokenizers WordPiece")
    raise TokenizerLoadError(
        f"{path}: GGUF tokenizer model {info.model!r} is not supported "
        "(supported: llama, gpt2, bert)"
    )


# -- Mistral Tekken -------------------------------------------------------------------------


def _unwrap_mistral(obj: Any) -> Any:
    """The inner tokenizer of a MistralTokenizer or InstructTokenizer (or obj itself)."""
    for _ in range(3):
        inner = getattr(obj, "instruct_tokenizer", None) or getattr(obj, "tokenizer", None)
        if inner is None or inner is obj:
            return obj
        obj = inner
    return obj


def vocab_from_tekken(obj: Any) -> Vocab:
    """Compile a Mistral Tekken tokenizer (tekken.json path or mistral-common object).

    Tekken is tiktoken byte-level BPE with its ranks shifted up by `num_special_tokens`;
    the ids below that are special tokens. The oracle is `Tekkenizer.decode` with
    `SpecialTokenPolicy.IGNORE` for skip_special_tokens=True and `KEEP` (special tokens
    as their names) for False. It decodes each run of non-special tokens separately with
    invalid UTF-8 replaced, so an ignored special token still ends a run: the vocab marks
    that with `skipped_breaks_runs`.

    A mistral-common SentencePiece tokenizer (pre-Tekken models) is compiled as its
    sentencepiece model, whose decode equals mistral-common's with IGNORE.
    """
    try:
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    except ImportError as e:
        raise TokenizerLoadError(
            "Tekken tokenizers need mistral-common (pip install 'tokentrail[mistral]')"
        ) from e
    name = "tekken"
    if isinstance(obj, str | Path):
        path = Path(obj)
        try:
            tok = Tekkenizer.from_file(path)
        except (OSError, ValueError, KeyError, AssertionError) as e:
            raise TokenizerLoadError(f"{path}: not a readable Tekken file: {e}") from e
        name = str(path)
    else:
        tok = _unwrap_mistral(obj)
        if not isinstance(tok, Tekkenizer):
            sp = getattr(tok, "_model", None)
            if sp is not None and type(sp).__module__.startswith("sentencepiece"):
                return vocab_from_sentencepiece(sp, name=type(tok).__name__)
            raise TokenizerLoadError(
                f"unsupported mistral-common tokenizer {type(obj).__name__}: expected a "
                "Tekkenizer, or a MistralTokenizer/InstructTokenizer wrapping one"
            )
        try:
            name = str(tok.file_path)
        except ValueError:  # built in memory, not read from a file
            name = "tekken"
    n = tok.n_words
    n_special = tok.num_special_tokens
    keep = SpecialTokenPolicy.KEEP
    pieces: list[bytes | None] = [tok.id_to_byte_piece(i, keep) for i in range(n)]
    special = frozenset(range(n_special))

    def oracle(ids: Sequence[int], skip: bool) -> str:
        policy = SpecialTokenPolicy.IGNORE if skip else SpecialTokenPolicy.KEEP
        return tok.decode(list(ids), special_token_policy=policy)

    return Vocab(
        pieces=pieces,
        name=str(name),
        special=special,
        byte_mode="stream",
        skipped_breaks_runs=True,
        names={i: (pieces[i] or b"").decode("utf-8") for i in special},
        oracle=oracle,
        source=tok,
    )


# -- llama2.c ---------------------------------------------------------------------------------

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
            types.append(_CONTROL)
            if p == "\n<s>\n":
                bos_id = i
            else:
                eos_id = i
        elif p == "<unk>":
            pieces.append(p)
            types.append(_UNKNOWN)
        elif _BYTE_PIECE.match(p):
            pieces.append(p.upper().replace("0X", "0x"))
            types.append(_BYTE)
        else:
            pieces.append(p.replace(" ", "\u2581"))
            types.append(_NORMAL)
    sp = _sentencepiece_from_pieces(
        pieces,
        scores,
        types,
        add_dummy_prefix=True,
        bos_id=bos_id,
        eos_id=eos_id,
        where=f"{path} (llama2.c tokenizer)",
    )
    v = vocab_from_sentencepiece(sp, name=str(path))
    v.special = frozenset(i for i, t in enumerate(types) if t == _CONTROL)
    return v

