"""Sampling settings, checked once before any model work.

Every engine receives the same validated `SamplingParams`, so a bad value fails with
the same message whichever engine runs, and before a prompt is processed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

#: The most alternatives a step may report (OpenAI's limit for `top_logprobs`).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each token, and how many alternatives to report per step.

    `temp == 0` means greedy decoding. `top_p == 1`, `top_k == 0` and `min_p == 0`
    switch those filters off. `logit_bias` maps token ids to additive biases.
    """

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: Mapping[int, float] | None = None
    seed: int | None = None
    top_logprobs: int = 0


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def check_max_tokens(max_tokens: int | None) -> int | None:
    """Return the token limit, or None for "no limit" (given as None or -1)."""
    if max_tokens is None or (_is_int(max_tokens) and max_tokens == -1):
        return None
    if not _is_int(max_tokens):
        raise TypeError(
            f"max_tokens must be an int (or None / -1 for no limit), got {max_tokens!r}"
        )
    if max_tokens < 1:
        raise ValueError(
            f"max_tokens must be at least 1 (or None / -1 for no limit), got {max_tokens}"
        )
    return int(max_tokens)


def make_params(
    *,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float | None = None,
    logit_bias: Mapping[int, float] | None = None,
    seed: int | None = None,
    top_logprobs: int = 0,
    vocab_size: int | None = None,
) -> SamplingParams:
    """Check every sampling setting and return them as `SamplingParams`.

    Raises ValueError (or TypeError for a wrong type) naming the parameter and the
    accepted range. `vocab_size`, when known, bounds the ids in `logit_bias`.
    """
    if not _is_real(temp):
        raise TypeError(f"temp must be a finite number, got {temp!r}")
    if temp < 0:
        raise ValueError(f"temp must be >= 0 (0 means greedy), got {temp}")
    if not _is_real(top_p):
        raise TypeError(f"top_p must be a finite number, got {top_p!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not _is_int(top_k):
        raise TypeError(f"top_k must be an int, got {top_k!r}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 means no top-k filter), got {top_k}")
    if not _is_real(min_p):
        raise TypeError(f"min_p must be a finite number, got {min_p!r}")
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    if repetition_penalty is not None:
        if not _is_real(repetition_penalty):
            raise TypeError(
                f"repetition_penalty must be a finite number or None, got {repetition_penalty!r}"
            )
        if repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    if seed is not None and not _is_int(seed):
        raise TypeError(f"seed must be an int or None, got {seed!r}")
    if seed is not None and seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if not _is_int(top_logprobs):
        raise TypeError(f"top_logprobs must be an int, got {top_logprobs!r}")
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(
            f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top_logprobs}"
        )
    bias: dict[int, float] | None = None
    if logit_bias:
        if not isinstance(logit_bias, Mapping):
            raise TypeError(f"logit_bias must be a mapping of token id to bias, got {logit_bias!r}")
        bias = {}
        for key, value in logit_bias.items():
            try:
                tid = int(key)  # JSON object keys arrive as strings
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias key {key!r} is not a token id") from None
            if tid < 0 or (vocab_size is not None and tid >= vocab_size):
                limit = "" if vocab_size is None else f" (valid ids are 0..{vocab_size - 1})"
                raise ValueError(f"logit_bias token id {tid} is outside the vocabulary{limit}")
            if not _is_real(value):
                raise ValueError(f"logit_bias value for token {tid} must be a finite number")
            bias[tid] = float(value)
    return SamplingParams(
        temp=float(temp),
        top_p=float(top_p),
        top_k=int(top_k),
        min_p=float(min_p),
        repetition_penalty=None if repetition_penalty is None else float(repetition_penalty),
        logit_bias=bias,
        seed=None if seed is None else int(seed),
        top_logprobs=int(top_logprobs),
    )
