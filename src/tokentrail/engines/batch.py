"""Batches: several sequences decoded together, joining and leaving between steps.

An engine that batches natively (mlx-lm's `BatchGenerator`, vLLM, llama.cpp's parallel
sequences) implements `open_batch(max_batch, **options) -> Batch`. `open_batch(engine, n)` returns
that, or a `SerialBatch` for engines that only generate one sequence at a time: it
advances each sequence's own generator by one token per step, so every sequence still
makes progress and none waits for another to finish.

The caller (the server's scheduler, `batch_generate`) owns everything above the engine:
alignment, stop strings, EOS and responses. It calls `step()` in a loop, never blocks in
between, and `remove`s a sequence as soon as it is done with it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from ..sampling import SamplingParams
from .base import Engine, Step

__all__ = ["Batch", "SerialBatch", "open_batch"]


@runtime_checkable
class Batch(Protocol):
    """Sequences that decode together.

    `add` queues a sequence and returns its uid; it joins at the next `step`. `step`
    runs one decoding step for every active sequence and returns `(uid, Step)` for each
    sequence that produced a token (a sequence still reading its prompt produces none).
    A sequence yields at most `max_tokens` steps and leaves the batch by itself after
    its last one; `remove(uid)` takes it out earlier (unknown uids are ignored).
    `cached_tokens(uid)` is how many prompt tokens were reused from a prompt cache.
    """

    max_batch: int

    def add(
        self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None
    ) -> int: ...

    def remove(self, uid: int) -> None: ...

    def step(self) -> list[tuple[int, Step]]: ...

    def cached_tokens(self, uid: int) -> int: ...

    def __len__(self) -> int: ...

    def close(self) -> None: ...


class SerialBatch:
    """A `Batch` over any `Engine`: one generator per sequence, one token each per step."""

    def __init__(self, engine: Engine, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.engine = engine
        self.max_batch = max_batch
        self._uids = itertools.count()
        self._gens: dict[int, Iterator[Step]] = {}

    def add(
        self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None
    ) -> int:
        if len(self._gens) >= self.max_batch:
            raise RuntimeError(f"the batch is full ({self.max_batch} sequences)")
        uid = next(self._uids)
        self._gens[uid] = iter(self.engine.generate(list(prompt_ids), params, max_tokens))
        return uid

    def remove(self, uid: int) -> None:
        gen = self._gens.pop(uid, None)
        if gen is not None and hasattr(gen, "close"):
            gen.close()

    def step(self) -> list[tuple[int, Step]]:
        out: list[tuple[int, Step]] = []
        for uid, gen in list(self._gens.items()):
            try:
                out.append((uid, next(gen)))
            except StopIteration:
                self._gens.pop(uid, None)
        return out

    def cached_tokens(self, uid: int) -> int:
        return 0

    def __len__(self) -> int:
        return len(self._gens)

    def close(self) -> None:
        for uid in list(self._gens):
            self.remove(uid)


def open_batch(engine: Engine, max_batch: int, **options: Any) -> Batch:
    """The engine's own batch if it has one, else a `SerialBatch` over it.

    `options` are for engines that batch natively (e.g. `prompt_cache_bytes`, the
    memory bound of a prompt cache shared across requests); `SerialBatch` ignores them.
    """
    opener = getattr(engine, "open_batch", None)
    if callable(opener):
        return opener(max_batch, **options)
    return SerialBatch(engine, max_batch)
