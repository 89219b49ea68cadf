"""Constrained decoding and processed logprobs on the MLX engine: `GuidedRecorder`.

A `Recorder` (see `mlx.sampling`) that, before drawing, masks the step's logprobs to the
ids a `tokentrail.constrain.Guide` allows, and records next to the token the
probability mass the model put on those ids. It draws the token itself, as mlx-lm's
`make_sampler` does (argmax at temperature 0; else top-p, min-p, top-k, then
`mx.random.categorical(x / temp)`), so with nothing masked it picks what mlx-lm would.

It works unchanged in `mlx.steps` (mlx-lm's `generate_step`) and, one recorder per
row, in `mlx.batch` (mlx-lm's `BatchGenerator`, which calls a row's own sampler on its
row). Each call first schedules the step's logits (`mx.async_eval`), then reads the
previous token (the one the guide must advance past), so llguidance computes the mask
on the host while the device runs the forward pass.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import mlx.core as mx

from ...sampling import SamplingParams
from .sampling import Recorder, Sink, filters, top_k_ids

__all__ = ["GuidedRecorder", "guided_recorder", "read_masses", "shown_top"]


class GuidedRecorder(Recorder):
    """A `Recorder` that applies `guide`'s mask (None: no constraint) and reports the
    logprobs of `distribution` ("raw": the logprobs it is given; "processed": the
    distribution the token is drawn from). Recorded per call: [token, logprob, (top-k
    ids, top-k logprobs when k), (allowed mass when guided)]."""

    __slots__ = ("cache", "distribution", "failure", "filters", "guide", "isolate", "last")

    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int | None,
        guide: Any = None,
        k: int = 0,
        schedule: bool = True,
        sink: Sink | None = None,
        isolate: bool = False,
    ) -> None:
        self.filters = filters(params, vocab_size)
        super().__init__(self.filters, k, schedule, sink)
        self.temp = params.temp
        self.guide = guide
        self.distribution = params.logprobs_mode
        self.last: mx.array | None = None
        #: The exception the guide raised (None: none). The row is then sampled unmasked
        #: so that mlx-lm's batch stays in step; its batch takes it out and reports this.
        self.failure: Exception | None = None
        #: Whether a guide's failure is kept in `failure` (a batch row: the batch takes the
        #: row out) rather than raised (one sequence: its generation ends with it).
        self.isolate = isolate
        self.cache: dict[tuple[int, bool], Any] = {}  # (top-k, masked) -> compiled step

    def __call__(self, logprobs: mx.array) -> mx.array:
        args = [logprobs]
        guided = False
        if self.guide is not None and self.failure is None:
            mx.async_eval(logprobs)  # the forward pass runs while llguidance works
            try:
                if self.last is not None:
                    self.guide.advance(self.last.item())
                # While the model reasons (a constraint that starts after it) nothing is
                # masked, and the step records no allowed mass.
                guided = self.guide.active
                if guided:
                    args.append(mx.array(self.guide.allowed(logprobs.shape[-1])))
            except Exception as e:  # this row's grammar failed: never the whole batch
                if not self.isolate:
                    raise
                self.failure = e
                guided = False
                del args[1:]
        if self.key is not None:  # a seeded sequence draws from its own key
            self.key, sub = mx.random.split(self.key)
            args.append(sub)
        out = self._compiled(self.sink.k, guided)(*args)
        token = out[0]
        self.last = token
        if self.schedule:
            mx.async_eval(*out)
        self.sink.calls.append(out)
        return token

    def _compiled(self, k: int, guided: bool) -> Any:
        fn = self.cache.get((k, guided))
        if fn is None:
            core = functools.partial(
                _core,
                temp=self.temp,
                k=k,
                filters=self.filters,
                guided=guided,
                keyed=self.key is not None,
                processed=self.distribution == "processed",
            )
            # One compiled graph per step (as mlx-lm compiles its samplers): the random
            # state goes in and out for unseeded draws.
            fn = self.cache[k, guided] = mx.compile(
                core, inputs=mx.random.state, outputs=mx.random.state
            )
        return fn


def _core(
    *args: mx.array,
    temp: float,
    k: int,
    filters: Any,
    guided: bool,
    keyed: bool,
    processed: bool,
) -> list[mx.array]:
    """[token, logprob, (top-k ids, top-k logprobs), (log allowed mass)] of one step from
    args [logprobs, (allowed), (key)]."""
    logprobs = args[0]
    masked = logprobs
    if guided:
        kept = mx.where(args[1], logprobs, -mx.inf)
        log_mass = mx.logsumexp(kept, axis=-1, keepdims=True)
        masked = kept - log_mass
    if temp == 0:
        drawn = masked
        token = mx.argmax(masked, axis=-1)
    else:
        drawn = filters(masked) * (1.0 / temp)
        token = mx.random.categorical(drawn, key=args[-1] if keyed else None)
        if processed:
            drawn = drawn - mx.logsumexp(drawn, axis=-1, keepdims=True)
    source = drawn if processed else logprobs
    rows = source if source.ndim == 2 else source.reshape(-1, source.shape[-1])
    out = [token, mx.take_along_axis(rows, token.reshape(-1, 1), axis=-1)]
    if k:
        ids = top_k_ids(rows, k)
        out += [ids, mx.take_along_axis(rows, ids, axis=-1)]
    if guided:
        out.append(log_mass)
    return out


def guided_recorder(
    params: SamplingParams,
    vocab_size: int | None,
    k: int = 0,
    schedule: bool = True,
    sink: Sink | None = None,
    isolate: bool = False,
) -> GuidedRecorder | None:
    """A `GuidedRecorder` for one sequence when `params` needs one (a constraint, or
    processed logprobs), else None; its guide is a fresh matcher of the constraint.
    `isolate`: a batch row (see `GuidedRecorder.isolate`)."""
    if params.constraint is None and params.logprobs_mode == "raw":
        return None
    guide = None if params.constraint is None else params.constraint.guide()
    rec = GuidedRecorder(params, vocab_size, guide, k, schedule, sink, isolate)
    if params.seed is not None and params.temp > 0:
        rec.seed(params.seed, params.temp)
    return rec


def read_masses(arrays: list[mx.array], k: int | bool) -> list[float | None]:
    """The allowed mass of each row of one recorded call (None per row when unguided);
    the call holds its log."""
    rows = arrays[0].size
    if len(arrays) != (4 if k else 2) + 1:
        return [None] * rows
    values = arrays[-1].tolist()
    flat: list[Any] = values if isinstance(values, list) else [values]
    return [math.exp(v[0] if isinstance(v, list) else v) for v in flat]


def shown_top(top: list[tuple[int, float]], distribution: str) -> list[tuple[int, float]]:
    """The top-k as reported: under the processed distribution, ids it rules out (-inf:
    masked or filtered) are not alternatives, so they are left out."""
    if distribution == "raw":
        return top
    return [(i, lp) for i, lp in top if lp > -math.inf]
