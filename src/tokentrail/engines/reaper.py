"""Child processes that must not outlive this one: a watcher ends them if it dies.

An engine that runs its model in processes of its own (vLLM's ``EngineCore`` and its
workers) leaves them running when the process that started them is killed outright
(``kill -9``, the kernel's OOM killer): they are children of init from then on, each
holding its model's memory (2.3 GB for SmolLM2-135M on vLLM's CPU build), and nothing
stops them. A stopped or interrupted process shuts its engine down itself; only a
process that cannot run any code at its end needs someone else to do it.

`guard()` starts that someone: a small Python process (this file, run with ``-I``: the
standard library only) that holds the read end of a pipe whose write end only this
process holds. It blocks reading it. When this process ends in any way, the kernel
closes the write end and the watcher reads end-of-file: it sends SIGTERM to every
process that was this one's descendant when `guard` was called (each checked by its
start time, so a recycled pid is never hit), gives them `GRACE` seconds, then SIGKILL.
`Watcher.stand_down()` (after a clean shutdown) writes one byte instead: the watcher
exits and touches nothing.

Python's ``multiprocessing.resource_tracker`` is left alone: it exits by itself once
every process that uses it is gone, and it is what releases the shared memory and
semaphores the killed processes held.

Linux only (it reads ``/proc``); elsewhere `guard` returns None and does nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["GRACE", "Watcher", "descendants", "end", "guard", "start_time"]

#: Seconds the watcher gives the processes it ends between SIGTERM and SIGKILL.
GRACE = 10.0
#: A descendant whose command line has this in it is not ended (see the module).
SPARED = "multiprocessing.resource_tracker"
PROC = Path("/proc")


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat);
    None when there is no such process or it is a zombie (already ended)."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return None if fields[0] in ("Z", "X") else fields[19]


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in (PROC / str(pid) / "task").iterdir():
            with contextlib.suppress(OSError):
                out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _spared(pid: int) -> bool:
    try:
        cmdline = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return True  # gone already
    return SPARED.encode() in cmdline


def descendants(pid: int | None = None) -> list[tuple[int, str]]:
    """(pid, start time) of every process below `pid` (this one by default), depth first,
    leaving out the ones `SPARED` names."""
    out: list[tuple[int, str]] = []
    todo = _children(os.getpid() if pid is None else pid)
    while todo:
        child = todo.pop()
        start = start_time(child)
        if start is None:
            continue
        if not _spared(child):
            out.append((child, start))
        todo += _children(child)
    return out


class Watcher:
    """A running watcher (see the module); `stand_down` once the children are shut down."""

    def __init__(self, proc: subprocess.Popen[bytes], write_fd: int, pids: list[int]) -> None:
        self.proc = proc
        self.pids = pids
        self._fd: int | None = write_fd

    def stand_down(self) -> None:
        """Tell the watcher to exit without ending anything (once; later calls do nothing)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.write(fd, b"q")
        os.close(fd)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


def guard(before: list[tuple[int, str]] | None = None) -> Watcher | None:
    """Start a watcher over this process's descendants as they are now, less those in
    `before` (`descendants()` taken before the engine started: processes of the caller's
    own are not the engine's to end). None: not on Linux, or nothing to guard."""
    if not (PROC / "self" / "task").is_dir():
        return None
    found = [d for d in descendants() if d not in set(before or ())]
    if not found:
        return None
    read_fd, write_fd = os.pipe()  # neither end inherited by later children of ours
    args = [sys.executable, "-I", __file__]
    args += [f"{pid}:{start}" for pid, start in found]
    try:
        proc = subprocess.Popen(
            args, stdin=read_fd, stdout=subprocess.DEVNULL, start_new_session=True
        )
    finally:
        os.close(read_fd)
    return Watcher(proc, write_fd, [pid for pid, _ in found])


def end(targets: list[tuple[int, str]]) -> None:
    """SIGTERM to each target still running, up to `GRACE` seconds, SIGKILL to the rest."""

    def alive() -> list[tuple[int, str]]:
        return [(pid, start) for pid, start in targets if start_time(pid) == start]

    for pid, _ in alive():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid, _ in alive():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGHUP):  # a terminal's Ctrl-C is for the parent
        signal.signal(sig, signal.SIG_IGN)
    targets = []
    for arg in argv[1:]:
        pid, start = arg.split(":")
        targets.append((int(pid), start))
    word = os.read(0, 1)  # blocks until the parent writes or ends
    if word == b"":  # the parent is gone without standing us down
        end(targets)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv))
