"""A choice that runs beside the batch rather than in it: field retry's sequences.

Field retry (the request's ``retry`` option, `output.retry.FieldRetry`) takes tokens back, which
a batch's rows cannot do; such a choice runs on the engine's rewindable steps
(`engines.base.RewindableSteps`) instead, on the model thread, one model step per pass
of the scheduler's loop, between the batch's steps. Its records reach the client as a
batch row's do (`Scheduler` posts them), except that a held leaf's records come
together once the leaf is decided.
"""

from __future__ import annotations

from typing import Any

from ..batch import sequence_state
from ..engines.base import rewinder
from ..output.processor import OutputProcessor
from ..output.record import TokenOutput
from ..output.retry import FieldRetry, RetryPolicy
from ..sampling import for_choice

__all__ = ["Solo", "open_solo"]


class Solo:
    """One choice on rewindable steps: `advance` runs one model step and returns the
    records released with it (none while a leaf is held)."""

    __slots__ = ("_ticks", "retry", "steps")

    def __init__(self, steps: Any, retry: FieldRetry) -> None:
        self.steps = steps
        self.retry = retry
        self._ticks = retry.ticks()

    def advance(self) -> list[TokenOutput]:
        released = next(self._ticks, None)
        if released is None:
            raise RuntimeError("the engine stopped before EOS or the token limit")
        return [out for out, _ in released]

    def close(self) -> None:
        self._ticks.close()
        self.steps.close()


def open_solo(
    engine: Any,
    tokenizer: Any,
    ready: Any,
    choice: int,
    stop: Any,
    eos: frozenset[int],
    calibration: Any = None,
    *,
    skip_special_tokens: bool = True,
) -> Solo:
    """Choice `choice` of a prepared request (`server.prepare.Prepared` with `retry`)
    on the engine's rewindable steps."""
    options = dict(ready.outputs[choice])
    options.setdefault("output_ids", [])  # one list, read by the scorer across rebuilds

    def make_processor() -> OutputProcessor:
        state = sequence_state(engine, tokenizer, ready.ids, ready.limit, stop, eos,
                               skip_special_tokens)  # fmt: skip
        return OutputProcessor(state, calibration=calibration, **options)

    asked = ready.retry
    policy = RetryPolicy(asked.below, asked.max, asked.temperature)
    steps = rewinder(engine)(ready.ids, for_choice(ready.params, choice), ready.limit)
    return Solo(steps, FieldRetry(steps, make_processor, policy))
