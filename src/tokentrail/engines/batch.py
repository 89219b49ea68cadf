"""Batches: several sequences decoded together, joining and leaving between steps.

An engine that batches natively (mlx-lm's `BatchGenerator`, vLLM, llama.cpp's parallel
sequences) implements `open_batch(max_batch, **options) -> Batch`. `open_batch(engine, n)` returns
that, or a `SerialBatch` for engines that only generate one sequence at a time: it
advances each sequence's own generator by one token per step, so every sequence still
makes progress and none waits for another to finish.

A batch's `max_batch` is how many sequences it decodes together. `open_batch(engine)`
(`max_batch=None`) leaves that to the batch: its capacity (`BaseBatch.capacity`, or the
engine's own figure: mlx-lm's `BatchGenerator` completion batch size, llama.cpp's
sequence slots; 1 for a serial engine, which decodes one sequence at a time).

The caller (the server's scheduler, `batch_generate`) owns everything above the engine:
alignment, stop strings, EOS and responses. It calls `step()` in a loop, never blocks in
between, and `remove`s a sequence as soon as it is done with it.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from ..sampling import SamplingParams
from .base import Engine, Step

__all__ = [
    "UPSTREAM_CAPACITY",
    "BaseBatch",
    "Batch",
    "SerialBatch",
    "ThreadedBatch",
    "arrived",
    "batch_capacity",
    "check_prompt_cache_bytes",
    "open_batch",
]

#: What `step` may hand out for a sequence: its next Step, or the exception that ended
#: it (that sequence has then left the batch; the others go on).
Outcome = Step | Exception
#: Requests a `ThreadedBatch` keeps in flight upstream unless told otherwise.
UPSTREAM_CAPACITY = 32


@runtime_checkable
class Batch(Protocol):
    """Sequences that decode together.

    `add` queues a sequence and returns its uid; it joins at the next `step`. `step`
    runs one decoding step for every active sequence and returns `(uid, Step)` for each
    sequence that produced a token (a sequence still reading its prompt produces none),
    or `(uid, exception)` for a sequence that failed, which has then left the batch
    while the others go on.
    A sequence yields at most `max_tokens` steps and leaves the batch by itself after
    its last one; `remove(uid)` takes it out earlier (unknown uids are ignored).
    `cached_tokens(uid)` is how many prompt tokens were reused from a prompt cache.
    `max_batch` is how many sequences it decodes together: its capacity, the engine's
    own figure when it was opened with `max_batch=None`.
    """

    max_batch: int

    def add(
        self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None
    ) -> int: ...

    def remove(self, uid: int) -> None: ...

    def holds(self, uid: int) -> bool: ...

    def step(self) -> list[tuple[int, Outcome]]: ...

    def cached_tokens(self, uid: int) -> int: ...

    def __len__(self) -> int: ...

    def close(self) -> None: ...


def check_prompt_cache_bytes(prompt_cache_bytes: Any) -> None:
    """Refuse a prompt cache bound that is not None or an int >= 0, naming it."""
    if prompt_cache_bytes is not None and (
        isinstance(prompt_cache_bytes, bool)
        or not isinstance(prompt_cache_bytes, int)
        or prompt_cache_bytes < 0
    ):
        raise ValueError(
            f"prompt_cache_bytes must be None or an int >= 0, got {prompt_cache_bytes!r}"
        )


class BaseBatch:
    """What the batches here share: a checked `max_batch` (None: the class's `capacity`),
    the live sequences by uid in `_live` (new uids from `_uids`), no prompt cache
    (`cached_tokens` is 0), and a `close` that removes every live sequence. A subclass
    implements `add`, `remove` and `step`."""

    #: Sequences decoded together when the caller names no number (`max_batch=None`).
    capacity: ClassVar[int] = 1

    def __init__(self, max_batch: int | None = None) -> None:
        if max_batch is None:
            max_batch = self.capacity
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        self.max_batch = max_batch
        self._live: dict[int, Any] = {}
        self._uids = itertools.count()

    def _check_room(self) -> None:
        if len(self._live) >= self.max_batch:
            raise RuntimeError(f"the batch is full ({self.max_batch} sequences)")

    def remove(self, uid: int) -> None:
        raise NotImplementedError

    def cached_tokens(self, uid: int) -> int:
        return 0

    def wake(self) -> None:
        """Cut short a `step` that is waiting for I/O (any thread may call it; the
        scheduler does when a request arrives). A batch that computes its steps never
        waits, so this does nothing here."""

    def __len__(self) -> int:
        return len(self._live)

    def holds(self, uid: int) -> bool:
        """Whether sequence `uid` is still in the batch (not removed, not ended)."""
        return uid in self._live

    def close(self) -> None:
        for uid in list(self._live):
            self.remove(uid)


class SerialBatch(BaseBatch):
    """A `Batch` over any `Engine`: one generator per sequence, one token each per step.

    Its capacity is 1: the engine runs one model call per sequence and step, so more
    sequences side by side only share its speed (ask for more with `max_batch`)."""

    capacity = 1

    def __init__(self, engine: Engine, max_batch: int | None = None) -> None:
        super().__init__(max_batch)
        self.engine = engine
        self._live: dict[int, Iterator[Step]] = {}

    def add(
        self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None
    ) -> int:
        self._check_room()
        uid = next(self._uids)
        self._live[uid] = iter(self.engine.generate(list(prompt_ids), params, max_tokens))
        return uid

    def remove(self, uid: int) -> None:
        gen = self._live.pop(uid, None)
        if gen is not None and hasattr(gen, "close"):
            gen.close()

    def step(self) -> list[tuple[int, Outcome]]:
        out: list[tuple[int, Outcome]] = []
        for uid, gen in list(self._live.items()):
            try:
                out.append((uid, next(gen)))
            except StopIteration:
                self._live.pop(uid, None)
            except Exception as e:  # this sequence failed; the others go on
                self._live.pop(uid, None)
                out.append((uid, e))
        return out


_END = object()
#: Put on a waiting batch's queue by `wake`: no sequence's item (uid None is never live).
WAKE = (None, None)


class ThreadedBatch(BaseBatch):
    """A `Batch` over an engine whose `generate` waits on I/O (a remote upstream): each
    sequence's generator runs on a thread of its own and hands its steps over a queue,
    so `step` never waits on one sequence's socket. `step` returns what has arrived,
    waiting at most `wait` seconds for the first of it. Its capacity is
    `UPSTREAM_CAPACITY` requests in flight (the upstream batches them)."""

    capacity = UPSTREAM_CAPACITY

    def __init__(self, engine: Engine, max_batch: int | None = None, wait: float = 0.02) -> None:
        super().__init__(max_batch)
        self.engine = engine
        self.wait = wait
        self._live: dict[int, threading.Event] = {}
        self._out: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()

    def add(
        self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None
    ) -> int:
        self._check_room()
        uid = next(self._uids)
        stop = threading.Event()
        self._live[uid] = stop
        args = (uid, list(prompt_ids), params, max_tokens, stop)
        threading.Thread(target=self._run, args=args, daemon=True, name=f"seq-{uid}").start()
        return uid

    def _run(
        self,
        uid: int,
        prompt_ids: list[int],
        params: SamplingParams,
        max_tokens: int | None,
        stop: threading.Event,
    ) -> None:
        gen = iter(self.engine.generate(prompt_ids, params, max_tokens))
        try:
            for step in gen:
                if stop.is_set():
                    break
                self._out.put((uid, step))
        except Exception as e:
            self._out.put((uid, e))
        finally:
            close = getattr(gen, "close", None)
            if close is not None:
                close()  # a removed sequence's request ends here, on its own thread
            self._out.put((uid, _END))

    def remove(self, uid: int) -> None:
        stop = self._live.pop(uid, None)
        if stop is not None:
            stop.set()

    def wake(self) -> None:
        self._out.put(WAKE)

    def step(self) -> list[tuple[int, Outcome]]:
        out: list[tuple[int, Outcome]] = []
        for uid, item in arrived(self._out, self.wait):
            if uid not in self._live:
                continue  # removed: what it still sent is dropped
            if item is _END:
                del self._live[uid]
                continue
            out.append((uid, item))
            if isinstance(item, Exception):
                del self._live[uid]
        return out


def arrived(q: queue.SimpleQueue[Any], wait: float) -> list[Any]:
    """Everything on `q` now, waiting at most `wait` seconds for the first of it."""
    try:
        items = [q.get(timeout=wait)]
    except queue.Empty:
        return []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


#: What a pushed sequence's task puts on its batch's queue once its stream has ended.
PUSH_END = object()


def drain_pushed(
    q: queue.SimpleQueue[Any], wait: float, live: dict[int, Any]
) -> list[tuple[int, Outcome]]:
    """One step of a batch whose sequences push onto `q` (the upstream's streams, vLLM's
    `AsyncLLM`): each item is ``(uid, [steps])``, ``(uid, PUSH_END)`` or ``(uid,
    exception)``. Items of a uid no longer in `live` are dropped (removed, or a `WAKE`);
    a sequence that ended, by its end or its exception, leaves `live`."""
    return sort_pushed(arrived(q, wait), live)


def sort_pushed(
    items: Iterable[tuple[int, Any]], live: dict[int, Any]
) -> list[tuple[int, Outcome]]:
    """The steps in pushed `items` (see `drain_pushed`), one `(uid, step or exception)`
    each; a sequence that ended leaves `live`, items of a uid not in it are dropped."""
    out: list[tuple[int, Outcome]] = []
    for uid, item in items:
        if uid not in live:
            continue
        if item.__class__ is list:
            out.extend([(uid, s) for s in item])
        elif item is PUSH_END:
            del live[uid]
        else:  # the exception that ended it
            out.append((uid, item))
            del live[uid]
    return out


def open_batch(engine: Engine, max_batch: int | None = None, **options: Any) -> Batch:
    """The engine's own batch if it has one, else a `SerialBatch` over it.

    `max_batch` None (the default) opens it at its capacity, which the batch's
    `max_batch` then says (`batch_capacity`). `options` are for engines that batch
    natively (e.g. `prompt_cache_bytes`, the memory bound of a prompt cache shared
    across requests); `SerialBatch` ignores them.
    """
    opener = getattr(engine, "open_batch", None)
    if callable(opener):
        return opener(max_batch, **options)
    return SerialBatch(engine, max_batch)


def batch_capacity(batch: Any) -> int:
    """How many sequences `batch` decodes together (its `max_batch`), 1 if it says none."""
    value = getattr(batch, "max_batch", None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return 1
    return value
