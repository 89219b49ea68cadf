"""The tokenizers of the alignment tests: real texts, and each tokenizer of the corpus
(plus the demo model's) built the way a user would hand it to tokentrail.

Shared by tests/test_align.py, tests/test_context.py and tests/test_formats.py.
"""

from __future__ import annotations

import functools
from pathlib import Path

import tokentrail
from tests.helpers.env import CORPUS
from tokentrail import Aligner

SAMPLES = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n\treturn x**2  # tabs\tand    runs of spaces\r\nCRLF line\r\n",
    "你好世界，这是一个测试。日本語のテキストです。안녕하세요 세계",
    "مرحبا بالعالم، هذا اختبار. ٤٠٠ ٣١٢",
    "नमस्ते दुनिया, यह एक परीक्षण है।",
    "สวัสดีชาวโลก นี่คือการทดสอบ ๑๒๓",
    "Emoji: 🙂 👍🏽 🇫🇷🇯🇵 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️‍🔥",
    "Combining: e\u0301 a\u0308 n\u0303 Zalgo z\u0351\u0352\u0353o\u0354",
    "Accents: café naïve Ångström Øresund ß Œuvre — “quotes” ‘single’ …",
    "    indented\n        deeper\n\n\n  trailing spaces   \n",
    "mixed: abc123 ΑΒΓ δεζ Привет мир ¿Qué? ¡Sí! n't 's 're .,!?",
]

# (test id, path inside the corpus, how to build it)
SPECS = [
    ("gpt2-json", "tokenizers/gpt2/tokenizer.json", None),
    ("gpt2-tiktoken", "tokenizers/gpt2/gpt2.tiktoken", None),
    ("neox-json", "tokenizers/gpt-neox/20B_tokenizer.json", None),
    ("llama3-tiktoken", "tokenizers/llama3/tokenizer.model", None),
    ("qwen2-folder", "tokenizers/qwen2", None),
    ("qwen-tiktoken", "tokenizers/qwen/qwen.tiktoken", None),
    ("pegasus-metaspace", "tokenizers/pegasus/tokenizer.json", None),
    ("t5-spm-unigram", "tokenizers/t5/spiece.model", None),
    ("llama2-spm", "tokenizers/llama2/tokenizer.model", None),
    ("mistral-v1-spm", "tokenizers/mistral/tokenizer.model.v1", None),
    ("mistral-v3-spm", "tokenizers/mistral/mistral_instruct_tokenizer_240323.model.v3", None),
    ("llama2-hf-json", "tokenizers/llama2/tokenizer.model", "hf"),
    ("mistral-v3-hf-json", "tokenizers/mistral/mistral_instruct_tokenizer_240323.model.v3", "hf"),
    ("qwen2-transformers-clean", "tokenizers/qwen2", "transformers-clean"),
    ("gpt2-mlx-wrapper", "tokenizers/gpt2/tokenizer.json", "mlx"),
    ("gpt2-added-tokens", "tokenizers/gpt2/tokenizer.json", "added"),
    ("llama2-hf-no-strip", "tokenizers/llama2/tokenizer.model", "hf-no-strip"),
    ("pegasus-metaspace-first", "tokenizers/pegasus/tokenizer.json", "metaspace-first"),
    ("pegasus-metaspace-never", "tokenizers/pegasus/tokenizer.json", "metaspace-never"),
    ("wordpiece-trained", "tokenizers/MANIFEST.json", "wordpiece"),
    ("wordpiece-trained-cleanup", "tokenizers/MANIFEST.json", "wordpiece-cleanup"),
    # transformers' Python-side sentencepiece backend: its own decode rules, generic path
    # byte-fallback BPE whose decoder is ByteFallback then Metaspace, with no Fuse step
    ("chatglm3-json", "tokenizers/chatglm3/tokenizer.json", None),
    ("llama2-transformers-slow", "tokenizers/llama2/tokenizer.model", "slow"),
    # Needs no corpus: the demo model's own tokenizer runs on a fresh clone too.
    ("demo-model", "", "demo"),
]


@functools.cache
def converted(model_file: str) -> Path:
    """A tokenizer.json folder converted by transformers from a sentencepiece model."""
    import tempfile

    from transformers import AutoTokenizer

    src = Path(tempfile.mkdtemp(prefix="tt-spm-src-"))
    (src / "tokenizer.model").symlink_to(model_file)
    out = Path(tempfile.mkdtemp(prefix="tt-spm-hf-"))
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


@functools.cache
def tokenizer_source(key: str) -> object:
    _name, rel, how = next(s for s in SPECS if s[0] == key)
    path = CORPUS / rel
    if how == "demo":
        from tokentrail.generate import DEMO_MODEL

        return str(DEMO_MODEL)
    if how is None:
        return str(path)
    if how == "hf":
        return str(converted(str(path)))
    if how == "slow":
        from transformers import SentencePieceBackend

        return SentencePieceBackend(vocab_file=str(path))
    if how == "transformers-clean":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(
            path,
            clean_up_tokenization_spaces=True,
            clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True,
        )
    if how == "mlx":
        import tempfile

        from mlx_lm.tokenizer_utils import load as mlx_load

        folder = Path(tempfile.mkdtemp(prefix="tt-mlx-"))
        (folder / "tokenizer.json").symlink_to(path)
        return mlx_load(folder)
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    if how == "added":  # added tokens, special and not, some outside the byte alphabet
        tok = Tokenizer.from_file(str(path))
        tok.add_tokens([AddedToken("<think>"), AddedToken(" two words "), AddedToken("→ü")])
        tok.add_special_tokens([AddedToken("<|tool|>", special=True)])
        return tok
    if how == "hf-no-strip":  # Gemma-style SentencePiece decoder without Strip
        tok = Tokenizer.from_file(str(converted(str(path)) / "tokenizer.json"))
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
        return tok
    if how.startswith("metaspace-"):
        tok = Tokenizer.from_file(str(path))
        tok.decoder = decoders.Metaspace(prepend_scheme=how.split("-")[1])
        return tok
    if how.startswith("wordpiece"):  # a WordPiece model trained here on the samples
        from tokenizers.trainers import WordPieceTrainer

        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = WordPieceTrainer(vocab_size=400, special_tokens=["[UNK]", "[CLS]", "[SEP]"])
        tok.train_from_iterator(SAMPLES * 5, trainer)
        tok.decoder = decoders.WordPiece(cleanup=how.endswith("cleanup"))
        return tok
    raise AssertionError(how)


@functools.cache
def spec_aligner(key: str, skip: bool) -> Aligner:
    """The aligner of tokenizer `key` of `SPECS` (cached; the corpus is not checked)."""
    return Aligner(tokenizer_source(key), skip_special_tokens=skip)


def takes_first_piece(v: tokentrail.Vocab, skipped: frozenset[int], before: list[int]) -> bool:
    """Whether the next token takes its first-token piece after the ids `before`:
    no token added bytes yet (sentencepiece, `first_until_text`), or none was pushed
    that is not skipped (tokenizers' Metaspace and Strip)."""
    for i in before:
        if i in skipped:
            continue
        if not (v.first_until_text and not v.first_pieces.get(i, v.pieces[i])):
            return False
    return True


def own_bytes(aligner: Aligner, ids: list[int], index: int) -> bytes:
    """The bytes token `index` contributes in the stream of `ids` (first-token rules
    included)."""
    v = aligner.vocab
    skipped = v.hidden | (v.special if aligner.skip_special_tokens else frozenset())
    if ids[index] in skipped:
        return b""
    is_first = takes_first_piece(v, skipped, ids[:index])
    if is_first and ids[index] in v.first_pieces:
        return v.first_pieces[ids[index]]
    return v.pieces[ids[index]] or b""
