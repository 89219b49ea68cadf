"""GGUF files (llama.cpp): the `tokenizer.ggml.*` metadata, and its two references.

`reference="llama.cpp"` (the default) compiles llama.cpp's own decode from the metadata
alone (`gguf_llamacpp`, beside this module); `reference="transformers"` the tokenizer
transformers builds from the file, or where it cannot, the file rebuilt as transformers
would convert it (sentencepiece for `llama`, tokenizers BPE for `gpt2`, WordPiece for
`bert`). See `vocab_from_gguf`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .core import (
    TYPE_CONTROL,
    TYPE_NORMAL,
    TYPE_USER_DEFINED,
    TokenizerLoadError,
    Vocab,
)
from .gguf_meta import read_metadata
from .hf_json import vocab_from_hf_tokenizer
from .hf_objects import vocab_from_transformers
from .spm import sentencepiece_from_pieces, vocab_from_sentencepiece

log = logging.getLogger(__name__)


@dataclasses.dataclass
class GGUFTokenizer:
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


def read_gguf(path: Path) -> GGUFTokenizer:
    """The `tokenizer.ggml.*` metadata (and ``general.architecture``) of GGUF file
    `path`, read from its header by `gguf_meta.read_metadata` (no tensor is read)."""
    meta = read_metadata(
        path, lambda key: key.startswith("tokenizer.ggml.") or key == "general.architecture"
    )

    def need(key: str) -> Any:
        if key not in meta:
            raise TokenizerLoadError(f"{path}: GGUF file has no {key}; it holds no tokenizer")
        return meta[key]

    tokens = need("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or [TYPE_NORMAL] * len(tokens)
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

    return GGUFTokenizer(
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


def gguf_eog_ids(path: Path) -> frozenset[int]:
    """The ids llama.cpp ends generation on for this file's vocabulary (its
    ``llama_vocab_is_eog``: the EOS, EOT and EOM ids the metadata names and the
    end-of-turn markers it finds by their text, `gguf_llamacpp.load_attributes`). What
    llama-server stops on: SmolLM2's ``<|endoftext|>`` as well as its EOS ``<|im_end|>``."""
    from .gguf_llamacpp import load_attributes, named_tokens

    info = read_gguf(path)
    tokens = named_tokens(info.tokens)
    try:
        return load_attributes(info.model, tokens, info.types, info.meta)[1]
    except ValueError as e:
        raise TokenizerLoadError(f"{path}: {e}") from e


def gguf_transformers_tokenizer(path: Path) -> Any | None:
    """The tokenizer transformers builds from a GGUF file, or None where it cannot.

    The file is linked alone into a temporary folder so that no other tokenizer file
    beside it (a tokenizer_config.json, a tokenizer.json) changes what transformers builds.
    """
    missing = [m for m in ("transformers", "torch") if importlib.util.find_spec(m) is None]
    if missing:
        raise TokenizerLoadError(
            f"{path}: reference='transformers' decodes GGUF files with transformers' GGUF "
            f"tokenizer, which needs {' and '.join(missing)} "
            "(pip install 'tokentrail[gguf,torch]'); "
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


#: Its old, private name.
_gguf_transformers = gguf_transformers_tokenizer


def _gguf_bpe(info: GGUFTokenizer) -> Any:
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
    for kind, special in ((TYPE_CONTROL, True), (TYPE_USER_DEFINED, False)):
        ids = sorted(info.ids_of(kind))
        added = [AddedToken(info.tokens[i], special=special, normalized=False) for i in ids]
        if special:
            tok.add_special_tokens(added)
        else:
            tok.add_tokens(added)
    return tok


def _gguf_wordpiece(info: GGUFTokenizer) -> Any:
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
    control = sorted(info.ids_of(TYPE_CONTROL))
    tok.add_special_tokens([AddedToken(info.tokens[i], special=True) for i in control])
    return tok


def _restrict_to_file(v: Vocab, info: GGUFTokenizer, origin: str) -> Vocab:
    """Fit a compiled Vocab to the GGUF file: its ids only, its control tokens special.

    A converter may add tokens the file does not have (transformers adds `<|endoftext|>`
    and a second BOS to DeepSeek Coder) or miss that a token is control (it leaves
    DeepSeek's `<｜begin▁of▁sentence｜>` as a normal token). The file is the authority:
    ids past its token list are rejected, and its control tokens are special. The oracle
    drops such tokens before decoding when special tokens are skipped, which is what
    tokenizers does with its own special tokens.
    """
    n = len(info.tokens)
    control = info.ids_of(TYPE_CONTROL)
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

    def __init__(self, info: GGUFTokenizer) -> None:
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
      `tokentrail.vocab.gguf_llamacpp`); needs only the gguf reader.
    - "transformers": the tokenizer transformers builds from the file
      (`AutoTokenizer.from_pretrained(folder, gguf_file=name)`), which needs transformers
      and torch (`pip install 'tokentrail[gguf,torch]'`; a missing one is an error, never a
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
    info = read_gguf(path)
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
        tok = gguf_transformers_tokenizer(path)
        if tok is not None:
            return _restrict_to_file(vocab_from_transformers(tok), info, "transformers")
    if info.model == "llama":
        scores = info.scores or [0.0] * len(info.tokens)
        sp = sentencepiece_from_pieces(
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
