"""The compiled form of a tokenizer, and the rules every format shares.

A `Vocab` is what streaming needs: id -> bytes, plus the few decode rules that are not
plain byte concatenation. The aligner never calls a tokenizer library while streaming;
it only reads a `Vocab`. One module per source format (beside this one) builds it.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..errors import TokenizerLoadError

#: How invalid UTF-8 turns into U+FFFD, which differs between tokenizer libraries.
#: - "stream": the whole byte stream is decoded with maximal-subpart replacement
#:   (Python's and Rust's lossy UTF-8 decode); used by byte-level BPE and tiktoken.
#: - "hf_runs": a run of consecutive byte-fallback tokens decodes to its text when the
#:   whole run is valid UTF-8, else every token of the run becomes one U+FFFD
#:   (tokenizers' ByteFallback decoder).
#: - "spm_runs": a run of byte pieces is decoded character by character, every invalid
#:   byte becoming one U+FFFD (sentencepiece's decoder).
ByteMode = Literal["stream", "hf_runs", "spm_runs"]

#: transformers' `clean_up_tokenization_spaces` replacements, applied in this order.
CLEANUP_RULES: tuple[tuple[str, str], ...] = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def cleanup(text: str) -> str:
    """transformers' `clean_up_tokenization_spaces`: `CLEANUP_RULES` in order."""
    for old, new in CLEANUP_RULES:
        if old in text:
            text = text.replace(old, new)
    return text


def wordpiece_cleanup(text: str) -> str:
    """tokenizers' WordPiece decoder clean-up (one more rule than transformers')."""
    for old, new in (*CLEANUP_RULES[:7], (" do not", " don't"), *CLEANUP_RULES[7:]):
        text = text.replace(old, new)
    return text


def byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet: one printable character stands for each byte.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are mapped, in
    byte order, to the code points from U+0100 upwards.
    """
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    keep_set = set(keep)
    out = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep_set:
            out[chr(0x100 + extra)] = b
            extra += 1
    return out




REFERENCES = ("auto", "llama.cpp", "transformers")


def check_reference(reference: str, fmt: str, where: object, allowed: tuple[str, ...]) -> None:
    """Raise a ValueError when `reference` does not apply to this tokenizer format.

    `allowed` lists the references besides "auto" that the format has: "llama.cpp" only
    for GGUF files, "transformers" for GGUF files and Hugging Face tokenizers (whose
    "auto" reference is transformers' decode already).
    """
    if reference not in REFERENCES:
        raise ValueError(
            f"reference must be one of {', '.join(map(repr, REFERENCES))}, got {reference!r}"
        )
    if reference != "auto" and reference not in allowed:
        choices = ", ".join(repr(r) for r in ("auto", *allowed))
        raise ValueError(
            f"reference={reference!r} does not apply to {where} ({fmt}); "
            f"this format's references are {choices}"
        )


def read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        out = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerLoadError(f"cannot read {path}: {e}") from e
    return out if isinstance(out, dict) else None


BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


#: GGUF / sentencepiece token types (ModelProto.SentencePiece.Type numbering).
class PieceType(enum.IntEnum):
    """SentencePiece's piece types (ModelProto.SentencePiece.Type), also GGUF's
    `tokenizer.ggml.token_type` values."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_UNUSED, TYPE_BYTE = PieceType


def special_names(tokens: list[str | None], special: Iterable[int]) -> dict[int, str]:
    """The written names of the special ids among `tokens` (ids with no string skipped)."""
    special = frozenset(special)
    return {i: t for i, t in enumerate(tokens) if t is not None and i in special}


@dataclass(eq=False)
class Vocab:
    """Everything the aligner needs to know about a tokenizer's decode.

    `pieces[id]` is the bytes a token contributes; `first_pieces[id]`, when present,
    replaces it for the first token that is not skipped (SentencePiece's dummy-prefix
    space, Metaspace, WordPiece). `special` ids vanish with skip_special_tokens; `hidden`
    ids always decode to nothing (sentencepiece control pieces). `byte_ids` are byte
    fallback tokens, whose runs follow `byte_mode`. `strip_leading` spaces are removed
    from the start of the text (tokenizers' Strip decoder after Fuse; a first piece
    already lacks the ones it would lose, see `hf_json`) and `cleanup`
    applies transformers' clean-up of spaces before punctuation.
    """

    pieces: list[bytes | None]
    name: str = "tokenizer"
    special: frozenset[int] = frozenset()
    hidden: frozenset[int] = frozenset()
    byte_ids: frozenset[int] = frozenset()
    byte_mode: ByteMode = "stream"
    first_pieces: dict[int, bytes] = field(default_factory=dict)
    strip_leading: int = 0
    #: What the decoder does to each byte-fallback run's text after decoding it, when
    #: the run reaches later steps as a string of its own (tokenizers' ByteFallback with
    #: no Fuse after it, as ChatGLM3's ByteFallback then Metaspace): string replacements
    #: (old, new, new when the run is the decode's first string), in order, applied to
    #: a valid run's text and to each U+FFFD of an invalid one.
    run_edits: tuple[tuple[str, str, str], ...] = ()
    cleanup: bool = False
    #: Whether a skipped token ends a byte-fallback run (true for sentencepiece, whose
    #: control pieces stay in the decode loop; false for tokenizers, which drops them).
    skipped_breaks_runs: bool = False
    #: Whether `first_pieces` applies to every token until one adds bytes (sentencepiece
    #: strips the dummy prefix while its output is still empty) rather than only to the
    #: first token that is not skipped (tokenizers' Metaspace).
    first_until_text: bool = False
    #: Display names (token strings) for tokens whose bytes are empty, such as `<s>`.
    names: dict[int, str] = field(default_factory=dict)
    #: The tokenizer library's own decode: (ids, skip_special_tokens) -> str.
    oracle: Callable[[Sequence[int], bool], str] | None = None
    #: The tokenizer object the vocab was built from, if any (kept for encode()).
    source: object = None
    #: Set for decoder pipelines that are not per-token plus known rules: the aligner
    #: then re-decodes (slower, still exact on the final text) with this function.
    generic: Callable[[Sequence[int], bool], str] | None = None

    def __post_init__(self) -> None:
        self.size = len(self.pieces)
        #: Each token's text when its bytes are complete UTF-8 on their own, else None
        #: (the aligner's fast path; byte tokens and partial characters take the slow one).
        self.texts: list[str | None] = []
        for b in self.pieces:
            if b is None:
                self.texts.append(None)
                continue
            try:
                self.texts.append(b.decode("utf-8"))
            except UnicodeDecodeError:
                self.texts.append(None)

    def has_id(self, token_id: int) -> bool:
        """Whether the int `token_id` is a token of this vocabulary (in range, with a
        piece: ids a model has but its tokenizer lacks are not)."""
        return 0 <= token_id < self.size and self.pieces[token_id] is not None

    def check_id(self, token_id: int) -> None:
        """Raise a ValueError naming the problem when `token_id` is not in the vocabulary."""
        if type(token_id) is not int:
            try:
                token_id = int(token_id)  # numpy / mlx scalars
            except (TypeError, ValueError):
                raise TypeError(
                    f"token id must be an int, got {type(token_id).__name__}: {token_id!r}"
                ) from None
        if not self.has_id(token_id):
            raise ValueError(
                f"token id {token_id} is outside the vocabulary of {self.name} "
                f"(valid ids are 0..{self.size - 1})"
            )

    def edit_run(self, text: str, first: bool) -> str:
        """A byte-fallback run's decoded string as the decoder's later steps leave it
        (`run_edits`); `first`: it is the first string of the decode."""
        for old, new, new_first in self.run_edits:
            text = text.replace(old, new_first if first else new)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of a token as it appears mid-text."""
        self.check_id(token_id)
        return self.pieces[token_id] or b""

    def token_text(self, token_id: int) -> str:
        """Readable form of one token: its bytes decoded, or its name if it has none."""
        b = self.token_bytes(token_id)
        if not b or token_id in self.hidden:
            return self.names.get(token_id, b.decode("utf-8", "replace"))
        return b.decode("utf-8", "replace")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids for `text` through the source tokenizer.

        Without `add_special_tokens` no special token is added; with it, the ones the
        tokenizer adds by default (a tokenizer.json's post-processor, a transformers
        tokenizer's BOS, a GGUF file's `add_bos_token`; a sentencepiece model, tiktoken
        ranks and Tekken add none)."""
        src = self.source
        mod = type(src).__module__
        add = bool(add_special_tokens)
        if src is None:
            raise RuntimeError(f"{self.name} has no tokenizer to encode with")
        if mod.startswith("tokenizers"):
            return list(src.encode(text, add_special_tokens=add).ids)
        if mod.startswith("sentencepiece"):
            return list(src.encode(text))
        if mod.startswith("tiktoken"):
            return list(src.encode(text, disallowed_special=()))
        if mod.startswith("mistral_common"):
            return list(src.encode(text, bos=False, eos=False))
        if hasattr(src, "encode"):
            try:
                return list(src.encode(text, add_special_tokens=add))
            except TypeError:
                return list(src.encode(text))
        raise RuntimeError(f"{self.name}: cannot encode with {type(src).__name__}")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Reference decode through the tokenizer's own library."""
        if self.oracle is None:
            raise RuntimeError(f"{self.name} has no reference decoder")
        return self.oracle(list(ids), skip_special_tokens)
