"""A request as the scheduler's loop thread and the event loop share it: a `Job` and
the events it posts to its reader, the `Outbox` that hands a batch step's events to
the event loop in one call, and the `Courier` thread that can make that call for it.

The loop thread writes (`post`); the event loop reads (`next_event`) and cancels.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from .protocol import GenRequest

logger = logging.getLogger("tokentrail.server")

__all__ = ["ChatRunner", "Courier", "EventKind", "Job", "Outbox"]

#: "admitted": a job the event loop runs (`Job.outside`) may start: it has its place.
EventKind = Literal["step", "done", "error", "cancelled", "admitted"]


def _deliver(events: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for reader, event in events:
        reader.put_nowait(event)


def _hand_over(pending: list[tuple[asyncio.AbstractEventLoop, list[tuple[Any, Any]]]]) -> None:
    try:
        here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:  # the scheduler's own thread
        here = None
    for loop, events in pending:
        if loop is here:  # the scheduler runs on the readers' loop (`server.on_loop`)
            _deliver(events)
            continue
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is reading
            loop.call_soon_threadsafe(_deliver, events)


class Courier:
    """A thread that makes the `call_soon_threadsafe` calls for an `Outbox`.

    Waking the event loop writes to its self-pipe, and that write lets the woken event
    loop take the GIL: the writer then waits for it to format and send what it was given
    before it can go on. A loop thread whose next step is one long call that releases
    the GIL (`llama_decode` through ctypes) hands its events here instead, which costs it
    one lock: the courier takes the GIL when that call lets it go, so the event loop's
    work runs while the model computes, not between two steps. One thread, first in
    first out: every request's events keep their order.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tokentrail-courier", daemon=True)
        self._thread.start()

    def post(self, pending: list[tuple[asyncio.AbstractEventLoop, list[tuple[Any, Any]]]]) -> None:
        """Hand `pending` ((loop, events) pairs) over, after everything posted before."""
        self._queue.put(pending)

    def close(self, timeout: float = 10.0) -> None:
        """Hand over what is still queued, then end the thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (pending := self._queue.get()) is not None:
            _hand_over(pending)


class Outbox:
    """Events posted during one pass of the loop thread, handed to the event loop in one
    call per loop when the pass ends: one wake-up of the event loop per batch step,
    not one per token (each `call_soon_threadsafe` writes to the loop's self-pipe).
    With a `courier`, that thread makes the call."""

    __slots__ = ("_by_loop", "courier")

    def __init__(self, courier: Courier | None = None) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any]]] = {}
        self.courier = courier

    def add(self, loop: asyncio.AbstractEventLoop, reader: asyncio.Queue[Any], event: Any) -> None:
        self._by_loop.setdefault(loop, []).append((reader, event))

    def flush(self) -> None:
        """Hand over everything added so far, in the order it was added."""
        if not self._by_loop:
            return
        pending = list(self._by_loop.items())
        self._by_loop.clear()
        if self.courier is not None:
            self.courier.post(pending)
        else:
            _hand_over(pending)


@dataclass(eq=False)
class Job:
    """One request: its `n` sequences are filled by the loop thread, read on the event loop.

    Events are `(kind, choice, value)`. `posted` is written only by the loop thread and
    `read` only by the reader; their difference is the unread backlog.
    """

    id: str
    request: GenRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[tuple[EventKind, int, Any]] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    generated: int = 0
    outcome: str = "queued"
    submitted: float = field(default_factory=time.monotonic)
    posted: int = 0
    read: int = 0
    #: When the reader last took an event, or when output began waiting for it.
    last_read: float = field(default_factory=time.monotonic)
    live: int = 0  # sequences still in the batch
    reason: str = ""
    #: Set when the client was dropped for not reading (not a hang-up).
    dropped: bool = False
    #: Set when it arrived with the batch full, so it had to wait for room.
    waited_for_room: bool = False
    #: The scheduler's `Outbox` once the job is in the batch (None: events go out at once).
    outbox: Outbox | None = None
    #: Run on the event loop, not in the engine's batch (``--upstream-chat``): admitted
    #: like any job, it holds one place in the batch until `Scheduler.release`.
    outside: bool = False
    #: The request's `tokentrail.output.vote.EarlyStop` (None: not asked for), written by
    #: the loop thread as its choices run, read for `usage` once they have all ended.
    early_stop: Any = None

    def post(self, kind: EventKind, choice: int = 0, value: Any = None) -> None:
        """Hand an event to the reader (called from the loop thread): at once, or with
        the rest of its step when the job has an `outbox`."""
        if self.posted == self.read:
            self.last_read = time.monotonic()  # the reader's clock starts now
        self.posted += 1
        if self.outbox is not None:
            self.outbox.add(self.loop, self.events, (kind, choice, value))
            return
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is reading
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, choice, value))

    def drop(self, reason: str) -> None:
        """Stop this request because its client stopped reading."""
        if not self.cancelled.is_set():
            self.dropped = True
        self.cancel(reason)

    def cancel(self, reason: str) -> None:
        """Stop this request (called on the event loop); wakes a reader waiting on it."""
        if not self.cancelled.is_set():
            logger.debug("cancelling %s: %s", self.id, reason)
            self.reason = self.reason or reason
            self.cancelled.set()
            self.events.put_nowait(("cancelled", 0, reason))

    async def next_event(self) -> tuple[EventKind, int, Any]:
        event = await self.events.get()
        self.read += 1
        self.last_read = time.monotonic()
        return event

    def ready_event(self) -> tuple[EventKind, int, Any] | None:
        """The next event if one has arrived already, else None (never waits): a
        stream writes every event that arrived together in one send."""
        if self.events.empty():
            return None
        event = self.events.get_nowait()
        self.read += 1
        self.last_read = time.monotonic()  # a reader that keeps up is not stalled
        return event


class ChatRunner(Protocol):
    """Answers the chat requests the scheduler admits (`Job.outside`) on the event loop,
    not in the engine's batch (`tokentrail.server.proxy_chat.UpstreamChat`). The app read,
    checked and validated the body as every request's; `check` refuses what the runner
    cannot serve (APIError); `open` and `aclose` run as the app starts and stops."""

    def check(self, req: GenRequest) -> None: ...

    def open(self) -> None: ...

    async def aclose(self) -> None: ...

    async def run(
        self, job: Job, body: dict[str, Any], release: Callable[[Job, str, float | None], None]
    ) -> dict[str, Any] | AsyncIterator[bytes] | None:
        """The whole response, the SSE body, or None (the client left first). `release`
        (`Scheduler.release`) is called once with the outcome when the answer ends,
        however it ends, a stream's when it is closed."""
        ...
