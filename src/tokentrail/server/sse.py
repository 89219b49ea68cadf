"""The server's one SSE writer: every streamed answer (the model's, the proxy's and
``--upstream-chat``'s) leaves through `EventStream`, a plain ASGI response.

Each item of the body is already one or more whole events (``data: ...\\n\\n``); the
writer sends it as it is, with the headers an event stream needs (``text/event-stream``,
no caching, no proxy buffering). Keep-alive pings are off: the events are the model's
tokens, and a client that parses the stream by hand sees only ``data:`` lines, as from
OpenAI.

What it adds is the job's lifetime: however the response ends (the stream's last event,
the client hanging up, a client that stops reading, a broken socket), the job is
cancelled and its body iterator closed, so the generation behind it stops and frees its
place in the batch. It watches for the disconnect itself (the route's own watcher is
cancelled when the response takes over). Each write may wait ``send_timeout`` seconds
for a client that does not read; then the job is dropped and the connection closed.

It used to be sse-starlette's ``EventSourceResponse``, which runs every send in an anyio
task group under a cancel scope of its own: about a fifth of the proxy's event-loop CPU
per token (``benchmarks/results/proxy-cpu.md``). Here a send is one plain ``await``.
The limit on a send is one timer per stream, not one per send (``asyncio.timeout``
around each send cost about 4.5 µs, a timer made and cancelled for every token): the
writer notes when each send begins, and the stream's watchdog looks every
``send_timeout`` seconds (no more often than every 50 ms while no send is under way),
or when the send under way would reach the limit: a stream whose send has waited
``send_timeout`` seconds is dropped then, as before (with a limit under 50 ms, at most
50 ms later).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.types import Receive, Scope, Send

from .jobs import Job

__all__ = ["EventStream"]

logger = logging.getLogger("tokentrail.server")

_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),
        (b"connection", b"keep-alive"),
    ],
}


#: The longest the watchdog waits between looks while no send is under way, when the
#: limit is shorter (a send that begins meanwhile is dropped at most this late).
_IDLE_LOOK = 0.05


class EventStream:
    """An ASGI response streaming `body` (each item: whole events' bytes) for `job`;
    see the module."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        job: Job,
        watcher: asyncio.Task[None],
        send_timeout: float,
    ) -> None:
        self._body = body
        self._job = job
        self._watcher = watcher
        self._send_timeout = send_timeout
        self._hung_up = False
        self._stuck = False  # the watchdog found a send waiting past the limit
        self._cancels = 0  # how often the listener and the watchdog cancelled the writer
        self._sending: float | None = None  # when the send under way began (loop time)
        self._writer: asyncio.Task[Any] | None = None
        self._watchdog: asyncio.TimerHandle | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._watcher.cancel()  # the response watches for the disconnect from here on
        job = self._job
        self._writer = asyncio.current_task()
        listener = asyncio.create_task(self._listen(receive))
        loop = asyncio.get_running_loop()
        self._watchdog = loop.call_later(self._send_timeout, self._watch)
        try:
            await self._write(send)
        except OSError:  # the client went away while we were writing
            logger.info("client of %s went away mid-stream", job.id)
        except asyncio.CancelledError:
            if not self._ours():
                raise
            if self._stuck and not self._hung_up:
                # The client stopped reading: give up on it. Returning with the response
                # unfinished makes the HTTP server close the connection.
                job.drop("client stopped reading")
                logger.info("closing the stream of %s: the client stopped reading", job.id)
            else:
                logger.info("client of %s went away mid-stream", job.id)
        finally:
            if self._watchdog is not None:
                self._watchdog.cancel()
            listener.cancel()
            job.cancel("response ended")
            try:
                await self._body.aclose()  # type: ignore[attr-defined]
            except asyncio.CancelledError:
                # (a hang-up just as the stream ended: done)
                if not self._ours():
                    raise

    def _ours(self) -> bool:
        """Whether the writer's cancellation came only from the listener or the watchdog
        (then taken back: the server did not cancel it); False for anyone else's."""
        writer = self._writer
        if not self._cancels or writer is None:
            return False
        if writer.cancelling() > self._cancels:
            return False  # the server cancelled it too
        while self._cancels:
            writer.uncancel()
            self._cancels -= 1
        return True

    def _cancel_writer(self) -> None:
        if self._writer is not None and not self._writer.done():
            self._cancels += 1
            self._writer.cancel()

    def _watch(self) -> None:
        """The stream's watchdog (a loop timer): drop the stream if its send has waited
        `send_timeout` seconds; else look again when the one under way would reach it."""
        limit = self._send_timeout
        since = self._sending
        loop = asyncio.get_running_loop()
        if since is not None and loop.time() - since >= limit:
            self._stuck = True
            self._cancel_writer()
            return
        # With no send under way, look again a limit later (at least _IDLE_LOOK: a tiny
        # limit must not spin the loop while the stream waits for its next event).
        wait = max(limit, _IDLE_LOOK) if since is None else since + limit - loop.time()
        self._watchdog = loop.call_later(max(wait, 0.0), self._watch)

    async def _write(self, send: Send) -> None:
        clock = asyncio.get_running_loop().time
        self._sending = clock()
        await send(_START)
        self._sending = None
        async for data in self._body:
            body = {"type": "http.response.body", "body": data, "more_body": True}
            self._sending = clock()
            await send(body)
            self._sending = None
        self._sending = clock()
        await send({"type": "http.response.body", "body": b""})
        self._sending = None

    async def _listen(self, receive: Receive) -> None:
        """Wait for the client to hang up; then cancel the job and stop the writer
        wherever it waits (for the next event, or a body that reads an upstream)."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._job.cancel("client disconnected")
                self._hung_up = True
                self._cancel_writer()
                return
