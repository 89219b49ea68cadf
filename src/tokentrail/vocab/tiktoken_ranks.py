"""tiktoken: rank files (`base64 rank` lines) and `tiktoken.Encoding` objects.

Every rank's bytes as they are, special tokens as their text; invalid UTF-8 is replaced
over the whole byte stream (`stream`). A rank file stores no special tokens: the file of
an encoding in tiktoken's registry (cl100k_base, o200k_base, ...) is recognised by its
hash, as tiktoken itself checks it, and built by the registry's own constructor, which
brings its special tokens and pattern (`registered_encoding`); other files get the
well-known ones of their family (`tiktoken_specials`).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .core import TokenizerLoadError, Vocab

log = logging.getLogger(__name__)

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


class _NotThisFile(Exception):
    """A registry constructor asked for a file other than the one being loaded."""


_REGISTRY_LOCK = threading.Lock()


def registered_encoding(data: bytes) -> Any | None:
    """The `tiktoken.Encoding` of tiktoken's registry whose rank file is `data`, or None.

    Each registry constructor (`tiktoken_ext.openai_public.cl100k_base`, ...) loads its
    ranks through `tiktoken.load.read_file_cached(url, expected_hash)`. Every constructor
    is run with that reader answering from `data` for the hash `data` has, and refusing
    any other file, so nothing is downloaded and the encoding is the registry's own: its
    special tokens, pattern and size, never a copy of them. Where several encodings
    share the file (p50k_base and p50k_edit, o200k_base and o200k_harmony), the one the
    file is named after in its URL wins.
    """
    import tiktoken
    import tiktoken.load
    import tiktoken.registry

    if not hasattr(tiktoken.load, "read_file_cached"):
        log.warning("this tiktoken has no read_file_cached: registered rank files not recognised")
        return None
    digest = hashlib.sha256(data).hexdigest()
    names = tiktoken.registry.list_encoding_names()  # runs the registry's plugin scan
    constructors = tiktoken.registry.ENCODING_CONSTRUCTORS or {}
    found: list[tuple[bool, dict[str, Any]]] = []
    # The registry's own lock: get_encoding() in another thread cannot see the reader.
    with getattr(tiktoken.registry, "_lock", _REGISTRY_LOCK):
        real = tiktoken.load.read_file_cached
        urls: list[str] = []

        def read_file_cached(blobpath: str, expected_hash: str | None = None) -> bytes:
            if expected_hash != digest:
                raise _NotThisFile(blobpath)
            urls.append(blobpath)
            return data

        tiktoken.load.read_file_cached = read_file_cached  # type: ignore[assignment]
        try:
            for name in names:
                urls.clear()
                try:
                    spec = constructors[name]()
                except _NotThisFile:
                    continue
                except Exception as e:  # a plugin's constructor failing is not this file
                    log.debug("tiktoken encoding %s: %s", name, e)
                    continue
                named = any(u.rsplit("/", 1)[-1].split(".")[0] == name for u in urls)
                found.append((named, spec))
        finally:
            tiktoken.load.read_file_cached = real  # type: ignore[assignment]
    if not found:
        return None
    found.sort(key=lambda f: not f[0])  # stable: registry order among equals
    return tiktoken.Encoding(**found[0][1])


def vocab_from_tiktoken_file(path: Path, special_tokens: dict[str, int] | None = None) -> Vocab:
    import tiktoken

    if special_tokens is None:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise TokenizerLoadError(f"cannot read tiktoken file {path}: {e}") from e
        enc = registered_encoding(data)
        if enc is not None:
            v = vocab_from_tiktoken(enc)
            v.name = f"{path} ({enc.name})"
            return v
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
