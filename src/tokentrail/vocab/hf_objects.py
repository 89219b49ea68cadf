"""transformers tokenizer objects: their tokenizers backend, or their own decode.

A fast tokenizer is its backend tokenizer.json (see `hf_json`) with the object's decode
as the oracle; what skip_special_tokens drops is asked of the object itself. A
Python-side ("slow") tokenizer takes the generic path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .core import TokenizerLoadError, Vocab
from .hf_json import vocab_from_hf_tokenizer


def _skipped_by(tok: Any, token_id: int) -> bool:
    """Whether a transformers tokenizer's decode drops this id with skip_special_tokens."""
    try:
        shown = tok.decode([token_id], skip_special_tokens=False)
        return bool(shown) and tok.decode([token_id], skip_special_tokens=True) == ""
    except Exception:  # an id the tokenizer cannot decode alone is not a special token
        return False


def vocab_from_transformers(tok: Any) -> Vocab:
    """A transformers tokenizer: its tokenizers backend plus its own clean-up rule."""
    backend = getattr(tok, "_tokenizer", None) or getattr(tok, "backend_tokenizer", None)
    cleanup = bool(getattr(tok, "clean_up_tokenization_spaces", False))
    if cleanup and backend is not None:
        # Versions differ on when the clean-up really runs (transformers 5 skips it for
        # BPE models unless forced): ask the tokenizer itself on a probe.
        probe = backend.encode("a , b", add_special_tokens=False).ids
        cleanup = tok.decode(probe) != backend.decode(probe, skip_special_tokens=False)

    def oracle(ids: Sequence[int], skip: bool) -> str:
        return tok.decode(list(ids), skip_special_tokens=skip)

    special_ids = set(getattr(tok, "all_special_ids", []) or [])
    if backend is not None and type(backend).__module__.startswith("tokenizers"):
        # What skip_special_tokens drops is the backend's special added tokens, which
        # need not be all of `all_special_ids` (a GGUF's user-defined `</s>` named as EOS
        # is one, kept by transformers 5): ask the tokenizer about each candidate.
        candidates = special_ids | {int(i) for i in backend.get_added_tokens_decoder()}
        special_ids = {i for i in candidates if _skipped_by(tok, i)}
        return vocab_from_hf_tokenizer(
            backend,
            name=type(tok).__name__,
            cleanup=cleanup,
            oracle=oracle,
            special_ids=special_ids,
        )
    if hasattr(tok, "convert_ids_to_tokens") and hasattr(tok, "__len__"):
        # A Python-side ("slow") tokenizer: its decode has rules of its own (transformers'
        # sentencepiece backend prints byte pieces as "<0xNN>", for one), so take the
        # generic path, which is exact against its decode whatever those rules are.
        from .generic import generic_vocab

        n = len(tok)
        names = tok.convert_ids_to_tokens(list(range(n)))
        return generic_vocab(
            [t if isinstance(t, str) else None for t in names],
            special_ids,
            oracle,
            name=type(tok).__name__,
            source=tok,
        )
    raise TokenizerLoadError(
        f"transformers tokenizer {type(tok).__name__} has neither a tokenizers backend "
        "nor a sentencepiece model; pass its tokenizer files instead"
    )
