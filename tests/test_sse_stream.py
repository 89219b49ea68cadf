"""`EventStream`, the server's one SSE writer, on a real uvicorn server and real sockets.

Each send may wait `send_timeout` seconds for a client that does not read; then the job
is dropped and the connection closed. The limit is kept by one watchdog timer per
stream (not a timer per send): these tests hold it to the same promise, never sooner
than the limit after the send began waiting, and never for a client that hung up.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from tests.helpers.env import require

uvicorn = require("uvicorn")
require("starlette")

from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.routing import Route  # noqa: E402

from tokentrail.server.jobs import Job  # noqa: E402
from tokentrail.server.protocol import GenRequest  # noqa: E402
from tokentrail.server.sse import EventStream  # noqa: E402

LIMIT = 0.6  # seconds a send may wait
ITEM = b"data: " + b"x" * 65536 + b"\n\n"  # fills the socket's buffers in a few sends


class Rig:
    """A uvicorn server on a thread whose one route streams `ITEM` forever."""

    def __init__(self) -> None:
        self.jobs: list[Job] = []
        self.last_item: list[float] = []  # per job: when its body last gave an item
        self.closed: list[bool] = []  # per job: whether its body was closed
        self.app = Starlette(routes=[Route("/stream", self.stream, methods=["POST"])])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error",
                                loop="asyncio")  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    async def stream(self, request: Request) -> Any:
        req = GenRequest(kind="completion", prompt=[], model="m")
        job = Job(id=f"cmpl-{len(self.jobs)}", request=req, loop=asyncio.get_running_loop())
        n = len(self.jobs)
        self.jobs.append(job)
        self.last_item.append(0.0)
        self.closed.append(False)

        async def body() -> AsyncIterator[bytes]:
            try:
                while not job.cancelled.is_set():
                    self.last_item[n] = time.monotonic()
                    yield ITEM
                    await asyncio.sleep(0)
            finally:
                self.closed[n] = True

        async def idle() -> None:
            await asyncio.Event().wait()

        watcher = asyncio.create_task(idle())
        return EventStream(body(), job, watcher, LIMIT)

    def __enter__(self) -> Rig:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def connect(self) -> socket.socket:
        """A client that asked for the stream and read its status line."""
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        sock.sendall(b"POST /stream HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n")
        assert sock.recv(12).startswith(b"HTTP/1.1 200")
        return sock

    def wait_for(self, what: Any, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not what():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.01)


@pytest.fixture()
def rig() -> Iterator[Rig]:
    with Rig() as r:
        yield r


def test_a_client_that_stops_reading_is_dropped_after_the_limit(rig: Rig) -> None:
    sock = rig.connect()
    try:
        # It reads past the watchdog's first look, then stops: the look after finds a
        # send that began waiting less than the limit before, which must not count.
        sock.settimeout(30)
        until = time.monotonic() + 1.5 * LIMIT
        while time.monotonic() < until:
            sock.recv(1 << 20)
        assert not rig.jobs[0].cancelled.is_set()
        rig.wait_for(lambda: rig.jobs and rig.jobs[0].cancelled.is_set(), LIMIT + 30)
        dropped_at = time.monotonic()
        job = rig.jobs[0]
        assert job.dropped and job.reason == "client stopped reading"
        # The send that waited began after the body's last item: never dropped sooner.
        assert dropped_at - rig.last_item[0] >= LIMIT * 0.95
        rig.wait_for(lambda: rig.closed[0], 30)
        # The server closes the connection: reading drains what it had sent, then EOF.
        sock.settimeout(30)
        while sock.recv(1 << 20):
            pass
    finally:
        sock.close()


def test_a_client_that_reads_is_never_dropped(rig: Rig) -> None:
    sock = rig.connect()
    try:
        sock.settimeout(30)
        until = time.monotonic() + 4 * LIMIT  # several watchdog rounds
        got = 0
        while time.monotonic() < until:
            got += len(sock.recv(1 << 20))
        job = rig.jobs[0]
        assert not job.cancelled.is_set() and not job.dropped
        assert got > 4 * len(ITEM)
    finally:
        sock.close()
    rig.wait_for(lambda: rig.jobs[0].cancelled.is_set(), 30)
    assert not rig.jobs[0].dropped  # a hang-up, not a client that stopped reading
    rig.wait_for(lambda: rig.closed[0], 30)


def test_a_hang_up_mid_send_is_a_hang_up_not_a_drop(rig: Rig) -> None:
    sock = rig.connect()
    time.sleep(LIMIT / 3)  # its sends now wait for a client that does not read
    sock.close()
    rig.wait_for(lambda: rig.jobs and rig.jobs[0].cancelled.is_set(), 30)
    job = rig.jobs[0]
    assert not job.dropped
    rig.wait_for(lambda: rig.closed[0], 30)
    # The server goes on serving: a second stream opens and is served.
    again = rig.connect()
    again.close()
    rig.wait_for(lambda: len(rig.jobs) == 2 and rig.jobs[1].cancelled.is_set(), 30)
