"""Deprecated: use `tokentrail.vocab` (or `tokentrail.load_vocab`).

Kept so that `from tokentrail.loaders import load_vocab, TokenizerLoadError` keeps
working; the tokenizer formats now live in the `tokentrail.vocab` package.
"""

from __future__ import annotations

from .vocab import TokenizerLoadError, load_vocab

__all__ = ["TokenizerLoadError", "load_vocab"]
