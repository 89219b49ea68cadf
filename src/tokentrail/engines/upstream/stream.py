"""Many upstream streams on one event loop: the proxy's batch.

`AsyncUpstreamBatch` is the `Batch` of `tokentrail.engines.upstream.engine.UpstreamEngine`.
It runs one asyncio event loop on a background thread with one shared
`httpx.AsyncClient` (connections kept alive, the pool sized to the batch). Each sequence
is a task on that loop: it sends the request, reads the response with a `StepReader`
(`tokentrail.engines.upstream.wire`: SSE, JSON, realigner) and puts its steps on a
queue that `step` drains, so the scheduler never waits on a socket and no thread is
spent per stream. Removing a sequence cancels its task, which closes its upstream
stream (the upstream then stops generating); a connection whose response was not read
to its end is closed, never handed to the next request.

Its capacity is the upstream's: the engine's `capacity` (llama-server's slots from its
``/props``; a generous default where a server does not say, vLLM's among them, whose
own queue then holds what it cannot run yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from ...sampling import SamplingParams
from ..batch import PUSH_END, WAKE, BaseBatch, Outcome, drain_pushed
from .wire import ReadCost, StepReader, status_error


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (as uvicorn picks it for the server's
    own loop), else asyncio's: the reader's loop runs every upstream socket."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class AsyncUpstreamBatch(BaseBatch):
    """A `Batch` of upstream streams read on one event loop (see the module).

    `engine` is an `UpstreamEngine` (its `request`, `transport_error`, `capacity`,
    `url`, `client_options`); `max_batch` None takes the engine's `capacity`. `step`
    returns the steps that have arrived, waiting at most `wait` seconds for the first.
    `cost` adds up where the reading time went (`ReadCost`: SSE and JSON parsing,
    realigning), over every finished or removed sequence.
    """

    def __init__(self, engine: Any, max_batch: int | None = None, wait: float = 0.02) -> None:
        super().__init__(engine.capacity if max_batch is None else max_batch)
        self.engine = engine
        self.wait = wait
        self.cost = ReadCost()
        self._live: dict[int, Future[None]] = {}
        self._out: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self._loop = _new_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tokentrail-upstream-io", daemon=True
        )
        self._thread.start()
        self._client = self._call(self._open_client()).result()

    def _call(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _open_client(self) -> Any:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=self.max_batch)
        return httpx.AsyncClient(limits=limits, **self.engine.client_options())

    def add(self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None) -> int:
        self._check_room()
        path, body = self.engine.request(prompt_ids, params, max_tokens)
        uid = next(self._uids)
        reader = StepReader(self.engine, body, list(prompt_ids), max_tokens)
        self._live[uid] = self._call(self._stream(uid, path, body, reader))
        return uid

    async def _stream(self, uid: int, path: str, body: dict[str, Any], reader: StepReader) -> None:
        import httpx

        put = self._out.put
        try:
            for attempt in range(2):
                answered: list[bool] = []
                try:
                    await self._read(uid, path, body, reader, answered)
                    break
                except httpx.RemoteProtocolError:
                    # A kept-alive connection the upstream had closed: no response
                    # began, so the request never ran; once more on a fresh one.
                    if attempt or answered:
                        raise
            put((uid, reader.finish()))
        except httpx.HTTPError as e:
            put((uid, self.engine.transport_error(e)))
        except Exception as e:  # this sequence failed; the others go on
            put((uid, e))
        finally:
            self.cost.add(reader.cost)  # on the loop thread only
            put((uid, PUSH_END))

    async def _read(
        self, uid: int, path: str, body: dict[str, Any], reader: StepReader, answered: list[bool]
    ) -> None:
        async with self._client.stream("POST", path, json=body) as resp:
            answered.append(True)
            if resp.status_code >= 400:
                await resp.aread()
                raise status_error(resp.status_code, resp.text, self.engine.url + path)
            # Read to the end (past [DONE]), so the connection can serve the next one.
            async for data in resp.aiter_bytes():
                steps = reader.feed(data)
                if steps:
                    self._out.put((uid, steps))

    def remove(self, uid: int) -> None:
        task = self._live.pop(uid, None)
        if task is not None:
            task.cancel()  # closes its upstream stream, on the loop

    def wake(self) -> None:
        self._out.put(WAKE)

    def step(self) -> list[tuple[int, Outcome]]:
        return drain_pushed(self._out, self.wait, self._live)

    def stats(self) -> dict[str, Any]:
        """The batch's capacity, live sequences and reading cost (`ReadCost.to_dict`)."""
        return {"max_batch": self.max_batch, "live": len(self._live), **self.cost.to_dict()}

    def close(self) -> None:
        tasks = list(self._live.values())
        super().close()
        for task in tasks:
            with contextlib.suppress(BaseException):
                task.result(timeout=5)
        with contextlib.suppress(Exception):
            self._call(self._client.aclose()).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
