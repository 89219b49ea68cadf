"""llguidance's tokenizer for a model's tokenizer, built once per tokenizer object.

* A Hugging Face fast tokenizer (transformers', or mlx-lm's wrapper around one):
  llguidance reads its `tokenizer.json` (`llguidance.hf.from_tokenizer`, or the same
  serialisation of `backend_tokenizer` when the object only forwards to one).
* Any other tokenizer tokentrail can read (llama.cpp's GGUF vocabulary, sentencepiece,
  tiktoken...): the bytes of each id from tokentrail's `vocab_for(tokenizer).pieces`,
  special tokens marked as llguidance expects (a 0xFF prefix: never produced as text),
  and the tokenizer's own `encode` for the text llguidance tokenizes.

The end-of-sequence ids are the tokenizer's (`eos_ids`: mlx-lm's `eos_token_ids`, the
set tokentrail's loaders attach, else `eos_token_id`), so the token the grammar allows
at its end is one `stream_generate` stops at.
"""

from __future__ import annotations

import copy
from typing import Any

import llguidance as llg

from ..errors import ConstraintError
from ..prompting import eos_ids, vocab_for
from . import kept

__all__ = ["lltokenizer_for"]


def lltokenizer_for(tokenizer: Any) -> Any:
    """llguidance's `LLTokenizer` for `tokenizer`, cached per tokenizer object (building
    it reads the whole vocabulary) for as long as the tokenizer lives (`kept`): a process
    that loads one model after another keeps none of the earlier ones' (about 70-180 MB
    each for a 150k vocabulary)."""
    lltok = kept.lltok_of(tokenizer)
    if lltok is None:
        lltok = kept.keep(tokenizer, _build(tokenizer))
    return lltok


def _build(tokenizer: Any) -> Any:
    eos = sorted(eos_ids(tokenizer))
    if not eos:
        raise ConstraintError(
            "a constraint needs the tokenizer's end-of-sequence token, and this tokenizer "
            f"({type(tokenizer).__name__}) has none", "response_format",
        )
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        try:
            from transformers import PreTrainedTokenizerFast
        except ImportError:  # pragma: no cover - a backend_tokenizer comes from transformers
            PreTrainedTokenizerFast = ()  # type: ignore[assignment,misc]
        if isinstance(tokenizer, PreTrainedTokenizerFast):
            from llguidance.hf import from_tokenizer

            return from_tokenizer(tokenizer, eos_token=eos)
        # A wrapper forwarding to a fast tokenizer (mlx-lm's TokenizerWrapper): the same
        # serialisation `from_tokenizer` makes, without padding or truncation.
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        return llg.LLTokenizer(backend.to_str(), eos_token=eos)
    return llg.LLTokenizer(llg.TokenizerWrapper(_VocabTokens(tokenizer, eos[0])), eos_token=eos)


class _VocabTokens:
    """What `llguidance.TokenizerWrapper` reads: each id's bytes (special ones prefixed
    with 0xFF), the special ids, EOS/BOS, and an encoder for text."""

    def __init__(self, tokenizer: Any, eos: int) -> None:
        vocab = vocab_for(tokenizer)
        special = vocab.special | vocab.hidden
        self.tokens = [
            b"\xff" + (piece or vocab.names.get(i, "").encode()) if i in special else piece or b""
            for i, piece in enumerate(vocab.pieces)
        ]
        self.special_token_ids = sorted(special)
        self.eos_token_id = eos
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self._encode = tokenizer.encode

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return list(self._encode(text, add_special_tokens=False))
