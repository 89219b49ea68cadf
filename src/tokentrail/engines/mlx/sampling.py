"""Sampling on the MLX engine: mlx-lm's samplers, and the `Recorder` that wraps them so
each sampled token's logprob and top-k come out of the same lazy graph as the token.

A leaf module (in the spirit of `mlx_lm.sample_utils`): it imports only `mlx` and
tokentrail's `SamplingParams`, and is imported at the top of `mlx.engine`, `mlx.steps`
and `mlx.batch`. mlx-lm itself (which imports transformers) is imported only when a
sampler is made.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import mlx.core as mx

from ...sampling import SamplingParams

__all__ = ["Recorder", "Sink", "filters", "read_rows", "sampling_for", "top_k_ids"]

#: Block size of the two-stage top-k, and the vocabulary size from which it pays off
#: (below it one partition of the whole row takes fewer device ops).
_TOPK_BLOCK = 256
_TOPK_TWO_STAGE_FROM = 16384

Sampler = Callable[[mx.array], mx.array]
Processor = Callable[[mx.array, mx.array], mx.array]
#: One row as host values: (token, logprob, top-k (id, logprob) sorted best first).
Row = tuple[int, float, list[tuple[int, float]]]


def top_k_ids(x: mx.array, k: int, block: int = _TOPK_BLOCK) -> mx.array:
    """Ids of the `k` largest entries of each row of `x` (unordered), on the device.

    Two stages instead of one partition of the whole vocabulary, which on large
    vocabularies costs several times an argmax: take the max of each block of
    `block` entries, keep the `k` blocks with the largest maxima, and partition only
    their entries (plus the ragged tail). Every entry larger than the k-th largest
    value lies in one of those blocks, so the values found are exactly the top k.
    """
    rows, size = x.shape
    n_blocks = size // block
    if size < _TOPK_TWO_STAGE_FROM or n_blocks <= k:
        return mx.argpartition(x, kth=size - k, axis=-1)[:, size - k :]
    head = x if size % block == 0 else x[:, : n_blocks * block]
    blocked = head.reshape(rows, n_blocks, block)
    best = mx.argpartition(blocked.max(axis=-1), kth=n_blocks - k, axis=-1)[:, n_blocks - k :]
    cand = (best[:, :, None] * block + mx.arange(block, dtype=best.dtype)).reshape(rows, -1)
    if size % block:
        tail = mx.arange(n_blocks * block, size, dtype=cand.dtype)
        cand = mx.concatenate([cand, mx.broadcast_to(tail, (rows, tail.size))], axis=-1)
    n = cand.shape[-1]
    pick = mx.argpartition(mx.take_along_axis(x, cand, axis=-1), kth=n - k, axis=-1)[:, n - k :]
    return mx.take_along_axis(cand, pick, axis=-1)


def _top_k(params: SamplingParams, vocab_size: int | None) -> int:
    """`params.top_k`, or 0 (off) when it keeps the whole vocabulary anyway."""
    return params.top_k if vocab_size is None or params.top_k < vocab_size else 0


def sampling_for(
    params: SamplingParams, vocab_size: int | None
) -> tuple[Sampler, list[Processor]]:
    """mlx-lm's sampler and logits processors for `params` (as `mlx_lm.generate` makes
    them from its command-line flags)."""
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    top_k = _top_k(params, vocab_size)
    sampler = make_sampler(params.temp, params.top_p, params.min_p, 1, top_k=top_k)
    processors = make_logits_processors(
        params.logit_bias, params.repetition_penalty,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
    )  # fmt: skip
    return sampler, processors


def filters(params: SamplingParams, vocab_size: int | None) -> Sampler:
    """mlx-lm's top-p / min-p / top-k filters for `params`, chained as `make_sampler`
    chains them (without the final draw)."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    top_p, min_p, top_k = params.top_p, params.min_p, _top_k(params, vocab_size)

    def apply(x: mx.array) -> mx.array:
        if 0 < top_p < 1.0:
            x = apply_top_p(x, top_p)
        if min_p != 0.0:
            x = apply_min_p(x, min_p, 1)
        if top_k > 0:
            x = apply_top_k(x, top_k)
        return x

    return apply


class Sink:
    """What `Recorder`s computed, one entry per sampler call, in call order; `k` is the
    top-k they compute (0: none). Recorders sharing a sink share its `k`."""

    __slots__ = ("calls", "k")

    def __init__(self, k: int = 0) -> None:
        self.calls: deque[list[mx.array]] = deque()
        self.k = k


class Recorder:
    """A sampler wrapper: returns `sampler`'s tokens unchanged and records, from the same
    `logprobs`, the lazy arrays [token, token logprob, top-k ids, top-k logprobs] of each
    call (without the last two when `k == 0`) in its `sink`.

    `schedule=True` queues them with `mx.async_eval` inside the call, i.e. in the step
    that samples the token; the caller pops them from `calls` in call order. Without a
    `sink` the recorder has one of its own, computing the top `k`; with one, the sink's
    `k` applies. After `seed(seed, temp)` the recorder draws from a random key of its
    own (with `sampler` as the filters to apply first), so a seeded sequence's tokens do
    not depend on what else is sampled.
    """

    __slots__ = ("key", "sampler", "schedule", "sink", "temp")

    def __init__(
        self, sampler: Sampler, k: int = 0, schedule: bool = True, sink: Sink | None = None
    ) -> None:
        self.sampler = sampler
        self.schedule = schedule
        self.sink = Sink(k) if sink is None else sink
        self.key: mx.array | None = None
        self.temp = 0.0

    @property
    def calls(self) -> deque[list[mx.array]]:
        return self.sink.calls

    @property
    def k(self) -> int:
        return self.sink.k

    def seed(self, seed: int, temp: float) -> None:
        """Draw from a key of this recorder's own, at temperature `temp` (> 0)."""
        self.key = mx.random.key(seed)
        self.temp = temp

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self.key is None:
            token = self.sampler(logprobs)
        else:  # a seeded sequence draws from its own key, whatever else is in the batch
            self.key, sub = mx.random.split(self.key)
            token = mx.random.categorical(self.sampler(logprobs) * (1.0 / self.temp), key=sub)
        out = [token, mx.take_along_axis(logprobs, token.reshape(-1, 1), axis=-1)]
        k = self.sink.k
        if k:
            rows = logprobs if logprobs.ndim == 2 else logprobs.reshape(-1, logprobs.shape[-1])
            ids = top_k_ids(rows, k)
            out += [ids, mx.take_along_axis(rows, ids, axis=-1)]
        if self.schedule:
            mx.async_eval(*out)
        self.sink.calls.append(out)
        return token


def read_rows(arrays: list[mx.array], k: int | bool) -> list[Row]:
    """One recorded call as host values: (token, logprob, top-k sorted best first) per row.

    Reads the evaluated arrays as they are (a reshape here would be one more device op)."""
    token_arr, lp_arr = arrays[0], arrays[1]
    if token_arr.size == 1:
        tokens, lps = [token_arr.item()], [lp_arr.item()]
    else:
        tokens = token_arr.tolist()
        lps = [row[0] for row in lp_arr.tolist()]
    if not k:
        return [(t, lp, []) for t, lp in zip(tokens, lps, strict=True)]
    ids, vals = arrays[2].tolist(), arrays[3].tolist()
    out = []
    for t, lp, i, v in zip(tokens, lps, ids, vals, strict=True):
        top: list[tuple[int, float]] = list(zip(i, v, strict=True))
        top.sort(key=lambda pair: -pair[1])  # k <= 20: sorting here beats the device
        out.append((t, lp, top))
    return out
