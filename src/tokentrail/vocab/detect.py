"""Format detection: a tokenizer object or a path -> the module that compiles it.

Formats are detected from content, not only from file names: a JSON object with a
`model` key is a Hugging Face tokenizer.json, a file starting with `GGUF` is a GGUF
vocabulary, lines of `base64 rank` are tiktoken ranks, and anything sentencepiece can
parse is a SentencePiece model (else a llama2.c export is tried).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .bpe_folder import THROUGH_TRANSFORMERS, bpe_from_files, tokenizer_family, via_transformers
from .core import REFERENCES, TokenizerLoadError, Vocab, check_reference, read_json
from .hf_json import vocab_from_hf_tokenizer
from .hf_objects import vocab_from_transformers
from .spm import vocab_from_sentencepiece
from .tiktoken_ranks import TIKTOKEN_LINE, vocab_from_tiktoken, vocab_from_tiktoken_file


def load_vocab(tokenizer: Any, reference: str = "auto") -> Vocab:
    """Compile a tokenizer object, or a path to tokenizer files, into a `Vocab`.

    `reference` chooses whose decode the text equals: "auto" is the format's own library
    (tokenizers for tokenizer.json, sentencepiece, tiktoken, mistral-common, transformers
    for transformers objects) and llama.cpp for GGUF files; "llama.cpp" and
    "transformers" choose for GGUF files (see `vocab_from_gguf`). A reference that does
    not apply to the format is a ValueError.

    An object with a `__tokentrail_vocab__()` method (an engine's own tokenizer, such
    as llama.cpp's) compiles itself: that method returns its `Vocab`.
    """
    check_reference(reference, "", "", REFERENCES)  # the value itself
    if isinstance(tokenizer, str | os.PathLike):
        return _from_path(Path(tokenizer), reference)
    if isinstance(tokenizer, Vocab):
        check_reference(reference, "an already compiled Vocab", tokenizer.name, ())
        return tokenizer
    mod = type(tokenizer).__module__
    name = type(tokenizer).__name__
    is_transformers = hasattr(tokenizer, "convert_ids_to_tokens") and hasattr(tokenizer, "decode")
    fmt = f"a {mod}.{name} object"
    check_reference(reference, fmt, "the tokenizer", ("transformers",) if is_transformers else ())
    hook = getattr(type(tokenizer), "__tokentrail_vocab__", None)
    if hook is not None:
        vocab = hook(tokenizer)
        if not isinstance(vocab, Vocab):
            raise TokenizerLoadError(
                f"{type(tokenizer).__name__}.__tokentrail_vocab__() returned "
                f"{type(vocab).__name__}, not a tokentrail Vocab"
            )
        return vocab
    if mod.startswith("tokenizers") and name == "Tokenizer":
        return vocab_from_hf_tokenizer(tokenizer)
    if hasattr(tokenizer, "_tokenizer") and mod.startswith("mlx_lm"):
        return load_vocab(tokenizer._tokenizer)  # mlx-lm TokenizerWrapper
    if mod.startswith("sentencepiece"):
        return vocab_from_sentencepiece(tokenizer)
    if mod.startswith("tiktoken") or (hasattr(tokenizer, "_mergeable_ranks")):
        return vocab_from_tiktoken(tokenizer)
    if mod.startswith("mistral_common"):
        from .tekken import vocab_from_tekken

        return vocab_from_tekken(tokenizer)
    if hasattr(tokenizer, "convert_ids_to_tokens") and hasattr(tokenizer, "decode"):
        return vocab_from_transformers(tokenizer)
    raise TokenizerLoadError(
        f"unsupported tokenizer object {mod}.{name}: pass a tokenizers.Tokenizer, a "
        "transformers tokenizer, an mlx-lm TokenizerWrapper, a SentencePieceProcessor, "
        "a tiktoken.Encoding, or a path to tokenizer files"
    )


_HF = ("transformers",)


def _from_path(path: Path, reference: str = "auto") -> Vocab:
    if not path.exists():
        raise TokenizerLoadError(f"tokenizer path does not exist: {path}")
    if path.is_dir():
        return _from_dir(path, reference)
    try:
        with path.open("rb") as f:
            head = f.read(256)
    except OSError as e:
        raise TokenizerLoadError(f"cannot read tokenizer file {path}: {e}") from e
    if head.startswith(b"GGUF"):
        from .gguf_file import vocab_from_gguf

        return vocab_from_gguf(path, reference=reference)
    stripped = head.lstrip()
    if stripped.startswith(b"{"):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TokenizerLoadError(f"{path} looks like JSON but does not parse: {e}") from e
        return _from_json(path, data, reference)
    first_line = head.split(b"\n", 1)[0].strip()
    if first_line and TIKTOKEN_LINE.match(first_line):
        check_reference(reference, "tiktoken ranks", path, ())
        return vocab_from_tiktoken_file(path)
    try:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor()
        sp.LoadFromFile(str(path))
    except Exception as e:  # sentencepiece raises plain RuntimeError/OSError
        from .llama2c import try_llama2c

        v = try_llama2c(path)
        if v is not None:
            check_reference(reference, "a llama2.c tokenizer", path, ())
            return v
        raise TokenizerLoadError(
            f"{path}: not a recognised tokenizer file (tried tokenizer.json, GGUF, "
            f"tiktoken ranks, SentencePiece model, llama2.c tokenizer): {e}"
        ) from e
    check_reference(reference, "a SentencePiece model", path, ())
    return vocab_from_sentencepiece(sp, name=path.name)


def _from_json(path: Path, data: Any, reference: str = "auto") -> Vocab:
    if isinstance(data, dict) and "model" in data and ("decoder" in data or "added_tokens" in data):
        from tokenizers import Tokenizer

        check_reference(reference, "a Hugging Face tokenizer.json", path, _HF)
        if reference == "transformers" and path.name == "tokenizer.json":
            return via_transformers(path.parent, "tokenizer.json")
        tok = Tokenizer.from_file(str(path))
        cfg = None
        if path.name == "tokenizer.json":
            cfg = read_json(path.parent / "tokenizer_config.json")
        return vocab_from_hf_tokenizer(tok, name=str(path), config=cfg, spec=data)
    if isinstance(data, dict) and "vocab" in data and "config" in data:
        from .tekken import vocab_from_tekken

        check_reference(reference, "a Mistral Tekken file", path, ())
        return vocab_from_tekken(path)
    if isinstance(data, dict) and data and all(isinstance(v, int) for v in data.values()):
        return _from_dir(path.parent, reference)  # vocab.json: needs merges.txt beside it
    raise TokenizerLoadError(f"{path}: JSON file is neither a tokenizer.json nor a Tekken file")


def _from_dir(path: Path, reference: str = "auto") -> Vocab:
    cfg = read_json(path / "tokenizer_config.json")
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        check_reference(reference, "a Hugging Face tokenizer folder", path, _HF)
        if reference == "transformers":
            # transformers' decode, not the file's: its tokenizer class may rebuild the
            # decoder (LlamaTokenizer adds ByteFallback), tokenizer_config.json's
            # added_tokens_decoder overrides the file's `special` flags, and the tokens
            # the config names (unk/bos/eos) become special (tokenization_utils_base).
            return via_transformers(path, "tokenizer.json")
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        return vocab_from_hf_tokenizer(tok, name=str(path), config=cfg)
    family = tokenizer_family(path, cfg)
    if family in THROUGH_TRANSFORMERS or (
        (path / "vocab.txt").is_file() and not (path / "vocab.json").is_file()
    ):
        check_reference(reference, f"a {family or 'bert'} tokenizer folder", path, _HF)
        return via_transformers(path, family or "bert")
    if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
        check_reference(reference, "a vocab.json + merges.txt folder", path, _HF)
        return vocab_from_hf_tokenizer(bpe_from_files(path, cfg), name=str(path), config=cfg)
    for candidate in ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model"):
        if (path / candidate).is_file():
            return _from_path(path / candidate, reference)
    for candidate in sorted(path.glob("*.tiktoken")) + sorted(path.glob("tekken*.json")):
        return _from_path(candidate, reference)
    raise TokenizerLoadError(
        f"{path}: no tokenizer.json, vocab.json+merges.txt, tokenizer.model, "
        "*.tiktoken or tekken.json found in this folder"
    )
