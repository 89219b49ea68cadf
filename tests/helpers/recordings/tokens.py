"""What the recordings need from a tokenizer, read straight from its files and library.

Token bytes come from the tokenizer files (the byte-level alphabet, SentencePiece
pieces), texts from the tokenizer libraries' own decode; tokentrail is not used, so the
recordings are ground truth for it. `gpt2_byte_alphabet` is shared with
tests/data/realign/llamacpp/record_llamacpp.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.helpers.env import CORPUS

TEXT = "Hi 🙂 你好, 世界! Crème brûlée… 🦙🇫🇷 ok"
PROMPT = "Say hello in three scripts:"
CREATED = 1_700_000_000
N_TOP = 3


# -- tokenizers, read straight from their files ----------------------------------------------


def gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable char -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return {c: b for b, c in chars.items()}


class Tok:
    """The few things a recording needs from a tokenizer, from the library itself."""

    def __init__(self, rel: str, corpus: Path = CORPUS) -> None:
        self.rel = rel
        path = corpus / "tokenizers" / rel
        if rel.endswith(".json"):
            from tokenizers import Tokenizer

            self.hf = Tokenizer.from_file(str(path))
            self.sp = None
            self.size = self.hf.get_vocab_size()
            added = self.hf.get_added_tokens_decoder()
            self.specials = {i for i, t in added.items() if t.special}
            self.added = {i: t.content for i, t in added.items()}
            self.eos = self.hf.token_to_id("<|endoftext|>")
            self._alphabet = gpt2_byte_alphabet()
        else:
            import sentencepiece as spm

            self.hf = None
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
            self.size = self.sp.get_piece_size()
            self.specials = {
                i for i in range(self.size) if self.sp.is_control(i) or self.sp.is_unknown(i)
            }
            self.eos = self.sp.eos_id()

    def encode(self, text: str) -> list[int]:
        if self.hf is not None:
            return list(self.hf.encode(text, add_special_tokens=False).ids)
        return list(self.sp.encode(text))

    def decode(self, ids: list[int]) -> str:
        """The library's decode, special tokens skipped (what servers stream)."""
        if self.hf is not None:
            return self.hf.decode(ids, skip_special_tokens=True)
        return self.sp.decode(ids)

    def decode_one(self, tid: int) -> str:
        """One token decoded alone, as servers that report per-token strings do."""
        if self.hf is not None:
            return self.hf.decode([tid], skip_special_tokens=False)
        return self.sp.decode([tid])

    def name(self, tid: int) -> str:
        return self.hf.id_to_token(tid) if self.hf is not None else self.sp.id_to_piece(tid)

    def piece(self, tid: int) -> bytes:
        """A token's raw bytes mid-text (a special token's are its name's)."""
        if self.hf is not None:
            if tid in self.added:  # added tokens are stored as plain text
                return self.added[tid].encode()
            return bytes(self._alphabet[c] for c in self.hf.id_to_token(tid))
        name = self.sp.id_to_piece(tid)
        if self.sp.is_byte(tid):
            return bytes([int(name[3:5], 16)])
        if tid in self.specials:
            return b""
        return name.replace("\u2581", " ").encode()

    def plain_alternatives(self, tid: int, k: int) -> list[int]:
        """Deterministic, distinct, non-special alternatives to `tid` at step `k`."""
        out = [tid]
        step = 0
        while len(out) < N_TOP:
            step += 1
            alt = (tid * (7 + 4 * step) + 131 * k + 17 * step) % self.size
            if alt not in out and alt not in self.specials:
                out.append(alt)
        return out


def logprob(k: int, rank: int = 0) -> float:
    """A deterministic logprob for step `k`'s candidate of rank `rank`."""
    base = -(0.015 + 1.6 * ((k * 37) % 19) / 19)
    return round(base - 1.25 * rank - 0.1 * rank * rank, 6)


def valid_prefix(data: bytes) -> bytes:
    """`data` without an incomplete character at its end (llama.cpp's validate_utf8)."""
    return data[: len(data) - incomplete_tail(data)]


def incomplete_tail(data: bytes) -> int:
    """Bytes of a character cut off at the end of `data`, by llama.cpp's validate_utf8:
    a lead byte among the last four with fewer bytes after it than it needs."""
    n = len(data)
    for i in range(1, min(4, n) + 1):
        c = data[n - i]
        if (c & 0xE0 == 0xC0 and i < 2) or (c & 0xF0 == 0xE0 and i < 3):
            return i
        if c & 0xF8 == 0xF0 and i < 4:
            return i
    return 0


def openai_token(piece: bytes) -> str:
    """OpenAI's token string: the text, or ``bytes:\\xNN..`` when not valid UTF-8."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def deltas(tok: Tok, ids: list[int]) -> list[str]:
    """Per token, the text that became final with it (vLLM's incremental detokenizer rule:
    a decode that ends in U+FFFD waits for more tokens)."""
    out = []
    prev = ""
    for k in range(len(ids)):
        full = tok.decode(ids[: k + 1])
        if full.endswith("\ufffd"):
            out.append("")
            continue
        out.append(full[len(prev) :])
        prev = full
    return out


def openai_envelope(obj: str, rid: str, model: str) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": CREATED, "model": model}

