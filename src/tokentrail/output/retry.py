"""Field retry (issue #31): a JSON leaf whose confidence is below a threshold is
sampled again from its first token, and the most confident attempt is kept.

`FieldRetry` sits between an engine's `engines.base.RewindableSteps` and the sequence's
`OutputProcessor`, on the thread that feeds the processor. Records stream through
as they are made, except from the token where a leaf value begins
(`OutputProcessor.open_field`) until that leaf is complete: those are held back. When
the leaf completes, its confidence (`confidence.calibrated` where present, else
`probability`) decides:

- at or above `below`: the held records are released;
- below it: the engine takes back the tokens from the leaf's first one
  (`rewind`: KV cache and grammar state), the processor is rebuilt over the tokens
  that stand (a fresh one, fed again: its stages hold no engine state), and the leaf is
  sampled again at `temperature`, until an attempt reaches `below` or `max` more
  attempts were made. The most confident attempt is kept: when it is not the last,
  the engine takes the last one back and is forced through the kept one's tokens, so
  its cache and grammar state are exactly the kept attempt's. Only the kept attempt's
  records are released, so text is emitted once and never changes, and the tokens
  and logprobs reported are the kept attempt's own.

The kept field carries `attempts` (`structure.fields.FieldAttempt`, in order). A leaf
is not retried where going back would take back text already released or a token of
an earlier decided leaf (a leaf beginning in the token that ended the one before it).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

from ..engines.base import RewindableSteps, Step
from ..errors import TokentrailError
from ..structure.fields import FieldAttempt, JsonField
from .processor import OutputProcessor
from .record import TokenOutput

log = logging.getLogger(__name__)

__all__ = ["FieldRetry", "RetryPolicy", "field_score", "retry_policy"]

#: The most extra attempts a leaf may take (each samples the leaf afresh).
MAX_ATTEMPTS = 8

Held = tuple[TokenOutput, Any]  # a record and its step's full logprob vector


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retry a leaf whose confidence is below `below`, up to `max` more times, drawing
    the new attempts at `temperature`."""

    below: float
    max: int = 2
    temperature: float = 1.0


def retry_policy(value: Any) -> RetryPolicy:
    """`value` (a `RetryPolicy` or a mapping with `below`, `max`, `temperature`) checked;
    ValueError naming the key that is out of range."""
    if isinstance(value, RetryPolicy):
        below, most, temp = value.below, value.max, value.temperature
    elif isinstance(value, dict):
        unknown = sorted(set(value) - {"below", "max", "temperature"})
        if unknown:
            raise ValueError(f"retry takes below, max and temperature, not {', '.join(unknown)}")
        if "below" not in value:
            raise ValueError("retry needs below: the confidence under which a leaf is retried")
        below, most, temp = value["below"], value.get("max", 2), value.get("temperature", 1.0)
    else:
        raise TypeError(f"retry must be a RetryPolicy or a dict, got {type(value).__name__}")
    if isinstance(below, bool) or not isinstance(below, int | float) or not 0 <= below <= 1:
        raise ValueError(f"retry.below must be a probability in [0, 1], got {below!r}")
    if isinstance(most, bool) or not isinstance(most, int) or not 1 <= most <= MAX_ATTEMPTS:
        raise ValueError(f"retry.max must be an int in [1, {MAX_ATTEMPTS}], got {most!r}")
    if isinstance(temp, bool) or not isinstance(temp, int | float) or not 0 <= temp <= 2:
        raise ValueError(f"retry.temperature must be in [0, 2], got {temp!r}")
    return RetryPolicy(float(below), most, float(temp))


def field_score(field: JsonField | None) -> float:
    """What retry compares: the field's calibrated confidence where present, else its
    probability; -inf for no field (an attempt that did not complete the leaf)."""
    conf = None if field is None else field.confidence
    if conf is None:
        return -math.inf
    return conf.calibrated if conf.calibrated is not None else conf.probability


@dataclass(slots=True)
class _Attempt:
    field: JsonField | None
    held: list[Held]
    steps: list[Step]


class FieldRetry:
    """One sequence's records with field retry (see the module).

    `steps`: the engine's rewindable stream; `make_processor`: a fresh
    `OutputProcessor` for the sequence (the same keywords each time; its `output_ids`
    list is the one a scorer reads, emptied before each rebuild). Iterate for
    (record, full logprob vector) pairs in emission order.
    """

    def __init__(
        self,
        steps: RewindableSteps,
        make_processor: Callable[[], OutputProcessor],
        policy: RetryPolicy,
    ) -> None:
        self.steps = steps
        self.make_processor = make_processor
        self.policy = policy
        self.processor = make_processor()
        self.history: list[Step] = []  # the steps standing, in order
        self.held: list[Held] = []
        self.decided_to = -1  # the last token of the last leaf decided
        self.attempts: dict[str, tuple[FieldAttempt, ...]] = {}  # by path
        #: Tokens computed and taken back (the retries' cost).
        self.discarded = 0

    @property
    def done(self) -> bool:
        return self.processor.done

    def _feed(self, step: Step) -> TokenOutput:
        out = self.processor.feed(step)
        self.history.append(step)
        return out

    def __iter__(self) -> Iterator[Held]:
        for event in self._events():
            if event is not None:
                yield event

    def ticks(self) -> Iterator[list[Held]]:
        """One list per engine step: the records released with it (often none while a
        leaf is held, several when one is decided). The server's scheduler steps a
        retried sequence this way, one model step per pass of its loop."""
        released: list[Held] = []
        for event in self._events():
            if event is None:
                yield released
                released = []
            else:
                released.append(event)
        if released:
            yield released

    def _events(self) -> Iterator[Held | None]:
        """Records in emission order, and None after each engine step."""
        for step in self.steps:
            out = self._feed(step)
            if not self.held and not (self.processor.open_field or out.fields):
                yield out, step.logprobs
                yield None
                if self.processor.done:
                    return
                continue
            self.held.append((out, step.logprobs))
            leaf = self._leaf_in(out)
            if leaf is not None:
                yield from self._decide(leaf)
            if leaf is not None or self.processor.done or not self.processor.open_field:
                yield from self._release()
            yield None
            if self.processor.done:
                return
        yield from self._release(everything=True)

    def _leaf_in(self, out: TokenOutput, start: int | None = None) -> JsonField | None:
        """The leaf `out` completed that began at or after `start` (default: the first
        held record), if any."""
        first = self.held[0][0].index if start is None else start
        for f in out.fields or ():
            if f.tokens and f.tokens[0].index >= first:
                return f
        return None

    def _release(self, everything: bool = False) -> Iterator[Held]:
        """The held records, except the last when a new leaf began in it."""
        keep = 0 if everything or self.processor.done or not self.processor.open_field else 1
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        yield from out

    # long: one decision, the retries' loop and the restore of the kept attempt read as one.
    def _decide(self, leaf: JsonField) -> Iterator[None]:
        """Retry `leaf` if it is below the threshold and can be retried; leave the kept
        attempt's records in `held` and its state in the engine and the processor."""
        start = leaf.tokens[0].index
        last = self.held[-1][0].index
        policy = self.policy
        if field_score(leaf) >= policy.below or start <= self.decided_to:
            self.decided_to = last
            return
        at = next(i for i, (o, _) in enumerate(self.held) if o.index == start)
        prefix = self.held[:at]
        tries = [_Attempt(leaf, self.held[at:], self.history[start:])]
        best = 0
        for _ in range(policy.max):
            try:
                self._back_to(start)
            except ValueError as e:  # e.g. the grammar started inside the leaf's token
                if len(tries) > 1:  # it went back there before: the engine is broken
                    raise
                log.debug("field %s not retried: %s", leaf.path, e)
                self.decided_to = last
                return
            self.steps.temperature = policy.temperature
            try:
                field, held = yield from self._attempt(start, leaf.path)
            finally:
                self.steps.temperature = None
            tries.append(_Attempt(field, held, self.history[start:]))
            if field_score(field) > field_score(tries[best].field):
                best = len(tries) - 1
            if field is None or field_score(field) >= policy.below:
                break
        kept = tries[best]
        if best != len(tries) - 1:  # the engine and processor go back to the kept one
            self._back_to(start)
            self.steps.force([s.token for s in kept.steps])
            self.history += kept.steps
            self._rebuild()
        assert kept.field is not None  # the first attempt always completed the leaf
        found = tuple(
            FieldAttempt(t.field.value, t.field.text, t.field.confidence, i == best)
            for i, t in enumerate(tries)
            if t.field is not None
        )
        self.attempts[kept.field.path] = found
        kept.field.attempts = found
        self._reattach()
        self.held = prefix + kept.held
        self.decided_to = self.held[-1][0].index
        log.debug("field %s: %d attempts, kept %d", kept.field.path, len(found), best)

    def _attempt(
        self, start: int, path: str
    ) -> Generator[None, None, tuple[JsonField | None, list[Held]]]:
        """Generate from token `start` until a leaf beginning there completes (None
        when the sequence ends first, or the leaf is not at `path`)."""
        held: list[Held] = []
        for step in self.steps:
            out = self._feed(step)
            held.append((out, step.logprobs))
            yield None
            leaf = self._leaf_in(out, start)
            if leaf is not None:
                return (leaf if leaf.path == path else None), held
            if self.processor.done:
                break
        return None, held

    def _back_to(self, start: int) -> None:
        """Take back every token from `start` on, in the engine and the processor (a
        ValueError from the engine changes nothing)."""
        n = len(self.history) - start
        self.steps.rewind(n)
        self.discarded += n
        del self.history[start:]
        self._rebuild()

    def _rebuild(self) -> None:
        """A fresh processor fed the steps standing (its records were emitted or are
        held already); the attempts found so far put back on its fields."""
        ids = self.processor.output_ids
        del ids[:]
        proc = self.make_processor()
        if proc.output_ids is not ids:
            raise TokentrailError("make_processor must reuse the sequence's output_ids list")
        for step in self.history:
            proc.feed(step)
        self.processor = proc
        self._reattach()

    def _reattach(self) -> None:
        stream = self.processor.fields
        if stream is None:
            return
        for f in stream.fields:
            found = self.attempts.get(f.path)
            if found is not None:
                f.attempts = found
