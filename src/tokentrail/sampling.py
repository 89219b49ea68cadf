"""Sampling settings, checked once before any model work.

Every engine receives the same validated `SamplingParams`, so a bad value fails with
the same message whichever engine runs, and before a prompt is processed.

This module is the only place that decides what range a sampling setting may take:
`RANGES` lists each setting as a `Range` (name, kind, bounds), `make_params` applies it,
and an entry point that must be stricter passes a profile of its own bounds as
`limits=` (`OPENAI_LIMITS`: the OpenAI wire limits the server and `tokentrail serve`
apply). A value out of range is a `SamplingError` whose `param` names the setting.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from numbers import Integral, Real
from typing import TYPE_CHECKING, Any, Literal

from .errors import SamplingError, SamplingTypeError

if TYPE_CHECKING:
    from .constrain import Constraint

__all__ = [
    "LIBRARY_LIMITS",
    "LOGPROBS_MODES",
    "MAX_TOP_LOGPROBS",
    "OPENAI_LIMITS",
    "RANGES",
    "Range",
    "SamplingError",
    "SamplingParams",
    "SamplingTypeError",
    "check_max_tokens",
    "check_value",
    "for_choice",
    "is_int",
    "make_params",
]

#: The most alternatives a step may report (OpenAI's limit for `top_logprobs`).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each token, and how many alternatives to report per step.

    `temp == 0` means greedy decoding. `top_p == 1`, `top_k == 0` and `min_p == 0`
    switch those filters off. `logit_bias` maps token ids to additive biases.

    `constraint` (a bound `tokentrail.constrain.Constraint`) masks every step to the
    tokens its grammar allows. `logprobs_mode` says which distribution each step's
    logprob and top-k come from: "raw" (the model's, after logit bias and the repetition
    penalty, before the grammar mask, temperature and filters) or "processed" (the one
    the token was drawn from: after the mask, the filters and temperature).

    `logprobs` False says that no step's logprob is wanted (a request that asked for
    none and needs no confidence): an engine that pays for them per token, an upstream
    server, may then leave them out, and its steps carry NaN. Engines that have them for
    free report them anyway.
    """

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: Mapping[int, float] | None = None
    seed: int | None = None
    top_logprobs: int = 0
    constraint: Constraint | None = None
    #: OpenAI's penalties: each token already in the recent context has its logit lowered
    #: by `presence_penalty` once and by `frequency_penalty` per time it occurs there
    #: (0: off). The context is the engine's own: the last 20 tokens on MLX and torch
    #: (mlx-lm's, prompt included), the last 64 on llama.cpp (its ``repeat_last_n``,
    #: prompt included, as llama-server), every generated token on vLLM (its rule).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs_mode: Literal["raw", "processed"] = "raw"
    logprobs: bool = True
    #: The end-of-sequence tokens do not end the reply (vLLM's ``ignore_eos``): the
    #: shared loop does not stop on them, and an upstream is asked not to.
    ignore_eos: bool = False


#: The values `SamplingParams.logprobs_mode` takes: which distribution a step's `logprob`
#: and `top_logprobs` come from. "raw": the model's own before the grammar mask (vLLM's
#: default `raw_logprobs`); "processed": the one the token was drawn from.
LOGPROBS_MODES = ("raw", "processed")


@dataclass(frozen=True, slots=True)
class Range:
    """The accepted values of one setting: `kind` "int" or "real" (finite), between `lo`
    and `hi` (None: unbounded), `lo` itself excluded when `lo_open`. `note` says what
    the boundary value means (e.g. "0 means greedy")."""

    name: str
    kind: Literal["int", "real"]
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    note: str = ""

    def bounds(self) -> str:
        """The range in words: ">= 0", "in (0, 1]", "between 0 and 20"."""
        lo, hi = _shown(self.lo), _shown(self.hi)
        if self.lo is not None and self.hi is not None:
            if self.kind == "int":
                return f"between {lo} and {hi}"
            return f"in {'(' if self.lo_open else '['}{lo}, {hi}]"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {lo}"
        if self.hi is not None:
            return f"<= {hi}"
        return "any value"

    def check(self, value: Any, label: str | None = None) -> int | float:
        """`value` as an int or float; SamplingError (SamplingTypeError for a wrong type)
        naming `label` (default: the setting's name) and the range otherwise. The
        error's `param` is `label`: the name the caller's user knows the setting by."""
        label = label or self.name
        if self.kind == "int" and not is_int(value):
            raise SamplingTypeError(f"{label} must be an int, got {value!r}", label)
        if self.kind == "real" and not _is_real(value):
            raise SamplingTypeError(f"{label} must be a finite number, got {value!r}", label)
        too_low = self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo))
        if too_low or (self.hi is not None and value > self.hi):
            note = f" ({self.note})" if self.note else ""
            raise SamplingError(f"{label} must be {self.bounds()}{note}, got {value}", label)
        return int(value) if self.kind == "int" else float(value)


def _shown(bound: float | None) -> str:
    if bound is None:
        return ""
    return str(int(bound)) if bound == int(bound) else f"{bound:g}"


#: Every sampling setting's range, as the library accepts it. `logit_bias` is the range
#: of each bias value (its keys are token ids, bounded by the vocabulary).
RANGES: Mapping[str, Range] = {
    r.name: r
    for r in (
        Range("temp", "real", 0, note="0 means greedy"),
        Range("top_p", "real", 0, 1, lo_open=True),
        Range("top_k", "int", 0, note="0 means no top-k filter"),
        Range("min_p", "real", 0, 1),
        Range("repetition_penalty", "real", 0, lo_open=True),
        Range("presence_penalty", "real", -2, 2),
        Range("frequency_penalty", "real", -2, 2),
        Range("seed", "int", 0),
        Range("top_logprobs", "int", 0, MAX_TOP_LOGPROBS),
        Range("logit_bias", "real"),
    )
}

#: The library's profile: the table as it stands.
LIBRARY_LIMITS: Mapping[str, Range] = RANGES

#: OpenAI's wire limits, stricter than the library's: what the server accepts in a
#: request and `tokentrail serve --temp` on the command line.
OPENAI_LIMITS: Mapping[str, Range] = {
    **RANGES,
    "temp": replace(RANGES["temp"], hi=2),
    "repetition_penalty": replace(RANGES["repetition_penalty"], hi=100),
    "seed": replace(RANGES["seed"], hi=2**63 - 1),
    "logit_bias": replace(RANGES["logit_bias"], lo=-100, hi=100),
}


def is_int(value: Any) -> bool:
    """An integer that is not a bool (numpy ints included)."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def check_value(
    name: str, value: Any, limits: Mapping[str, Range] = LIBRARY_LIMITS, label: str | None = None
) -> int | float:
    """Check one setting against `limits` (e.g. a command-line flag, named by `label`)."""
    return limits[name].check(value, label)


def check_max_tokens(max_tokens: int | None) -> int | None:
    """Return the token limit, or None for "no limit" (given as None or -1)."""
    if max_tokens is None or (is_int(max_tokens) and max_tokens == -1):
        return None
    if not is_int(max_tokens):
        raise SamplingTypeError(
            f"max_tokens must be an int (or None / -1 for no limit), got {max_tokens!r}",
            "max_tokens",
        )
    if max_tokens < 1:
        raise SamplingError(
            f"max_tokens must be at least 1 (or None / -1 for no limit), got {max_tokens}",
            "max_tokens",
        )
    return int(max_tokens)


def _logit_bias(
    logit_bias: Any, vocab_size: int | None, limits: Mapping[str, Range], label: str
) -> dict[int, float] | None:
    if not logit_bias:
        return None
    if not isinstance(logit_bias, Mapping):
        raise SamplingTypeError(
            f"{label} must be a mapping of token id to bias, got {logit_bias!r}", label
        )
    bias: dict[int, float] = {}
    for key, value in logit_bias.items():
        try:
            tid = int(key)  # JSON object keys arrive as strings
        except (TypeError, ValueError):
            raise SamplingError(f"{label} key {key!r} is not a token id", label) from None
        if tid < 0 or (vocab_size is not None and tid >= vocab_size):
            limit = "" if vocab_size is None else f" (valid ids are 0..{vocab_size - 1})"
            raise SamplingError(f"{label} token id {tid} is outside the vocabulary{limit}", label)
        try:
            bias[tid] = float(limits["logit_bias"].check(value, f"{label} value for token {tid}"))
        except SamplingError as e:
            raise SamplingError(str(e), label) from None
    return bias


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
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    vocab_size: int | None = None,
    limits: Mapping[str, Range] = LIBRARY_LIMITS,
    labels: Mapping[str, str] | None = None,
    constraint: Constraint | None = None,
    logprobs_mode: str = "raw",
    logprobs: bool = True,
    ignore_eos: bool = False,
) -> SamplingParams:
    """Check every sampling setting against `limits` (default: `RANGES`, the library's)
    and return them as `SamplingParams`.

    Raises `SamplingError` (a ValueError; `SamplingTypeError`, also a TypeError, for a
    wrong type) naming the parameter and the accepted range. `vocab_size`, when known,
    bounds the ids in `logit_bias`. `labels` renames settings in errors (and their
    `param`) to the names the caller's users know, e.g. {"temp": "temperature"}.
    `constraint` (a bound `Constraint`), `logprobs_mode` ("raw" or "processed"),
    `logprobs` and `ignore_eos` are passed through; see `SamplingParams`.
    """
    names = labels or {}
    given = {"temp": temp, "top_p": top_p, "top_k": top_k, "min_p": min_p,
             "top_logprobs": top_logprobs, "repetition_penalty": repetition_penalty,
             "seed": seed, "presence_penalty": presence_penalty,
             "frequency_penalty": frequency_penalty}
    checked = {
        name: None if value is None and name in _OPTIONAL
        else check_value(name, value, limits, names.get(name))
        for name, value in given.items()
    }
    bias = _logit_bias(logit_bias, vocab_size, limits, names.get("logit_bias", "logit_bias"))
    mode_label = names.get("logprobs_mode", "logprobs_mode")
    if logprobs_mode not in LOGPROBS_MODES:
        raise SamplingError(
            f"{mode_label} must be 'raw' or 'processed', got {logprobs_mode!r}", mode_label
        )
    if constraint is not None and not callable(getattr(constraint, "guide", None)):
        raise SamplingTypeError(
            f"constraint must be a tokentrail.constrain.Constraint, got "
            f"{type(constraint).__name__}", "constraint",
        )
    return SamplingParams(  # type: ignore[arg-type]
        **checked, logit_bias=bias, constraint=constraint, logprobs_mode=logprobs_mode,
        logprobs=bool(logprobs), ignore_eos=bool(ignore_eos),
    )


#: Settings that may be None (off / unseeded).
_OPTIONAL = frozenset({"repetition_penalty", "seed"})


def for_choice(params: SamplingParams, choice: int) -> SamplingParams:
    """The settings of choice `choice` of `n`: with a seed, choice j uses `seed + j`, so
    the choices differ and each is reproducible."""
    if params.seed is None or choice == 0:
        return params
    return replace(params, seed=params.seed + choice)
