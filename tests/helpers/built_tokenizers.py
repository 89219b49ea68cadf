"""tokenizer.json files built with the `tokenizers` library itself, over a grid of the
settings real files use, for differential tests against `Tokenizer.decode`.

Each build is a small byte-fallback BPE (or Unigram) trained on a few sentences in
several scripts, with a normalizer, pre-tokenizer and decoder of the kinds found in
published files, including the schemas of older files (Metaspace's `add_prefix_space`
and `str_rep` keys, before `prepend_scheme`), and added tokens with every combination
of the `special` and `normalized` flags.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEXTS = [
    "Hello world, this is a test of the tokenizer.",
    "The quick brown fox jumps over the lazy dog",
    "café naïve Ångström — “quotes”",
    "你好世界，这是一个测试。日本語のテキストです。",
    "Привет мир 🙂 👍🏽",
    "  two spaces, a\ttab\nand a new line  ",
]

#: Words the tests encode and mix with added tokens.
WORDS = ["Hello", " world", "café", " 你好", "🙂", " x", "  two", "\n"]

#: (content, special, normalized)
ADDED = [
    ("<unk>", True, False),
    ("<s>", True, False),
    ("</s>", True, False),
    ("<plain>", False, True),
    ("<plain_raw>", False, False),
    ("<|sp|>", True, True),
    ("<|sp_raw|>", True, False),
    ("▁<mark>", True, False),
    ("<MASK>", True, True),  # a lowercasing normalizer changes it
    ("<Plain>", False, True),
    ("ﬁne", False, True),  # NFKC makes it "fine"
]

NORMALIZERS = ("none", "llama-legacy", "replace-only", "lowercase")
DECODERS = (
    "metaspace",
    "metaspace-seq",
    "metaspace-legacy-true",
    "metaspace-legacy-false",
    "metaspace-first",
    "metaspace-never",
    "llama2",
    "llama2-no-strip",
    "bytefallback-metaspace",
)


@dataclass(frozen=True)
class Build:
    """One point of the grid: how the tokenizer.json is made."""

    model: str  # "bpe" | "unigram" | "bytelevel" | "wordpiece"
    normalizer: str
    decoder: str
    unk_special: bool = True

    @property
    def key(self) -> str:
        return f"{self.model}-{self.normalizer}-{self.decoder}" + (
            "" if self.unk_special else "-unk-plain"
        )


def grid() -> list[Build]:
    out = [Build(m, n, d) for m, n, d in itertools.product(("bpe",), NORMALIZERS, DECODERS)]
    out += [Build("unigram", n, d) for n in ("none", "llama-legacy") for d in DECODERS[:3]]
    out += [Build("bpe", n, "llama2", unk_special=False) for n in ("none", "llama-legacy")]
    # The trained decoder kept: ByteLevel and WordPiece, under normalizers that change
    # an added token (lower case, NFKC's "ﬁ" -> "fi", BERT's).
    out += [Build("bytelevel", n, "trained") for n in ("none", "lowercase", "nfkc")]
    out += [Build("wordpiece", n, "trained") for n in ("none", "bert-lower", "nfkc")]
    return out


def _decoder(kind: str) -> dict[str, Any]:
    meta = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
    llama2 = [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    strip = {"type": "Strip", "content": " ", "start": 1, "stop": 0}
    return {
        "metaspace": meta,
        "metaspace-seq": {"type": "Sequence", "decoders": [meta]},
        # The schema tokenizers wrote before prepend_scheme (< 0.14): add_prefix_space
        # and str_rep; tokenizers still reads it (pre_tokenizers/metaspace.rs).
        "metaspace-legacy-true": {
            "type": "Metaspace",
            "replacement": "▁",
            "str_rep": "▁",
            "add_prefix_space": True,
        },
        "metaspace-legacy-false": {
            "type": "Metaspace",
            "replacement": "▁",
            "add_prefix_space": False,
            "prepend_scheme": "never",
        },
        "metaspace-first": {**meta, "prepend_scheme": "first"},
        "metaspace-never": {**meta, "prepend_scheme": "never", "split": False},
        "llama2": {"type": "Sequence", "decoders": [*llama2, strip]},
        "llama2-no-strip": {"type": "Sequence", "decoders": llama2},
        "bytefallback-metaspace": {
            "type": "Sequence",
            "decoders": [{"type": "ByteFallback"}, meta],
        },
    }[kind]


def _normalizer(kind: str) -> dict[str, Any] | None:
    prepend = {"type": "Prepend", "prepend": "▁"}
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    return {
        "none": None,
        "llama-legacy": {"type": "Sequence", "normalizers": [prepend, replace]},
        "replace-only": replace,
        "lowercase": {"type": "Lowercase"},
        "nfkc": {"type": "NFKC"},
        "bert-lower": {
            "type": "BertNormalizer",
            "clean_text": True,
            "handle_chinese_chars": True,
            "strip_accents": None,
            "lowercase": True,
        },
    }[kind]


def _trained(model: str) -> Any:
    """A small tokenizer of the given model kind, trained on `TEXTS`."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    specials = ["<unk>", "<s>", "</s>"]
    if model == "bytelevel":  # GPT-2 style: no byte fallback, bytes as characters
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer: Any = trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
    elif model == "wordpiece":  # BERT style
        tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials)
    else:
        if model == "bpe":
            tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
            trainer = trainers.BpeTrainer(
                vocab_size=300, special_tokens=specials, initial_alphabet=["▁"]
            )
        else:
            tok = Tokenizer(models.Unigram())
            trainer = trainers.UnigramTrainer(
                vocab_size=200, special_tokens=specials, unk_token="<unk>", byte_fallback=True
            )
        # Trained with the Metaspace pre-tokenizer: pieces carry "▁" as real files do.
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
    tok.normalizer = normalizers.Sequence([])
    tok.train_from_iterator(TEXTS * 20, trainer)
    return tok


def build(b: Build, folder: Path) -> Path:
    """Write the tokenizer.json of `b` under `folder` and return its path."""
    from tokenizers import AddedToken, Tokenizer

    specials = ["<unk>", "<s>", "</s>"]
    tok = _trained(b.model)
    spec = json.loads(tok.to_str())
    if b.model == "bpe":
        vocab = spec["model"]["vocab"]
        for byte in range(256):  # byte fallback pieces, as sentencepiece-converted files have
            vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["normalizer"] = _normalizer(b.normalizer)
    if b.normalizer == "llama-legacy":
        spec["pre_tokenizer"] = None  # the normalizer does the "▁" work (Llama 2 files)
    if b.decoder in DECODERS:
        spec["decoder"] = _decoder(b.decoder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    path.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    tok = Tokenizer.from_file(str(path))
    for content, special, normalized in ADDED:
        if content in specials:
            continue
        t = AddedToken(content, special=special, normalized=normalized)
        (tok.add_special_tokens if special else tok.add_tokens)([t])
    spec = json.loads(tok.to_str())
    for a in spec["added_tokens"]:
        if a["content"] == "<unk>":
            a["special"] = b.unk_special
    if b.decoder == "metaspace-legacy-true":
        spec["decoder"] = _decoder(b.decoder)  # keep the old schema as written
    path.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return path
