"""`MLXBatch`: the `Batch` protocol on mlx-lm's `BatchGenerator` (continuous batching).

Sequences join and leave between steps, each with its own sampler (temp, top_p, top_k,
min_p, and its own random key when seeded) and logits processors (logit bias,
repetition penalty), as `BatchGenerator.insert` allows. Each token's logprob and the
top-k alternatives come from the graph of the sampler that picked it, scheduled in the
same async step (as in `mlx.steps`): the samplers are `mlx.sampling.Recorder`s that note
what they computed, and `_TracedGenerationBatch` keeps those notes in the batch's row order as
rows join (`extend`) and leave (`filter`).

Finished or removed sequences leave their KV cache in an LRU prompt cache shared across
requests (mlx-lm's `LRUPromptCache`, as `mlx_lm.server` uses it); a new sequence starts
from the cached entry with the longest common prefix, and `cached_tokens(uid)` says how
many prompt tokens it reused. `prompt_cache_bytes` bounds it (0 switches it off).

A joining sequence's first token is handed out by the `step` that samples it: mlx-lm
reports a step's tokens one `next` later (it schedules the following step first), which
for a newcomer would add a whole decoding step of the batch to its time to first token.
The same token is then skipped when mlx-lm reports it. `max_batch=None` opens the batch
at `BatchGenerator`'s own completion batch size (its capacity).

`before_compute` (None, or a callable) runs in each step once the step's graph is built,
just before the wait for it: on MLX's CPU backend `async_eval` of a whole forward pass
returns only when most of it has run, so work done there (the server hands the previous
step's events to its event loop) overlaps the model's compute instead of the next step's
graph building.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from ...sampling import SamplingParams
from ..base import Step
from ..batch import BaseBatch, check_prompt_cache_bytes
from ..config import PREFILL_STEP_SIZE
from .guided import GuidedRecorder, guided_recorder, read_masses, shown_top
from .sampling import Recorder, Sink, filters, read_rows, sampling_for

log = logging.getLogger(__name__)

__all__ = ["MLXBatch"]

#: `max_tokens=None` ("until EOS or the context is full") as a BatchGenerator limit.
_NO_LIMIT = 1 << 40
#: Entries the shared prompt cache keeps at most (mlx_lm.server's default).
PROMPT_CACHE_ENTRIES = 10
_KEY = "model"


def generator_default(name: str) -> int:
    """A size `BatchGenerator` picks when not told (`completion_batch_size`, ...)."""
    return int(inspect.signature(BatchGenerator).parameters[name].default)


def _take(sink: Sink) -> list[tuple[list[Any], int]]:
    """(record, row) for every row the batch's samplers sampled since the last take, in
    row order; a record is [the arrays, their values once read]."""
    rows = []
    for call in sink.calls:
        record: list[Any] = [call, None]
        rows += [(record, i) for i in range(call[0].size)]
    sink.calls.clear()
    return rows


class _TracedGenerationBatch(GenerationBatch):
    """mlx-lm's GenerationBatch, keeping each row's sampler record next to its token."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sink = Sink()  # replaced by the owning MLXBatch's before any step
        self._tt_next: list[tuple[list[Any], int]] = []
        self._tt_current: list[tuple[list[Any], int]] = []
        self.reported: dict[int, tuple[list[Any], int]] = {}
        super().__init__(*args, **kwargs)

    def _step(self) -> Any:
        # mlx-lm's private per-step hook: the only place that sees a step's samples
        # before `next` reports them (mlx-lm has no public one).
        current = self._tt_next
        out = super()._step()
        self._tt_current = current
        self._tt_next = _take(self.sink)
        return out

    def extend(self, batch: GenerationBatch) -> None:
        # `batch` was made (and took its first step) just now: the sink holds its rows.
        self._tt_next = [*self._tt_next, *_take(self.sink)]
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

    def sampled(self, skip: set[int]) -> list[tuple[int, tuple[list[Any], int], Any]]:
        """(uid, its (record, row), its logprobs row) for every row whose next token is
        sampled but not reported yet, except the uids in `skip`."""
        return [
            (uid, self._tt_next[i], self._next_logprobs[i])
            for i, uid in enumerate(self.uids)
            if uid not in skip
        ]


class _Announcing:
    """A sampler that first calls its batch's `before_compute` (when set), then samples
    with `sampler`: mlx-lm calls the samplers once the step's graph (the forward pass) is
    built and just before it is evaluated, so the hook's work runs while the model
    computes instead of before it."""

    __slots__ = ("batch", "sampler")

    def __init__(self, batch: MLXBatch, sampler: Any) -> None:
        self.batch = batch
        self.sampler = sampler

    def __call__(self, logprobs: Any) -> Any:
        hook = self.batch.before_compute
        if hook is not None:
            hook()
        return self.sampler(logprobs)


class MLXBatch(BaseBatch):
    """A `tokentrail.engines.batch.Batch` on mlx-lm's `BatchGenerator`."""

    def __init__(
        self,
        model: Any,
        max_batch: int | None = None,
        prompt_cache_bytes: int | None = None,
        prefill_step_size: int = PREFILL_STEP_SIZE,
        vocab_size: int | None = None,
    ) -> None:
        if max_batch is None:
            max_batch = generator_default("completion_batch_size")
        super().__init__(max_batch)
        check_prompt_cache_bytes(prompt_cache_bytes)
        self.model = model
        self.vocab_size = vocab_size
        self.sink = Sink()  # k: the most top-k any active sequence asked for
        self.gen = BatchGenerator(
            model,
            completion_batch_size=max_batch,
            prefill_batch_size=min(max_batch, generator_default("prefill_batch_size")),
            prefill_step_size=prefill_step_size,
        )
        traced = _TracedGenerationBatch.empty(model, self.gen.sampler)
        traced.sink = self.sink
        # mlx-lm takes no GenerationBatch subclass from its caller: set ours in its place.
        self.gen._generation_batch = traced
        self._traced = traced
        self.prompt_cache: LRUPromptCache | None = None
        if prompt_cache_bytes != 0:
            self.prompt_cache = LRUPromptCache(
                PROMPT_CACHE_ENTRIES,
                max_bytes=(1 << 62) if prompt_cache_bytes is None else prompt_cache_bytes,
            )
        self.prompt_cache_bytes = prompt_cache_bytes
        self._live: dict[int, int] = {}  # uid -> the top-k it asked for
        self._modes: dict[int, str] = {}  # uid -> its logprobs_mode
        self._cached: dict[int, int] = {}
        self._shared: dict[tuple[Any, ...], _Announcing] = {}
        #: Called in each decoding step once its graph is built, before the wait for it
        #: (the server hands the previous step's events to its event loop there).
        self.before_compute: Callable[[], None] | None = None
        #: uid -> its guided sampler (a constraint or processed logprobs): its failure
        #: takes that sequence out alone.
        self._guided: dict[int, GuidedRecorder] = {}
        self._started: set[int] = set()  # uids whose first token was handed out
        self._early: set[int] = set()  # ... by the step that sampled it (mlx-lm: not yet)

    # -- the Batch protocol ------------------------------------------------------------

    def add(self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None) -> int:
        """Queue a sequence (it joins at the next `step`); return its uid."""
        self._check_room()
        ids = [int(i) for i in prompt_ids]
        if not ids:
            raise ValueError("prompt_ids is empty; the model needs at least one token")
        cache, rest = self._fetch(ids)
        sampler, processors = sampling_for(params, self.vocab_size)
        recorder = self._recorder(params, sampler)
        (uid,) = self.gen.insert(
            [rest],
            max_tokens=[_NO_LIMIT if max_tokens is None else int(max_tokens)],
            caches=[cache],
            all_tokens=[ids[: len(ids) - len(rest)]],
            samplers=[recorder],
            logits_processors=[processors],
        )
        if isinstance(recorder.sampler, GuidedRecorder):
            self._guided[uid] = recorder.sampler
        self._live[uid] = params.top_logprobs
        self._modes[uid] = params.logprobs_mode
        self._cached[uid] = len(ids) - len(rest)
        self.sink.k = max(self._live.values())
        return uid

    def remove(self, uid: int) -> None:
        """Take a sequence out now (its KV cache goes to the prompt cache)."""
        if uid not in self._live:
            return
        caches = self.gen.remove([uid], return_prompt_caches=self.prompt_cache is not None)
        for cache, tokens in caches.values():
            self._store(tokens, cache)
        self._forget(uid)

    def step(self) -> list[tuple[int, Step | Exception]]:
        """One decoding step (and one prompt chunk for joining sequences); the first
        token of each sequence that started generating in it. A sequence whose grammar
        failed in it is `(uid, the exception)` and has left the batch; the others go on
        (its row was sampled unmasked, so mlx-lm's rows stay in step)."""
        _, responses = self.gen.next()
        reported = self._traced.reported
        failed = {uid: g.failure for uid, g in self._guided.items() if g.failure is not None}
        out: list[tuple[int, Step | Exception]] = []
        for r in responses:
            if r.uid in failed:
                if r.finish_reason is not None:  # mlx-lm has let it go already
                    self._forget(r.uid)
                continue
            step = self._row_step(r.uid, reported[r.uid], r.logprobs)
            if step.token != r.token:
                raise RuntimeError(
                    f"mlx-lm's BatchGenerator reported token {r.token} for sequence {r.uid} "
                    f"but its sampler produced {step.token}: rows are out of step"
                )
            if r.uid in self._early:
                self._early.discard(r.uid)  # handed out by the step that sampled it
            else:
                out.append((r.uid, step))
            self._started.add(r.uid)
            if r.finish_reason is not None:
                if r.prompt_cache is not None:
                    self._store(r.all_tokens, r.prompt_cache)
                self._forget(r.uid)
        for uid, where, logprobs in self._traced.sampled(self._started | failed.keys()):
            out.append((uid, self._row_step(uid, where, logprobs)))
            self._started.add(uid)
            self._early.add(uid)
        for uid, failure in failed.items():
            log.info("sequence %s left the batch: its constraint failed: %s", uid, failure)
            self.remove(uid)
            self._guided.pop(uid, None)
            out.append((uid, failure))
        return out

    def _row_step(self, uid: int, where: tuple[list[Any], int], logprobs: Any) -> Step:
        """The Step of one sampled row (its record read to host values once per call)."""
        record, row = where
        if record[1] is None:
            has_top = len(record[0]) >= 4  # [token, lp, (ids, vals), (allowed mass)]
            record[1] = list(
                zip(read_rows(record[0], has_top), read_masses(record[0], has_top), strict=True)
            )
        (token, lp, top), mass = record[1][row]
        k = self._live.get(uid, 0)
        dist = self._modes.get(uid, "raw")
        top = shown_top(top[:k], dist) if k else []
        return Step(token, lp, top, logprobs, False, dist, mass)

    def cached_tokens(self, uid: int) -> int:
        """How many of the sequence's prompt tokens came from the prompt cache."""
        return self._cached.get(uid, 0)

    def close(self) -> None:
        super().close()
        self.gen.close()

    # -- internals ---------------------------------------------------------------------

    def _recorder(self, params: SamplingParams, sampler: Any) -> _Announcing:
        guided = guided_recorder(params, self.vocab_size, sink=self.sink, isolate=True)
        if guided is not None:  # its own grammar state: one recorder per row
            return _Announcing(self, guided)
        if params.seed is not None and params.temp > 0:
            rec = Recorder(filters(params, self.vocab_size), sink=self.sink)
            rec.seed(params.seed, params.temp)
            return _Announcing(self, rec)
        if params.temp == 0:
            key: tuple[Any, ...] = ("greedy",)
        else:
            key = (params.temp, params.top_p, params.min_p, params.top_k)
        # One object per setting: BatchGenerator samples rows that share it in one call.
        rec = self._shared.get(key)
        if rec is None:
            rec = self._shared[key] = _Announcing(self, Recorder(sampler, sink=self.sink))
        return rec

    def _forget(self, uid: int) -> None:
        self._live.pop(uid, None)
        self._guided.pop(uid, None)
        self._modes.pop(uid, None)
        self._started.discard(uid)
        self._early.discard(uid)
        self.sink.k = max(self._live.values(), default=0)

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
