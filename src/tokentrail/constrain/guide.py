"""One sequence's walk through a constraint's grammar: llguidance's `LLMatcher`.

An engine asks the `Guide` which ids may come next (`allowed`: a boolean mask as wide
as the model's logits), masks its logits with it, samples, and tells the guide the
token (`advance`). When the grammar is complete only end-of-sequence ids are allowed,
so the stream ends with EOS ("stop") where the caller watches for it.

A constraint that applies after the reasoning (`Constraint.after`: the reasoning's end
markers) starts inactive: `allowed` then allows every id and `active` is False (an
engine reports no allowed mass for such a step), and `advance` watches for the end
marker (`gate.ReasoningGate`); the grammar starts on the bytes after it, past leading
whitespace (see `gate`).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import llguidance as llg
import llguidance.numpy as llg_np
import numpy as np

from ..errors import ConstraintError, EngineError
from .compiler import TooComplex, one_line, parser_limits, reason_of
from .gate import WHITESPACE, ReasoningGate, blank_words, whitespace_ids


class BoundGrammar(Protocol):
    """What a guide needs of a constraint (`spec.Constraint` once bound)."""

    bound: bool
    tokenizer: Any
    grammar: str
    param: str
    after: tuple[str, ...]
    prototype: Any

__all__ = ["STEP_SECONDS", "Guide"]

#: Seconds one mask computation may take before its sequence is ended (llguidance's step
#: fuel, `compiler.LIMITS`, bounds the work; this bounds what a slow machine makes of it).
STEP_SECONDS = 2.0


class Guide:
    """llguidance's matcher for one sequence of a bound `Constraint`."""

    __slots__ = ("_bits", "_lead", "_open", "_taken", "constraint", "gate", "matcher", "size")

    def __init__(self, constraint: BoundGrammar) -> None:
        if not constraint.bound:
            raise ValueError(
                "the constraint is not bound to the model's tokenizer; use "
                "constraint.bind(tokenizer) (stream_generate does this)"
            )
        self.constraint = constraint
        prototype = getattr(constraint, "prototype", None)
        if prototype is not None:  # compiled when bound: a copy costs no compile
            self.matcher = prototype.deep_copy()
        else:
            self.matcher = llg.LLMatcher(
                constraint.tokenizer, constraint.grammar, log_level=0, limits=parser_limits()
            )
        if self.matcher.is_error():
            raise ConstraintError(
                f"{constraint.param}: {one_line(self.matcher.get_error())}", constraint.param
            )
        self.size = int(constraint.tokenizer.vocab_size)
        self._bits = llg_np.allocate_token_bitmask(1, self.size)
        after = getattr(constraint, "after", ())
        self.gate = ReasoningGate(after, constraint.tokenizer) if after else None
        self._open: np.ndarray | None = None
        self._lead = False  # after the reasoning, nothing taken yet: one blank token may come
        #: Per model token advanced past since the grammar started: how many tokens the
        #: matcher took for it (1, or 0 for a skipped leading blank), for `rollback`.
        self._taken: list[int] = []

    @property
    def active(self) -> bool:
        """Whether the grammar masks the next token (False while the model reasons)."""
        return self.gate is None

    def allowed(self, width: int) -> np.ndarray:
        """The ids the grammar allows next, as a bool array of `width` entries (ids past
        the tokenizer's vocabulary, e.g. padding rows of the embedding, are never
        allowed). Every id while the guide is not `active`."""
        if self.gate is not None:
            if self._open is None or self._open.size != width:
                self._open = np.ones(width, dtype=np.bool_)
            return self._open
        words = self.allowed_words()
        bits = np.unpackbits(
            words.view(np.uint8), count=min(width, self.size), bitorder="little"
        ).view(np.bool_)
        if width > bits.size:
            bits = np.concatenate([bits, np.zeros(width - bits.size, dtype=np.bool_)])
        return bits

    def allowed_words(self) -> np.ndarray:
        """What `allowed` says while `active`, packed as llguidance fills it: int32 words,
        bit `i % 32` of word `i // 32` for id `i` (an engine unpacks it on its device).
        The array is reused by the next call."""
        words = self._bits[0]
        tic = time.perf_counter()
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        spent = time.perf_counter() - tic
        self._raise_if_error()
        if spent > STEP_SECONDS:
            raise EngineError(
                f"{self.constraint.param}: too complex: one step's mask took {spent:.1f} s "
                f"(at most {STEP_SECONDS:g} s)", 500, "constraint_too_slow",
            )
        if self._lead:
            words |= blank_words(self.constraint.tokenizer)
        if not words.any():
            raise EngineError(
                f"{self.constraint.param}: the grammar allows no token here "
                f"({one_line(self.matcher.stop_reason())})", 500, "constraint_dead_end",
            )
        return words

    def advance(self, token: int) -> None:
        """Move past `token` (one the mask allowed)."""
        if self.gate is not None:
            tail = self.gate.feed(token)
            if tail is not None:
                self.gate = None
                self._begin(tail)
            return
        if self._lead:
            self._lead = False
            if whitespace_ids(self.constraint.tokenizer)[token]:
                # taken, or skipped
                self._taken.append(self.matcher.try_consume_tokens([int(token)]))
                return
        if not self.matcher.consume_token(int(token)):
            self._raise_if_error()
        self._taken.append(1)

    @property
    def rewindable(self) -> int:
        """How many of the last tokens `rollback` can take back: those advanced past
        since the grammar started (not the reasoning before it, nor the token that
        ended it)."""
        return len(self._taken)

    def rollback(self, n: int) -> None:
        """Take back the last `n` tokens `advance` moved past (field retry, issue #31):
        the matcher is then where it was before them, so the same mask comes again.
        ValueError when `n` reaches past `rewindable`."""
        if n < 0 or n > len(self._taken):
            raise ValueError(
                f"cannot roll the grammar back {n} tokens: {len(self._taken)} were taken "
                "since it started"
            )
        if n == 0:
            return
        undone = sum(self._taken[-n:])
        del self._taken[-n:]
        if undone and not self.matcher.rollback(undone):
            self._raise_if_error()

    def _begin(self, tail: bytes) -> None:
        """Start the grammar on `tail`, the content bytes of the token that ended the
        reasoning (leading whitespace the grammar does not take is skipped)."""
        lltok = self.constraint.tokenizer
        for data in (tail, tail.lstrip(WHITESPACE)):
            ids = lltok.tokenize_bytes(data) if data else []
            taken = self.matcher.try_consume_tokens(ids)
            if taken == len(ids):
                self._lead = not data
                return
            self.matcher.rollback(taken)
        self._raise_if_error()
        raise EngineError(
            f"{self.constraint.param}: the token that ended the reasoning goes on with "
            f"{tail!r}, which cannot start output the constraint allows",
            500,
            "constraint_dead_end",
        )

    @property
    def done(self) -> bool:
        """Whether the grammar is complete (only end-of-sequence ids are allowed)."""
        return bool(self.matcher.is_stopped())

    def _raise_if_error(self) -> None:
        if self.matcher.is_error() and reason_of(self.matcher.get_error()) == "too_complex":
            # a limit of the client's spec, hit mid-way: a 400 naming its field
            raise TooComplex(
                f"{self.constraint.param}: too complex: {one_line(self.matcher.get_error())}",
                self.constraint.param,
            )
        if self.matcher.is_error():
            raise EngineError(
                f"{self.constraint.param}: the grammar matcher failed: "
                f"{one_line(self.matcher.get_error())}", 500, "constraint_error",
            )
