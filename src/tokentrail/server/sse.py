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
per token (``benchmarks/results/proxy-cpu.md``). Here a send is one ``await`` under
``asyncio.timeout``.
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


class _SendTimeout(Exception):
    """A send waited `send_timeout` seconds for a client that does not read."""


async def _send_within(send: Send, message: Any, limit: float) -> None:
    """`send(message)`, raising `_SendTimeout` (only for this wait: a TimeoutError from
    the body, e.g. an upstream's, is not the client's) after `limit` seconds."""
    try:
        async with asyncio.timeout(limit):
            await send(message)
    except TimeoutError as e:
        raise _SendTimeout from e


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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._watcher.cancel()  # the response watches for the disconnect from here on
        job = self._job
        writer = asyncio.current_task()
        listener = asyncio.create_task(self._listen(receive, writer))
        try:
            await self._write(send)
        except _SendTimeout:
            # The client stopped reading: give up on it. Returning with the response
            # unfinished makes the HTTP server close the connection.
            job.drop("client stopped reading")
            logger.info("closing the stream of %s: the client stopped reading", job.id)
        except OSError:  # the client went away while we were writing
            logger.info("client of %s went away mid-stream", job.id)
        except asyncio.CancelledError:
            if not self._hung_up:
                raise
            if writer is not None:
                writer.uncancel()  # the listener's cancel, not the server's
            logger.info("client of %s went away mid-stream", job.id)
        finally:
            listener.cancel()
            job.cancel("response ended")
            try:
                await self._body.aclose()  # type: ignore[attr-defined]
            except asyncio.CancelledError:
                if not self._hung_up:  # (a hang-up just as the stream ended: done)
                    raise
                if writer is not None:
                    writer.uncancel()

    async def _write(self, send: Send) -> None:
        limit = self._send_timeout
        await _send_within(send, _START, limit)
        async for data in self._body:
            body = {"type": "http.response.body", "body": data, "more_body": True}
            await _send_within(send, body, limit)
        await _send_within(send, {"type": "http.response.body", "body": b""}, limit)

    async def _listen(self, receive: Receive, writer: Any) -> None:
        """Wait for the client to hang up; then cancel the job and stop the writer
        wherever it waits (for the next event, or a body that reads an upstream)."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._job.cancel("client disconnected")
                self._hung_up = True
                if writer is not None:
                    writer.cancel()
                return
