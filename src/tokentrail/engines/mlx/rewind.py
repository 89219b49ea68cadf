"""A step stream on the MLX engine that can take tokens back: `MLXRewindable`.

Field retry (issue #31, `output.retry`) samples a JSON leaf again from its first
token. mlx-lm's `generate_step` runs one step ahead (the next token is scheduled
before the current one is yielded) and owns its cache, so it cannot go back; this
stream runs the same model one token at a time on a prompt cache of its own
(`mlx_lm.models.cache.make_prompt_cache`) and goes back with mlx-lm's
`trim_prompt_cache`. Each draw goes through a `mlx.guided.GuidedRecorder`, so the
mask, the recorded logprob, top-k and allowed mass are those of the plain path, and
its guide rolls back with the cache (`constrain.guide.Guide.rollback`).

State after the k-th yielded token y_k: the cache holds the prompt and y_0 .. y_(k-1),
y_k is pending (fed by the next step), and the guide has advanced past y_(k-1) (the
recorder advances it past y_k when it is next called).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from ...sampling import SamplingParams
from ..base import Step
from .guided import GuidedRecorder, read_masses, shown_top
from .sampling import read_rows

__all__ = ["MLXRewindable"]

Processor = Callable[[mx.array, mx.array], mx.array]


class MLXRewindable:
    """`engines.base.RewindableSteps` on an mlx-lm model: `Step`s one token at a time,
    with `rewind(n)`, `force(ids)` and a settable `temperature`.

    `processors` are mlx-lm logits processors (repetition penalty, logit bias), given
    the ids so far as mlx-lm gives them. Generation (the prefill) starts on the first
    `next()`; at most `max_tokens` tokens stand at once (None: no limit).
    """

    def __init__(
        self,
        model: Any,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        vocab_size: int | None,
        max_tokens: int | None,
        processors: Sequence[Processor] = (),
        prefill_step_size: int = 2048,
    ) -> None:
        if not prompt_ids:
            raise ValueError("prompt_ids is empty; the model needs at least one token")
        guide = None if params.constraint is None else params.constraint.guide()
        self.model = model
        self.rec = GuidedRecorder(params, vocab_size, guide, params.top_logprobs, False)
        if params.seed is not None:  # its own key, at every temperature a retry draws at
            self.rec.key = mx.random.key(params.seed)
        self.k = params.top_logprobs
        self.ids = list(prompt_ids)  # the prompt, then every token standing
        self.n_prompt = len(self.ids)
        self.limit = max_tokens
        self.processors = list(processors)
        self.prefill_step_size = prefill_step_size
        self.cache: list[Any] | None = None
        self._graphs: dict[float, dict[Any, Any]] = {params.temp: self.rec.cache}
        self.base_temperature = params.temp

    @property
    def generated(self) -> int:
        """How many generated tokens stand now."""
        return len(self.ids) - self.n_prompt

    @property
    def temperature(self) -> float:
        return self.rec.temp

    @temperature.setter
    def temperature(self, value: float | None) -> None:
        """Draw at `value` from the next token on (None: the request's own)."""
        temp = self.base_temperature if value is None else float(value)
        self.rec.temp = temp
        self.rec.cache = self._graphs.setdefault(temp, {})  # one compiled graph per temp

    def __iter__(self) -> MLXRewindable:
        return self

    def _start(self) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.cache = make_prompt_cache(self.model)
        head = self.ids[:-1]
        for i in range(0, len(head), self.prefill_step_size):
            self.model(mx.array(head[i : i + self.prefill_step_size])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])

    def __next__(self) -> Step:
        if self.limit is not None and self.generated >= self.limit:
            raise StopIteration
        if self.cache is None:
            self._start()
        logits = self.model(mx.array(self.ids[-1:])[None], cache=self.cache)[:, -1, :]
        if self.processors:
            history = mx.array(self.ids)
            for proc in self.processors:
                logits = proc(history, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        self.rec(logprobs)
        call = self.rec.calls.popleft()
        mx.eval(*call)
        ((token, lp, top),) = read_rows(call, self.k)
        (mass,) = read_masses(call, self.k)
        self.ids.append(int(token))
        dist = self.rec.distribution
        return Step(int(token), lp, shown_top(top, dist), logprobs[0], False, dist, mass)

    def rewind(self, n: int) -> None:
        """Take back the last `n` generated tokens: the cache, the guide and the ids are
        as they were before them, and the next step samples position `generated - n`.
        ValueError, with nothing changed, when they cannot all be taken back."""
        from mlx_lm.models.cache import trim_prompt_cache

        if n < 0 or n > self.generated:
            raise ValueError(f"cannot rewind {n} tokens: {self.generated} were generated")
        if n == 0:
            return
        # The newest token is pending (fed by the next step, advanced past by the
        # recorder's next call): the cache gives back n tokens (the pending one is
        # not in it, the one before the rewound ones becomes pending again), the guide
        # as many, except the first generated token's (never advanced past).
        k = self.generated - 1
        guide = self.rec.guide
        if guide is not None and min(n, k) > guide.rewindable:
            raise ValueError(f"cannot rewind {n} tokens: the grammar started after them")
        if self.cache is not None and trim_prompt_cache(self.cache, n) != n:
            raise RuntimeError("the model's cache could not be trimmed")
        if guide is not None:
            guide.rollback(min(n, k))
        del self.ids[-n:]
        self.rec.last = mx.array(self.ids[-1]) if n <= k else None

    def force(self, ids: Sequence[int]) -> None:
        """Append `ids` as if they had been sampled (no steps are yielded): the cache
        and the guide move past them in one forward pass."""
        ids = [int(i) for i in ids]
        if not ids:
            return
        if self.cache is None:
            self._start()
        guide = self.rec.guide
        if guide is not None:
            if self.rec.last is not None:
                guide.advance(int(self.rec.last.item()))
            for i in ids[:-1]:
                guide.advance(i)
        feed = [self.ids[-1], *ids[:-1]]
        self.model(mx.array(feed)[None], cache=self.cache)
        mx.eval([c.state for c in self.cache])
        self.ids += ids
        self.rec.last = mx.array(ids[-1])

    def close(self) -> None:
        """Nothing more is computed; the cache is let go."""
        self.cache = None
        self.limit = 0
