"""The engine protocol: the one thing `stream_generate` needs from a model runtime.

An engine turns prompt ids into a stream of `Step`s: the sampled token, its logprob,
the top-k alternatives and the full logprob vector, computed on the engine's device.
Everything above it (alignment, stop strings, responses) is shared by all engines.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..sampling import SamplingParams


@dataclass(slots=True)
class Step:
    """One generated token.

    `logprob` is log p(token) under the engine's distribution for this step (after
    logits processors such as repetition penalty and logit bias, before temperature
    and the top-p/top-k/min-p filters, as in mlx-lm). `top_logprobs` holds the k most
    likely (id, logprob) pairs, most likely first. `logprobs` is the full vector in the
    engine's native array type.
    """

    token: int
    logprob: float
    top_logprobs: list[tuple[int, float]]
    logprobs: Any


@runtime_checkable
class Engine(Protocol):
    """A model runtime that generates tokens.

    `vocab_size` is the number of ids the model can read and emit (None if unknown);
    `context_length` is the longest sequence it supports (None if unknown).
    """

    name: str
    vocab_size: int | None
    context_length: int | None

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None
    ) -> Iterator[Step]:
        """Yield one Step per generated token: exactly `max_tokens` of them (None:
        without end) unless the consumer stops first. The caller, not the engine,
        watches for EOS and stop strings.

        Closing the iterator stops generation: no model step is started after that.
        """
        ...

    def peak_memory(self) -> float:
        """Peak device memory in use so far, in GB (0.0 if the engine cannot tell)."""
        ...
