"""`tokentrail.engines.reaper`: an engine's child processes do not outlive a parent that is
killed outright (vLLM's EngineCore did: 2.3 GB each, orphaned to init; the same guard runs
over a real `serve --engine vllm` in tests/test_vllm_server.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tokentrail.engines import reaper

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
SRC = str(Path(__file__).resolve().parents[1] / "src")

#: A parent with a child of the caller's own (started before `descendants()`), then an
#: "engine" child and a grandchild (started after), guarded; it prints the pids and waits.
PARENT = """
import subprocess, sys, time
from tokentrail.engines import reaper
own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
before = reaper.descendants()
engine = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys, time; "
    "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
    "print(g.pid, flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
grandchild = int(engine.stdout.readline())
g = reaper.guard(before)
print(own.pid, engine.pid, grandchild, g.proc.pid, sorted(g.pids), flush=True)
if sys.argv[1] == "stand-down":
    g.stand_down()
    print("stood down", g.proc.returncode, flush=True)
time.sleep(600)
"""


def running(pid: int) -> bool:
    return reaper.start_time(pid) is not None


def start(mode: str) -> tuple[subprocess.Popen[str], list[int]]:
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen(
        [sys.executable, "-c", PARENT, mode],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline().split(maxsplit=4)
    own, engine, grandchild, watcher = (int(v) for v in first[:4])
    # Guarded: the engine and its child, not the parent's own child (started before).
    assert first[4].strip() == str(sorted([engine, grandchild]))
    return proc, [own, engine, grandchild, watcher]


def wait_until(check: object, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


def test_a_killed_parent_takes_its_engine_processes_but_not_its_own_children() -> None:
    proc, (own, engine, grandchild, watcher) = start("keep")
    try:
        assert all(running(p) for p in (own, engine, grandchild, watcher))
        os.kill(proc.pid, signal.SIGKILL)  # the parent alone: no code of its runs at its end
        proc.wait(timeout=10)
        assert wait_until(lambda: not running(engine) and not running(grandchild)), (
            "the engine's processes outlived their killed parent"
        )
        assert wait_until(lambda: not running(watcher))  # its work done, the watcher exits
        assert running(own)  # not the engine's: left as it was
    finally:
        os.killpg(proc.pid, signal.SIGKILL)


def test_a_watcher_stood_down_ends_nothing() -> None:
    proc, (own, engine, grandchild, watcher) = start("stand-down")
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().split() == ["stood", "down", "0"]
        assert not running(watcher)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        time.sleep(1.0)
        assert running(engine) and running(grandchild)  # orphaned, as without a guard
    finally:
        for pid in (own, engine, grandchild):
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)


def test_a_recycled_pid_is_never_hit() -> None:
    # A target whose start time is not the running process's own: left alone.
    me = os.getpid()
    start = reaper.start_time(me)
    assert start is not None and start.isdigit()
    reaper.end([(me, str(int(start) + 1))])  # would be SIGTERM to this test if mistaken
    assert running(me)


def test_descendants_leave_out_zombies() -> None:
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    assert wait_until(lambda: not running(zombie.pid), 10)  # exited, not reaped: a zombie
    assert (Path("/proc") / str(zombie.pid)).exists()
    assert zombie.pid not in [pid for pid, _ in reaper.descendants()]
    zombie.wait()
