"""`MLXBatch`: the `Batch` protocol on mlx-lm's `BatchGenerator` (continuous batching).

Sequences join and leave between steps, each with its own sampler (temp, top_p, top_k,
min_p, and its own random key when seeded) and logits processors (logit bias,
repetition penalty), as `BatchGenerator.insert` allows. Each token's logprob and the
top-k alternatives come from the graph of the sampler that picked it, scheduled in the
same async step (as in `mlx_steps`): the samplers are `_Recorder`s that note what they
computed, and `_TracedGenerationBatch` keeps those notes in the batch's row order as
rows join (`extend`) and leave (`filter`).

Finished or removed sequences leave their KV cache in an LRU prompt cache shared across
requests (mlx-lm's `LRUPromptCache`, as `mlx_lm.server` uses it); a new sequence starts
from the cached entry with the longest common prefix, and `cached_tokens(uid)` says how
many prompt tokens it reused. `prompt_cache_bytes` bounds it (0 switches it off).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..sampling import SamplingParams
from .base import Step
from .mlx_steps import read_rows

log = logging.getLogger(__name__)

__all__ = ["MLXBatch"]

#: `max_tokens=None` ("until EOS or the context is full") as a BatchGenerator limit.
_NO_LIMIT = 1 << 40
#: Entries the shared prompt cache keeps at most (mlx_lm.server's default).
PROMPT_CACHE_ENTRIES = 10
_KEY = "model"


class _Sink:
    """What the samplers of one batch computed since it was last read, in call order."""

    __slots__ = ("calls", "k")

    def __init__(self) -> None:
        self.calls: list[list[mx.array]] = []
        self.k = 0  # top-k to compute: the most any active sequence asked for

    def take(self) -> list[tuple[list[Any], int]]:
        """(record, row) for every row sampled since the last take, in row order."""
        rows = []
        for call in self.calls:
            record: list[Any] = [call, None]  # the arrays, then their values once read
            rows += [(record, i) for i in range(call[0].size)]
        self.calls = []
        return rows


class _Recorder:
    """A batch row's sampler: samples with `inner` (or its own key when seeded) and
    records the token's logprob and the top-k from the same logprobs."""

    __slots__ = ("inner", "key", "sink", "temp")

    def __init__(self, inner: Callable[[mx.array], mx.array], sink: _Sink) -> None:
        self.inner = inner
        self.sink = sink
        self.key: mx.array | None = None
        self.temp = 0.0

    def __call__(self, logprobs: mx.array) -> mx.array:
        from .mlx_engine import top_k_ids

        if self.key is None:
            token = self.inner(logprobs)
        else:  # a seeded sequence draws from its own key, whatever else is in the batch
            self.key, sub = mx.random.split(self.key)
            token = mx.random.categorical(self.inner(logprobs) * (1.0 / self.temp), key=sub)
        out = [token, mx.take_along_axis(logprobs, token.reshape(-1, 1), -1)]
        k = self.sink.k
        if k:
            ids = top_k_ids(logprobs, k)
            out += [ids, mx.take_along_axis(logprobs, ids, axis=-1)]
        mx.async_eval(*out)
        self.sink.calls.append(out)
        return token


def _filters(params: SamplingParams, vocab_size: int | None) -> Callable[[mx.array], mx.array]:
    """mlx-lm's top-p / min-p / top-k filters (as `make_sampler` chains them)."""
    top_k = params.top_k if vocab_size is None or params.top_k < vocab_size else 0

    def apply(x: mx.array) -> mx.array:
        if 0 < params.top_p < 1.0:
            x = apply_top_p(x, params.top_p)
        if params.min_p != 0.0:
            x = apply_min_p(x, params.min_p, 1)
        if top_k > 0:
            x = apply_top_k(x, top_k)
        return x

    return apply


class _TracedGenerationBatch(GenerationBatch):
    """mlx-lm's GenerationBatch, keeping each row's sampler record next to its token."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sink = _Sink()  # replaced by the owning MLXBatch's before any step
        self._tt_next: list[tuple[list[Any], int]] = []
        self._tt_current: list[tuple[list[Any], int]] = []
        self.reported: dict[int, tuple[list[Any], int]] = {}
        super().__init__(*args, **kwargs)

    def _step(self) -> Any:
        current = self._tt_next
        out = super()._step()
        self._tt_current = current
        self._tt_next = self.sink.take()
        return out

    def extend(self, batch: GenerationBatch) -> None:
        # `batch` was made (and took its first step) just now: the sink holds its rows.
        self._tt_next = [*self._tt_next, *self.sink.take()]
        super().extend(batch)

    def filter(self, keep: list[int]) -> None:
        self._tt_next = [self._tt_next[i] for i in keep]
        super().filter(keep)

    def next(self) -> list[Any]:
        uids = list(self.uids)
        responses = super().next()
        current = self._tt_current
        self.reported = {uid: current[i] for i, uid in enumerate(uids)}
        return responses


class MLXBatch:
    """A `tokentrail.engines.batch.Batch` on mlx-lm's `BatchGenerator`."""

    def __init__(
        self,
        model: Any,
        max_batch: int,
        prompt_cache_bytes: int | None = None,
        prefill_step_size: int = 2048,
        vocab_size: int | None = None,
    ) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        if prompt_cache_bytes is not None and (
            isinstance(prompt_cache_bytes, bool)
            or not isinstance(prompt_cache_bytes, int)
            or prompt_cache_bytes < 0
        ):
            raise ValueError(
                f"prompt_cache_bytes must be None or an int >= 0, got {prompt_cache_bytes!r}"
            )
        self.model = model
        self.max_batch = max_batch
        self.vocab_size = vocab_size
        self.sink = _Sink()
        self.gen = BatchGenerator(
            model,
            completion_batch_size=max_batch,
            prefill_batch_size=min(max_batch, 8),
            prefill_step_size=prefill_step_size,
        )
        traced = _TracedGenerationBatch.empty(model, self.gen.sampler)
        traced.sink = self.sink
        self.gen._generation_batch = traced
        self._traced = traced
        self.prompt_cache: LRUPromptCache | None = None
        if prompt_cache_bytes != 0:
            self.prompt_cache = LRUPromptCache(
                PROMPT_CACHE_ENTRIES,
                max_bytes=(1 << 62) if prompt_cache_bytes is None else prompt_cache_bytes,
            )
        self.prompt_cache_bytes = prompt_cache_bytes
        self._k: dict[int, int] = {}
        self._cached: dict[int, int] = {}
        self._shared: dict[tuple[Any, ...], _Recorder] = {}

    # -- the Batch protocol ------------------------------------------------------------

    def add(
        self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None
    ) -> int:
        """Queue a sequence (it joins at the next `step`); return its uid."""
        from .mlx_engine import sampling_for

        if len(self._k) >= self.max_batch:
            raise RuntimeError(f"the batch is full ({self.max_batch} sequences)")
        ids = [int(i) for i in prompt_ids]
        if not ids:
            raise ValueError("prompt_ids is empty; the model needs at least one token")
        cache, rest = self._fetch(ids)
        sampler, processors = sampling_for(params, self.vocab_size)
        (uid,) = self.gen.insert(
            [rest],
            max_tokens=[_NO_LIMIT if max_tokens is None else int(max_tokens)],
            caches=[cache],
            all_tokens=[ids[: len(ids) - len(rest)]],
            samplers=[self._recorder(params, sampler)],
            logits_processors=[processors],
        )
        self._k[uid] = params.top_logprobs
        self._cached[uid] = len(ids) - len(rest)
        self.sink.k = max(self._k.values())
        return uid

    def remove(self, uid: int) -> None:
        """Take a sequence out now (its KV cache goes to the prompt cache)."""
        if uid not in self._k:
            return
        caches = self.gen.remove([uid], return_prompt_caches=self.prompt_cache is not None)
        for cache, tokens in caches.values():
            self._store(tokens, cache)
        self._forget(uid)

    def step(self) -> list[tuple[int, Step]]:
        """One decoding step (and one prompt chunk for joining sequences)."""
        _, responses = self.gen.next()
        if not responses:
            return []
        reported = self._traced.reported
        out: list[tuple[int, Step]] = []
        for r in responses:
            record, row = reported[r.uid]
            if record[1] is None:
                record[1] = read_rows(record[0], len(record[0]) > 2)
            token, lp, top = record[1][row]
            if token != r.token:
                raise RuntimeError(
                    f"mlx-lm's BatchGenerator reported token {r.token} for sequence {r.uid} "
                    f"but its sampler produced {token}: rows are out of step"
                )
            k = self._k.get(r.uid, 0)
            out.append((r.uid, Step(token, lp, top[:k] if k else [], r.logprobs, False)))
            if r.finish_reason is not None:
                if r.prompt_cache is not None:
                    self._store(r.all_tokens, r.prompt_cache)
                self._forget(r.uid)
        return out

    def cached_tokens(self, uid: int) -> int:
        """How many of the sequence's prompt tokens came from the prompt cache."""
        return self._cached.get(uid, 0)

    def __len__(self) -> int:
        return len(self._k)

    def close(self) -> None:
        for uid in list(self._k):
            self.remove(uid)
        self.gen.close()

    # -- internals ---------------------------------------------------------------------

    def _recorder(self, params: SamplingParams, sampler: Any) -> _Recorder:
        if params.seed is not None and params.temp > 0:
            rec = _Recorder(_filters(params, self.vocab_size), self.sink)
            rec.key = mx.random.key(params.seed)
            rec.temp = params.temp
            return rec
        if params.temp == 0:
            key: tuple[Any, ...] = ("greedy",)
        else:
            key = (params.temp, params.top_p, params.min_p, params.top_k)
        # One object per setting: BatchGenerator samples rows that share it in one call.
        rec = self._shared.get(key)
        if rec is None:
            rec = self._shared[key] = _Recorder(sampler, self.sink)
        return rec

    def _forget(self, uid: int) -> None:
        self._k.pop(uid, None)
        self.sink.k = max(self._k.values(), default=0)

    def _fetch(self, ids: list[int]) -> tuple[list[Any] | None, list[int]]:
        """The cached KV of the longest cached prefix of `ids` and the tokens after it."""
        if self.prompt_cache is None:
            return None, ids
        cache, rest = self.prompt_cache.fetch_nearest_cache(_KEY, ids)
        if cache is not None and not rest:
            # The whole prompt is cached; the model must still read its last token.
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                rest = ids[-1:]
            else:
                cache, rest = None, ids
        return cache, list(rest)

    def _store(self, tokens: Sequence[int] | None, cache: list[Any] | None) -> None:
        if self.prompt_cache is None or not cache or not tokens:
            return
        self.prompt_cache.insert_cache(_KEY, list(tokens), cache)
        if self.prompt_cache_bytes is not None:
            room = self.prompt_cache_bytes - self.gen.prompt_cache_nbytes
            self.prompt_cache.trim_to(n_bytes=max(room, 0))
