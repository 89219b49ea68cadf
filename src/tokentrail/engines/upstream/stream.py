"""Many upstream streams on one event loop: the proxy's batch.

`AsyncUpstreamBatch` is the `Batch` of `tokentrail.engines.upstream.engine.UpstreamEngine`.
Its streams are tasks on an asyncio event loop with one shared aiohttp client session
(connections kept alive). Each task sends its request, reads the response with a
`StepReader` (`tokentrail.engines.upstream.wire`: SSE, JSON, realigner) and appends its
steps to the batch's output. Two ways to run it:

- **On the server's own loop** (`attach`; what ``serve --upstream`` does, through
  `tokentrail.server.on_loop`): `step` never waits, it returns what has arrived, and
  the driver awaits `arrival` between steps; while it waits, the reader that read a
  stream's steps runs the driver's pass itself (`on_arrival`). The upstream's bytes,
  the output stage and the client's SSE are then one thread and one loop: no thread
  hand-off, no wake-up through a pipe, per token.
- **On a loop of its own** (uvloop's where installed), run *inside* `step` on the thread
  that calls it: `step` runs the loop until some stream has produced a step (or `wait`
  seconds pass, or `wake` is called from another thread), then returns everything
  produced in that pass.

Either way the steps that arrived together are returned together. (The batch used to
run its loop on a thread of its own, handing steps over a queue: two thread hand-offs
per token, measured in ``benchmarks/results/proxy-cpu.md``.) aiohttp reads a streamed
response for about a third of httpx's CPU per chunk (same file).

Removing a sequence cancels its task (on its own loop: and runs the loop until the task
has ended), so its upstream connection is closed at once (the upstream then stops generating); a
connection whose response was not read to its end is closed, never handed to the next
request. A request that met a kept-alive connection the upstream had already closed
(no response began) is sent once more on a fresh one.

Its capacity is the upstream's: the engine's `capacity` (llama-server's slots from its
``/props``; a generous default where a server does not say, vLLM's among them, whose
own queue then holds what it cannot run yet).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from ...fastjson import dumps
from ...sampling import SamplingParams
from ..batch import PUSH_END, BaseBatch, Outcome, sort_pushed
from .wire import ReadCost, StepReader, status_error

_JSON = {"Content-Type": "application/json"}


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (as uvicorn picks it for the server's
    own loop), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _env_proxy(url: str) -> str | None:
    """The proxy the environment names for `url` (HTTP_PROXY, HTTPS_PROXY, NO_PROXY, as
    httpx honours them), looked up once: aiohttp's own ``trust_env`` looks it up (and
    reads ~/.netrc) in a thread for every request."""
    from urllib.parse import urlsplit
    from urllib.request import getproxies, proxy_bypass

    parts = urlsplit(url)
    if not parts.hostname or proxy_bypass(parts.hostname):
        return None
    return getproxies().get(parts.scheme)


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class AsyncUpstreamBatch(BaseBatch):
    """A `Batch` of upstream streams read on one event loop (see the module).

    `engine` is an `UpstreamEngine` (its `request`, `transport_error`, `capacity`,
    `url`, `timeout`, `request_headers`); `max_batch` None takes the engine's
    `capacity`. `step` returns the steps that have arrived, waiting at most `wait`
    seconds for the first. `cost` adds up where the reading time went (`ReadCost`: SSE
    and JSON parsing, realigning), over every finished or removed sequence. Every
    method but `wake` is called from one thread (the scheduler's).
    """

    def __init__(self, engine: Any, max_batch: int | None = None, wait: float = 0.02) -> None:
        try:
            import aiohttp
        except ImportError as e:  # pragma: no cover - the server extra installs it
            raise ImportError(
                "the proxy's upstream batch needs aiohttp: pip install 'tokentrail[server]'"
            ) from e
        super().__init__(engine.capacity if max_batch is None else max_batch)
        self.engine = engine
        self.wait = wait
        self.cost = ReadCost()
        self._live: dict[int, asyncio.Task[None]] = {}
        self._out: list[tuple[int, Any]] = []
        self._ready: asyncio.Future[None] | None = None
        self._woken = False
        self._tick: asyncio.TimerHandle | None = None  # the standing limit on a wait
        self._attached: asyncio.AbstractEventLoop | None = None
        self._own: asyncio.AbstractEventLoop | None = None
        self._session: Any = None
        self._errors = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
        self._transport = (aiohttp.ClientError, TimeoutError)
        self._proxy = _env_proxy(engine.url)
        #: Attached: run where a stream's steps arrive while `arrival` waits for them
        #: (`server.on_loop.drive` sets it), in the reader's task; returns whether the
        #: wait must end all the same after its pass, or None where it ran none (the
        #: wait ends). Unset (None): the wait ends (see the module).
        self.on_arrival: Callable[[], bool | None] | None = None
        self._reader_passes = 0  # how many passes `on_arrival` ran in a reader's task

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run the streams on `loop` (running, the caller's): `step` then never waits;
        await `arrival` between steps. Before the first `add`."""
        if self._own is not None or self._live:
            raise RuntimeError("attach the batch to a loop before its first sequence")
        self._attached = loop

    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        if self._attached is not None:
            return self._attached
        if self._own is None:
            self._own = _new_loop()
        return self._own

    def _client(self) -> Any:
        """The shared session, opened on first use (on the loop that runs the streams)."""
        if self._session is None:
            import aiohttp

            timeout = aiohttp.ClientTimeout(
                total=None, connect=10.0, sock_read=self.engine.timeout
            )
            self._session = aiohttp.ClientSession(
                headers=self.engine.request_headers,
                timeout=timeout,
                connector=aiohttp.TCPConnector(limit=0),
            )
        return self._session

    def add(self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None) -> int:
        self._check_room()
        path, body = self.engine.request(prompt_ids, params, max_tokens)
        uid = next(self._uids)
        dist = self.engine.distribution(params)
        reader = StepReader(self.engine, body, list(prompt_ids), max_tokens, dist)
        coro = self._stream(uid, self.engine.url + path, dumps(body), reader)
        self._live[uid] = self._loop.create_task(coro)
        return uid

    def _push(self, uid: int, item: Any) -> None:
        if uid not in self._live:
            return  # removed: nobody reads it
        self._out.append((uid, item))
        ready = self._ready
        if ready is None or ready.done():
            return
        run = self.on_arrival
        if run is not None:
            wake = run()
            if wake is not None:
                self._reader_passes += 1
                if not wake:
                    return
        ready.set_result(None)

    async def _stream(self, uid: int, url: str, body: bytes, reader: StepReader) -> None:
        try:
            for attempt in range(2):
                answered: list[bool] = []
                try:
                    await self._read(uid, url, body, reader, answered)
                    break
                except self._errors:
                    # A kept-alive connection the upstream had closed: no response
                    # began, so the request never ran; once more on a fresh one.
                    if attempt or answered:
                        raise
            self._push(uid, reader.finish())
        except self._transport as e:
            self._push(uid, self.engine.transport_error(e))
        except Exception as e:  # this sequence failed; the others go on
            self._push(uid, e)
        finally:
            self.cost.add(reader.cost)
            self._push(uid, PUSH_END)

    async def _read(
        self, uid: int, url: str, body: bytes, reader: StepReader, answered: list[bool]
    ) -> None:
        post = self._client().post
        async with post(url, data=body, headers=_JSON, proxy=self._proxy) as resp:
            answered.append(True)
            if resp.status >= 400:
                text = (await resp.read()).decode("utf-8", "replace")
                raise status_error(resp.status, text, url)
            # The answer began, its first token not yet: meanwhile the set-up that
            # token would otherwise wait for.
            reader.prime()
            # Read to the end (past [DONE]), so the connection can serve the next one.
            feed, push = reader.feed, self._push
            async for data in resp.content.iter_any():
                steps = feed(data)
                if steps:
                    push(uid, steps)

    def remove(self, uid: int) -> None:
        task = self._live.pop(uid, None)
        if task is not None and not task.done():
            task.cancel()  # closes its upstream stream, once the loop runs it
            if self._attached is None:
                with contextlib.suppress(BaseException):
                    self._loop.run_until_complete(asyncio.wait([task]))

    def wake(self) -> None:
        """End the wait for the next step now (or the next wait, at once); from any
        thread."""
        with contextlib.suppress(RuntimeError):  # closed
            self._loop.call_soon_threadsafe(self._wake_now)

    def _wake_now(self) -> None:
        if self._ready is not None:
            _settle(self._ready)
        else:
            self._woken = True

    def _arm(self, timeout: float | None) -> asyncio.Future[None]:
        """The wait for the next arrival, ended at the latest `timeout` seconds from now.

        The limit is one standing timer (`_tick`), made again only once it has fired,
        not a timer made and cancelled on every wait (a pass per upstream event at low
        load): a wait may then end sooner than `timeout`, at the tick an earlier wait
        set, which costs one empty pass and never a later one."""
        loop = self._loop
        self._ready = ready = loop.create_future()
        if self._woken or self._out:
            self._woken = False
            ready.set_result(None)
        elif timeout is not None and self._tick is None:
            self._tick = loop.call_later(timeout, self._on_tick)
        return ready

    def _on_tick(self) -> None:
        self._tick = None
        if self._ready is not None:
            _settle(self._ready)

    def _stop_tick(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None

    async def arrival(self, timeout: float | None) -> None:
        """(Attached) until a stream has produced something, `wake` is called, or
        `timeout` seconds pass (None: no limit)."""
        try:
            ready = self._arm(timeout)
            if ready.done():
                await asyncio.sleep(0)  # a pass of the loop all the same: never starve it
            else:
                await ready
        finally:
            self._ready = None

    def step(self) -> list[tuple[int, Outcome]]:
        if not self._out and self._attached is None:
            try:
                self._loop.run_until_complete(self._arm(self.wait))
            finally:
                self._ready = None
        arrived, self._out = self._out, []
        return sort_pushed(arrived, self._live)

    def stats(self) -> dict[str, Any]:
        """The batch's capacity, live sequences, how many passes its readers ran
        (`on_arrival`) and reading cost (`ReadCost.to_dict`)."""
        return {"max_batch": self.max_batch, "live": len(self._live),
                "reader_passes": self._reader_passes, **self.cost.to_dict()}  # fmt: skip

    async def aclose(self) -> None:
        """(Attached) cancel every stream and close the session, on the loop."""
        self._stop_tick()
        tasks = [t for t in self._live.values() if not t.done()]
        self._live.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def close(self) -> None:
        if self._attached is not None:  # its loop's own business (`aclose`)
            self._stop_tick()
            for task in self._live.values():
                task.cancel()
            self._live.clear()
            return
        loop = self._own
        if loop is None or loop.is_closed():
            self._live.clear()
            return
        with contextlib.suppress(BaseException):
            loop.run_until_complete(self.aclose())
        with contextlib.suppress(BaseException):
            loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
