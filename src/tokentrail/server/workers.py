"""`tokentrail serve --workers N`: N processes serving requests on one listening socket.

The supervisor (`supervise`, in the process `tokentrail serve` started) has the address
bound once (which holds the port, `--port 0` included) and a shared folder made, then
starts the workers with multiprocessing's *spawn*, each with a listening socket of its
own bound to the same address (``SO_REUSEPORT``, `listener_for`): the kernel spreads new
connections evenly over the workers' sockets, and a connection stays with the worker that
took it. (One socket shared by all would do too, but an idle asyncio loop accepts every
connection waiting at once: a burst of clients would land on one worker. Where the
system has no ``SO_REUSEPORT`` the workers share the supervisor's socket.) The supervisor
closes its copy of a worker's socket once the worker has it, so the socket dies with the
worker. Worker 0 starts alone and proves the
configuration (a tokenizer that does not load, an upstream that does not answer: the
supervisor then exits with that worker's status, the worker having said why in one
line); the others then start together, and the supervisor logs the URL once all serve.

The shared folder holds

- ``prometheus/``: prometheus_client's multiprocess folder (``PROMETHEUS_MULTIPROC_DIR``,
  set for the workers), so that `/metrics` sums the workers (`metrics.Metrics`);
- ``worker-<index>.json``: each worker's state (pid, when it started, its queue and
  outcome counts), written once it serves and every `BEAT` seconds after (`Heartbeat`);
  `/health` lists them (`WorkerBoard`).

A worker that exits while the server runs is logged and replaced under the same index,
its live gauges first marked dead (`prometheus_client.multiprocess.mark_process_dead`;
its counters keep counting in the sums). The connections it held close with it: their
clients see the stream end without ``[DONE]`` (a connection reset or an incomplete
read) at once, not a hang, and so do connections waiting in its socket's queue, not yet
accepted; new connections go to the other workers. A replacement that exits before it
serves is retried after a delay that doubles up to `MAX_RETRY_DELAY`. A worker whose
supervisor is gone stops by itself (and removes the folder).

SIGTERM or SIGINT to the supervisor stops the workers (SIGTERM to each: uvicorn's
graceful shutdown, up to its timeout), kills what is left after `STOP_GRACE` seconds,
and removes the folder.

uvicorn's own `Multiprocess` supervisor also restarts dead workers, but it builds the
app in each worker from an import string and offers no hook where a dead worker's
metrics can be marked dead or its state cleared; the app here is built from the parsed
flags instead, and worker 0's startup checks decide the exit status.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .metrics import MULTIPROC_ENV

__all__ = [
    "BEAT",
    "MAX_RETRY_DELAY",
    "STOP_GRACE",
    "Heartbeat",
    "Seat",
    "WorkerBoard",
    "listener_for",
    "shared_address",
    "supervise",
]

logger = logging.getLogger("tokentrail.server")

#: Seconds between two writes of a worker's state file.
BEAT = 1.0
#: Most seconds between two tries to replace a worker that keeps dying before it serves.
MAX_RETRY_DELAY = 30.0
#: Seconds the workers have to stop once told (uvicorn's graceful shutdown is 5 s).
STOP_GRACE = 10.0
#: Seconds worker 0 (and then the others) may take to load and start serving.
START_TIMEOUT = 600.0

#: What one worker process runs: (parsed flags, the socket, its seat); it exits with the
#: server's status.
Target = Callable[[Any, socket.socket, "Seat"], None]

#: The parts of the app's `/health` a worker's state file keeps.
STATE_KEYS = ("status", "model", "active", "queued", "completed", "cancelled", "failed",
              "rejected", "dropped", "generated_tokens")  # fmt: skip


@dataclass(frozen=True)
class Seat:
    """What a worker process is told: its `index` (0 to N-1; a replacement takes the
    index of the worker it replaces), the shared `folder` and the supervisor's pid."""

    index: int
    folder: str
    supervisor: int

    def state_file(self) -> Path:
        return Path(self.folder) / f"worker-{self.index}.json"


class WorkerBoard:
    """The workers' state files in the shared folder, as `/health` lists them."""

    def __init__(self, folder: str, pid: int | None = None) -> None:
        self.folder = Path(folder)
        self.pid = os.getpid() if pid is None else pid

    def read(self) -> list[dict[str, Any]]:
        """Each serving worker's last state, by index (a file being replaced is skipped)."""
        found = []
        for path in sorted(self.folder.glob("worker-*.json")):
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        return sorted(found, key=lambda s: s.get("index", 0))

    def health(self, own: Mapping[str, Any]) -> dict[str, Any]:
        """`own` (the answering worker's `/health`) with ``worker`` (its pid) and
        ``workers`` (every worker's state) added."""
        return {**own, "worker": self.pid, "workers": self.read()}


class Heartbeat:
    """A worker's thread writing its state file every `BEAT` seconds (the first write
    tells the supervisor it serves), and stopping the worker (`on_orphaned`) once its
    supervisor is gone."""

    def __init__(
        self, seat: Seat, stats: Callable[[], Mapping[str, Any]], on_orphaned: Callable[[], None]
    ) -> None:
        self.seat = seat
        self._stats = stats
        self._on_orphaned = on_orphaned
        self._started = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokentrail-heartbeat", daemon=True)

    def start(self) -> None:
        self.write()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def write(self) -> None:
        """Write the state file whole (a reader never sees half of one)."""
        stats = self._stats()
        state = {"index": self.seat.index, "pid": os.getpid(), "started": self._started,
                 "updated": time.time()}  # fmt: skip
        state.update((k, stats[k]) for k in STATE_KEYS if k in stats)
        path = self.seat.state_file()
        part = path.with_suffix(f".{os.getpid()}.part")
        part.write_text(json.dumps(state))
        os.replace(part, path)

    def _run(self) -> None:
        while not self._stop.wait(BEAT):
            if os.getppid() != self.seat.supervisor:
                logger.warning("worker %d: the supervisor is gone; stopping", self.seat.index)
                self._on_orphaned()
                # Nobody else will remove the shared folder; the files this worker has
                # open (its metrics) stay readable to it until it exits.
                shutil.rmtree(self.seat.folder, ignore_errors=True)
                return
            try:
                self.write()
            except OSError as e:  # the folder is gone: the supervisor is cleaning up
                logger.debug("worker %d: cannot write its state: %s", self.seat.index, e)


def _port_sharer(bound: socket.socket) -> socket.socket:
    """A new socket bound to `bound`'s address with ``SO_REUSEPORT`` (OSError if not)."""
    sock = socket.socket(bound.family, bound.type, bound.proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(bound.getsockname())
    except OSError:
        sock.close()
        raise
    return sock


def shared_address(bound: socket.socket) -> socket.socket:
    """`bound`'s address (its port chosen, and proved free, by a plain bind) held by a
    socket bound with ``SO_REUSEPORT``, which every worker's socket then binds too;
    `bound` is closed. Where the system has no ``SO_REUSEPORT``: `bound` itself."""
    if not hasattr(socket, "SO_REUSEPORT"):
        return bound
    try:  # both have SO_REUSEADDR and neither listens: Linux lets both bind
        sock = _port_sharer(bound)
    except OSError as e:
        raise UsageError(f"cannot share {bound.getsockname()[:2]} between workers: {e}") from None
    finally:
        bound.close()
    sock.set_inheritable(True)
    return sock


def listener_for(bound: socket.socket) -> socket.socket:
    """A socket for one worker: a new one bound to `bound`'s address where the system
    lets several sockets listen on one port and spreads connections over them
    (``SO_REUSEPORT``, which `bound` was bound with), else `bound` itself (shared)."""
    if not hasattr(socket, "SO_REUSEPORT") or not bound.getsockopt(
        socket.SOL_SOCKET, socket.SO_REUSEPORT
    ):
        return bound
    return _port_sharer(bound)


def _describe(code: int | None) -> str:
    if code is None:
        return "is running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class _Supervisor:
    """Starts, watches, replaces and stops the workers (see the module's docstring)."""

    def __init__(self, target: Target, args: Any, sock: socket.socket, count: int) -> None:
        self.target = target
        self.args = args
        self.sock = sock
        self.count = count
        self.folder = tempfile.mkdtemp(prefix="tokentrail-workers-")
        self.metrics_dir = os.path.join(self.folder, "prometheus")
        os.mkdir(self.metrics_dir)
        self.ctx = multiprocessing.get_context("spawn")
        self.procs: dict[int, Any] = {}
        self.served: set[int] = set()  # indices whose current process has served
        self.retry_at: dict[int, float] = {}  # index -> when to start it again
        self.failures: dict[int, int] = {}  # index -> deaths in a row before serving
        self.stopping = False

    def start(self, index: int) -> None:
        seat = Seat(index, self.folder, os.getpid())
        sock = listener_for(self.sock)
        proc = self.ctx.Process(
            target=self.target, args=(self.args, sock, seat), name=f"tokentrail-worker-{index}"
        )
        try:
            proc.start()
        finally:
            if sock is not self.sock:
                sock.close()  # the worker has its own copy: the socket dies with it
        self.procs[index] = proc
        self.served.discard(index)
        logger.debug("worker %d started (pid %d)", index, proc.pid)

    def serving(self, index: int) -> bool:
        """Whether worker `index`'s current process has written its state file."""
        if index in self.served:
            return True
        path = Seat(index, self.folder, 0).state_file()
        try:
            pid = json.loads(path.read_text()).get("pid")
        except (OSError, ValueError):
            return False
        if pid != self.procs[index].pid:
            return False
        self.served.add(index)
        self.failures.pop(index, None)
        return True

    def wait_serving(self, indices: list[int]) -> int | None:
        """Wait until the workers `indices` serve: None, or the status to exit with (a
        worker exited first, the supervisor was told to stop, or time ran out)."""
        deadline = time.monotonic() + START_TIMEOUT
        while not all(self.serving(i) for i in indices):
            if self.stopping:
                return 0
            for i in indices:
                code = self.procs[i].exitcode
                if code is not None:
                    # Status 2: the worker said why in one line (the CLI's contract).
                    level = logging.DEBUG if code == 2 else logging.ERROR
                    logger.log(level, "worker %d %s before it served", i, _describe(code))
                    return code if code > 0 else 1
            if time.monotonic() > deadline:
                logger.error("the workers did not start in %.0f s", START_TIMEOUT)
                return 1
            wait([self.procs[i].sentinel for i in indices], timeout=0.1)
        return None

    def model_name(self) -> str:
        try:
            state = json.loads(Seat(0, self.folder, 0).state_file().read_text())
        except (OSError, ValueError):
            return "the model"
        return str(state.get("model") or "the model")

    def reap(self, index: int) -> None:
        """Worker `index` has exited: clear what it left and plan its replacement."""
        proc = self.procs.pop(index)
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(proc.pid, self.metrics_dir)
        state = Seat(index, self.folder, 0).state_file()
        served = index in self.served
        self.served.discard(index)
        try:
            if json.loads(state.read_text()).get("pid") == proc.pid:
                state.unlink()
        except (OSError, ValueError):
            pass
        if self.stopping:
            return
        delay = 0.0
        if not served:
            self.failures[index] = self.failures.get(index, 0) + 1
            delay = min(MAX_RETRY_DELAY, 2.0 ** (self.failures[index] - 1))
        logger.warning("worker %d (pid %d) %s; starting a replacement%s", index, proc.pid,
                       _describe(proc.exitcode), f" in {delay:g} s" if delay else "")  # fmt: skip
        self.retry_at[index] = time.monotonic() + delay

    def watch(self) -> None:
        """Replace workers that exit, until told to stop."""
        while not self.stopping:
            now = time.monotonic()
            for index, due in list(self.retry_at.items()):
                if due <= now:
                    del self.retry_at[index]
                    self.start(index)
            for index in list(self.procs):
                self.serving(index)  # notes a replacement that now serves
            sentinels = [p.sentinel for p in self.procs.values()]
            if sentinels:
                wait(sentinels, timeout=0.5)
            else:
                time.sleep(0.5)  # every worker waits for its retry
            for index, proc in list(self.procs.items()):
                if proc.exitcode is not None:
                    self.reap(index)

    def stop(self) -> None:
        """SIGTERM to every worker, SIGKILL to those still there after `STOP_GRACE`."""
        self.stopping = True
        for proc in self.procs.values():
            if proc.exitcode is None:
                os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                logger.warning("worker pid %d did not stop in %g s; killing it", proc.pid,
                               STOP_GRACE)  # fmt: skip
                proc.kill()
                proc.join(5)
        for index in list(self.procs):
            self.reap(index)


def supervise(target: Target, args: Any, sock: socket.socket, count: int, url: str) -> int:
    """Serve on `sock`'s address (bound, not listening, with ``SO_REUSEPORT`` where the
    system has it) with `count` worker processes each running ``target(args, listener,
    seat)``, until SIGTERM or SIGINT; return the exit status."""
    sup = _Supervisor(target, args, sock, count)
    previous_env = os.environ.get(MULTIPROC_ENV)
    os.environ[MULTIPROC_ENV] = sup.metrics_dir  # the spawned workers inherit it

    def told_to_stop(signum: int, frame: Any) -> None:
        if not sup.stopping:
            logger.info("stopping %d workers (%s)", count, signal.Signals(signum).name)
        sup.stopping = True

    handlers = {sig: signal.signal(sig, told_to_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        sup.start(0)
        status = sup.wait_serving([0])
        if status is None:
            for index in range(1, count):
                sup.start(index)
            status = sup.wait_serving(list(range(1, count)))
        if status is None:
            logger.info("serving %s on %s (%d workers)", sup.model_name(), url, count)
            sup.watch()
            status = 0
        return status
    finally:
        sup.stop()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if previous_env is None:
            os.environ.pop(MULTIPROC_ENV, None)
        else:
            os.environ[MULTIPROC_ENV] = previous_env
        sock.close()
        shutil.rmtree(sup.folder, ignore_errors=True)
