"""One sequence's walk through a constraint's grammar: llguidance's `LLMatcher`.

An engine asks the `Guide` which ids may come next (`allowed`: a boolean mask as wide
as the model's logits), masks its logits with it, samples, and tells the guide the
token (`advance`). When the grammar is complete only end-of-sequence ids are allowed,
so the stream ends with EOS ("stop") where the caller watches for it.
"""

from __future__ import annotations

from typing import Any, Protocol

import llguidance as llg
import llguidance.numpy as llg_np
import numpy as np

from ..errors import EngineError


class BoundGrammar(Protocol):
    """What a guide needs of a constraint (`spec.Constraint` once bound)."""

    bound: bool
    tokenizer: Any
    grammar: str
    param: str

__all__ = ["Guide"]


class Guide:
    """llguidance's matcher for one sequence of a bound `Constraint`."""

    __slots__ = ("_bits", "constraint", "matcher", "size")

    def __init__(self, constraint: BoundGrammar) -> None:
        if not constraint.bound:
            raise ValueError(
                "the constraint is not bound to the model's tokenizer; use "
                "constraint.bind(tokenizer) (stream_generate does this)"
            )
        self.constraint = constraint
        self.matcher = llg.LLMatcher(constraint.tokenizer, constraint.grammar, log_level=0)
        if self.matcher.is_error():
            raise EngineError(f"{constraint.param}: {self.matcher.get_error()}", 400,
                              "invalid_constraint")
        self.size = int(constraint.tokenizer.vocab_size)
        self._bits = llg_np.allocate_token_bitmask(1, self.size)

    def allowed(self, width: int) -> np.ndarray:
        """The ids the grammar allows next, as a bool array of `width` entries (ids past
        the tokenizer's vocabulary, e.g. padding rows of the embedding, are never
        allowed)."""
        llg_np.fill_next_token_bitmask(self.matcher, self._bits)
        self._raise_if_error()
        bits = np.unpackbits(self._bits.view(np.uint8), count=min(width, self.size),
                             bitorder="little").view(np.bool_)
        if width > bits.size:
            bits = np.concatenate([bits, np.zeros(width - bits.size, dtype=np.bool_)])
        if not bits.any():
            raise EngineError(
                f"{self.constraint.param}: the grammar allows no token here "
                f"({self.matcher.stop_reason()})", 500, "constraint_dead_end",
            )
        return bits

    def advance(self, token: int) -> None:
        """Move past `token` (one the mask allowed)."""
        if not self.matcher.consume_token(int(token)):
            self._raise_if_error()

    @property
    def done(self) -> bool:
        """Whether the grammar is complete (only end-of-sequence ids are allowed)."""
        return bool(self.matcher.is_stopped())

    def _raise_if_error(self) -> None:
        if self.matcher.is_error():
            raise EngineError(
                f"{self.constraint.param}: the grammar matcher failed: "
                f"{self.matcher.get_error()}", 500, "constraint_error",
            )
