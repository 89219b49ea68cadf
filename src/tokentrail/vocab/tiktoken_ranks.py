"""tiktoken: rank files (`base64 rank` lines) and `tiktoken.Encoding` objects.

Every rank's bytes as they are, special tokens as their text; invalid UTF-8 is replaced
over the whole byte stream (`stream`). Rank files that store no special tokens get the
well-known ones of their family (`tiktoken_specials`).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .core import TokenizerLoadError, Vocab

TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/=]+ \d+$")

#: Llama 3's special tokens are not stored in its rank file; these are its names.
_LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]

_GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

_LLAMA3_PAT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def tiktoken_specials(n_ranks: int, path: Path | None = None) -> dict[str, int]:
    """Special tokens for well-known rank files that do not store them."""
    if n_ranks == 128000:  # Llama 3.x
        names = _LLAMA3_SPECIALS + [
            f"<|reserved_special_token_{i}|>" for i in range(2, 256 - len(_LLAMA3_SPECIALS) + 2)
        ]
        return {s: n_ranks + k for k, s in enumerate(names[:256])}
    if n_ranks == 50256:  # GPT-2 ranks (as shipped by Whisper)
        return {"<|endoftext|>": 50256}
    if n_ranks == 151643:  # Qwen
        out = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
        for k in range(205):
            out[f"<|extra_{k}|>"] = 151646 + k
        return out
    return {}


def vocab_from_tiktoken_file(path: Path, special_tokens: dict[str, int] | None = None) -> Vocab:
    import tiktoken

    ranks: dict[bytes, int] = {}
    lineno = 0
    try:
        for lineno, line in enumerate(path.read_bytes().splitlines(), 1):  # noqa: B007
            if not line.strip():
                continue
            tok_b64, _, rank = line.partition(b" ")
            ranks[base64.b64decode(tok_b64)] = int(rank)
    except (ValueError, base64.binascii.Error) as e:  # type: ignore[attr-defined]
        raise TokenizerLoadError(f"{path}: bad tiktoken line {lineno}: {e}") from e
    specials = special_tokens if special_tokens is not None else tiktoken_specials(len(ranks), path)
    pat = _LLAMA3_PAT if len(ranks) > 100000 else _GPT2_PAT
    enc = tiktoken.Encoding(
        name=path.name, pat_str=pat, mergeable_ranks=ranks, special_tokens=specials
    )
    v = vocab_from_tiktoken(enc)
    v.name = str(path)
    return v


def vocab_from_tiktoken(enc: Any) -> Vocab:
    """Compile a tiktoken.Encoding: bytes per rank, special tokens as their text."""
    n = enc.n_vocab
    pieces: list[bytes | None] = [None] * n
    for b, i in enc._mergeable_ranks.items():
        pieces[i] = b
    special_map: dict[str, int] = dict(enc._special_tokens)
    for s, i in special_map.items():
        if i >= len(pieces):
            pieces.extend([None] * (i + 1 - len(pieces)))
        pieces[i] = s.encode("utf-8")
    special = frozenset(special_map.values())

    def oracle(ids: Sequence[int], skip: bool) -> str:
        ids = [i for i in ids if not (skip and i in special)]
        return enc.decode(ids)

    return Vocab(
        pieces=pieces,
        name=getattr(enc, "name", "tiktoken"),
        special=special,
        names={i: s for s, i in special_map.items()},
        oracle=oracle,
        source=enc,
    )
