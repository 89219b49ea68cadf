"""The server's one SSE writer: every streamed answer (the model's, the proxy's and
``--upstream-chat``'s) leaves through `EventStream`, built on sse-starlette's
`EventSourceResponse` (as llama-cpp-python's server streams).

What it adds to sse-starlette is the job's lifetime: however the response ends (the
stream's last event, the client hanging up, a client that stops reading, a broken
socket), the job is cancelled and its body iterator closed, so the generation behind it
stops and frees its place in the batch. sse-starlette watches for the disconnect itself
(its ``client_close_handler_callable``), so the route's own watcher is cancelled when the
response takes over. Each write may wait ``send_timeout`` seconds for a client that does
not read; then the job is dropped and the connection closed. Keep-alive pings are off:
the events are the model's tokens, and a client that parses the stream by hand sees only
``data:`` lines, as from OpenAI.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

from sse_starlette.sse import EventSourceResponse, SendTimeoutError
from starlette.types import Receive, Scope, Send

from .jobs import Job

__all__ = ["EventStream"]

logger = logging.getLogger("tokentrail.server")

_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class EventStream:
    """An ASGI response streaming `body` (each item: one event's bytes, ``data: ...\\n\\n``)
    for `job`; see the module."""

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

        async def hung_up(_message: Mapping[str, Any]) -> None:
            job.cancel("client disconnected")

        self._response = EventSourceResponse(
            body,
            headers=_HEADERS,
            media_type="text/event-stream; charset=utf-8",
            ping=0,
            send_timeout=send_timeout,
            client_close_handler_callable=hung_up,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._watcher.cancel()  # the response watches for the disconnect from here on
        try:
            await self._response(scope, receive, send)
        except SendTimeoutError:
            # The client stopped reading: give up on it. Returning with the response
            # unfinished makes the HTTP server close the connection.
            self._job.drop("client stopped reading")
            logger.info("closing the stream of %s: the client stopped reading", self._job.id)
        except OSError:  # the client went away while we were writing
            logger.info("client of %s went away mid-stream", self._job.id)
        finally:
            self._job.cancel("response ended")
            await self._body.aclose()  # type: ignore[attr-defined]
