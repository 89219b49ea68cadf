"""llama.cpp sampling and logprobs, shared by the llamacpp engine and its batch.

`make_sampler` builds llama.cpp's sampler chain (`llama_sampler_*`) in llama-cpp-python's
order; `step_logprobs` reads a step's logprob and top-k from a numpy view over llama.cpp's
logits buffer without copying it; `LazyLogprobs` is the full vector, computed on demand.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ...sampling import SamplingParams

#: How many recent tokens the repeat penalty looks at (llama.cpp's `repeat_last_n`,
#: `penalty_last_n` in its sampler API).
REPEAT_LAST_N = 64
#: The old name of `REPEAT_LAST_N`, kept importable.
REPETITION_CONTEXT_SIZE = REPEAT_LAST_N
#: Block size of the blockwise top-k search over the logits.
_TOPK_BLOCK = 256
_DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a random seed

__all__ = ["REPEAT_LAST_N", "LazyLogprobs", "make_sampler", "penalizes", "step_logprobs"]


def make_sampler(
    params: SamplingParams, prompt: Sequence[int], n_vocab: int, guided: Any = None
) -> Any:
    """llama.cpp's sampler chain for `params`, in llama-cpp-python's order; the prompt's
    last tokens are accepted into it when a penalty is on (as llama-server).

    `guided` (a `llamacpp.guided.GuidedChain`) adds its grammar mask after the penalty
    (where llama.cpp puts its own grammar sampler) and its recorder before the draw."""
    # llama-cpp-python's own wrapper of a `llama_sampler_chain` (it keeps the custom
    # samplers' callbacks alive); it has no public home, only `llama_cpp._internals`.
    from llama_cpp._internals import LlamaSampler

    chain = LlamaSampler()
    if params.logit_bias:
        chain.add_logit_bias(n_vocab, dict(params.logit_bias))
    penalty = params.repetition_penalty
    penalized = penalizes(params)
    if penalized:
        chain.add_penalties(
            n_vocab, REPEAT_LAST_N, penalty or 1.0, params.frequency_penalty,
            params.presence_penalty,
        )  # fmt: skip
    if guided is not None and guided.guide is not None:
        chain.add_custom(guided.mask)
    if params.temp == 0:
        if guided is not None and guided.wants_record:
            chain.add_custom(guided.record)
        chain.add_greedy()
    else:
        if params.top_k > 0:
            chain.add_top_k(params.top_k)
        if params.top_p < 1.0:
            chain.add_top_p(params.top_p, 1)
        if params.min_p > 0.0:
            chain.add_min_p(params.min_p, 1)
        chain.add_temp(params.temp)
        if guided is not None and guided.wants_record:
            chain.add_custom(guided.record)
        chain.add_dist(_DEFAULT_SEED if params.seed is None else params.seed & 0xFFFFFFFF)
    if penalized:
        for t in prompt[-REPEAT_LAST_N:]:
            chain.accept(t)  # the prompt counts towards the penalties (llama-server)
    return chain


def penalizes(params: SamplingParams) -> bool:
    """Whether `params` has llama.cpp's penalties sampler work to do (a repeat, frequency
    or presence penalty)."""
    repeat = params.repetition_penalty
    return (repeat is not None and repeat != 1.0) or bool(
        params.frequency_penalty or params.presence_penalty
    )


def step_logprobs(
    x: np.ndarray,
    token: int,
    k: int,
    bias: Mapping[int, float] | None,
    window: Iterable[int],
    penalty: float | None,
    scratch: np.ndarray,
    presence: float = 0.0,
    frequency: float = 0.0,
) -> tuple[float, list[tuple[int, float]], float, dict[int, float]]:
    """The logprob of `token`, the top-k (id, logprob), the log-normalizer and the ids whose
    logits bias or penalties changed (with their new logits), from logits `x` (a view).

    The penalties are llama.cpp's (its penalties sampler, after the bias): for each id in
    `window` (the last ``REPEAT_LAST_N`` tokens), the repeat `penalty` (sign-aware), then
    `frequency` per time it occurs there and `presence` once. One pass over `x` into
    `scratch` (preallocated, vocabulary-sized) for the normalizer, a blockwise max to find
    the top-k, exact corrections for the changed ids.
    """
    n = x.shape[0]
    affected: dict[int, float] = {}
    if bias:
        for i, b in bias.items():
            affected[i] = float(x[i]) + b
    repeat = penalty is not None and penalty != 1.0
    if repeat or presence or frequency:
        for i, count in Counter(window).items():
            v = affected.get(i, float(x[i]))
            if repeat:
                v = v * penalty if v <= 0 else v / penalty  # type: ignore[operator]
            affected[i] = v - (count * frequency + presence)
    n_blocks = n // _TOPK_BLOCK
    want = k + len(affected)
    if n_blocks > want:
        head = x[: n_blocks * _TOPK_BLOCK].reshape(n_blocks, _TOPK_BLOCK)
        block_max = head.max(axis=1)
        m = float(block_max.max())
        if n_blocks * _TOPK_BLOCK < n:
            m = max(m, float(x[n_blocks * _TOPK_BLOCK :].max()))
    else:
        block_max = None
        m = float(x.max())
    if affected:
        m = max(m, *affected.values())
    np.subtract(x, np.float32(m), out=scratch)
    np.exp(scratch, out=scratch)
    total = float(scratch.sum(dtype=np.float64))
    for i, v in affected.items():
        total += math.exp(v - m) - math.exp(float(x[i]) - m)
    lse = m + math.log(total)
    value = affected.get(token)
    lp = (float(x[token]) if value is None else value) - lse
    top: list[tuple[int, float]] = []
    if k:
        if block_max is not None:
            best = np.argpartition(block_max, n_blocks - want)[n_blocks - want :]
            cand = (best[:, None] * _TOPK_BLOCK + np.arange(_TOPK_BLOCK)).ravel()
            if n_blocks * _TOPK_BLOCK < n:
                cand = np.concatenate([cand, np.arange(n_blocks * _TOPK_BLOCK, n)])
        else:
            cand = np.arange(n)
        vals = x[cand]
        if len(cand) > want:
            pick = np.argpartition(vals, len(cand) - want)[len(cand) - want :]
            cand, vals = cand[pick], vals[pick]
        scored = {int(i): float(v) for i, v in zip(cand.tolist(), vals.tolist(), strict=True)}
        scored.update(affected)
        best_k = sorted(scored.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
        top = [(i, v - lse) for i, v in best_k]
    return lp, top, lse, affected


class LazyLogprobs:
    """The full logprob vector of one step, computed only when asked for.

    llama.cpp overwrites its logits buffer at the next decode, so the vector can be read
    (``np.asarray(step.logprobs)``) until the generator advances; after that it raises.
    """

    __slots__ = ("_affected", "_decodes", "_logits", "_lse", "_owner")

    def __init__(
        self, owner: Any, logits: np.ndarray, lse: float, affected: dict[int, float]
    ) -> None:
        self._owner = owner  # the engine or batch; its `decodes` counts decodes
        self._decodes = owner.decodes
        self._logits = logits
        self._lse = lse
        self._affected = affected

    @property
    def shape(self) -> tuple[int]:
        return (self._logits.shape[0],)

    def __len__(self) -> int:
        return self._logits.shape[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if self._owner.decodes != self._decodes:
            raise RuntimeError(
                "this step's logprobs are gone: llama.cpp reuses its logits buffer at the "
                "next step; read np.asarray(response.logprobs) before advancing the stream"
            )
        out = self._logits.astype(np.float32) - np.float32(self._lse)
        for i, v in self._affected.items():
            out[i] = v - self._lse
        return out if dtype is None else out.astype(dtype)

    def tolist(self) -> list[float]:
        return self.__array__().tolist()
