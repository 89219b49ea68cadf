"""Mistral Tekken (tekken.json or mistral-common objects), through mistral-common."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .core import TokenizerLoadError, Vocab
from .spm import vocab_from_sentencepiece


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
