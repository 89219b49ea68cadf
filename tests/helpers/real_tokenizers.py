"""A real tokenizer for the structure tests: its own library encodes, and an `Aligner`
over the same files streams the ids back into segments."""

from __future__ import annotations

from collections.abc import Callable

from tests.helpers.env import REPO
from tokentrail import Aligner, Segment

DEMO = REPO / "src" / "tokentrail" / "demo_model"


class Tok:
    """A real tokenizer: `encode` (its own library) and an `Aligner` over the same files."""

    def __init__(self, encode: Callable[[str], list[int]], source: str) -> None:
        self.encode = encode
        self.aligner = Aligner(source)

    def segments(self, text: str, logprobs: bool = False) -> list[Segment]:
        """`text` encoded and streamed through the aligner one token at a time (with a
        made-up logprob per token when `logprobs`)."""
        a = self.aligner.fresh()
        out: list[Segment] = []
        for n, i in enumerate(self.encode(text)):
            out += a.push(i, -0.01 * (n % 7) if logprobs else None)
        return out + a.finish()

    def piece(self, token_id: int) -> bytes:
        return self.aligner.vocab.pieces[token_id] or b""
