"""`tokentrail serve --workers N`: several processes on one socket, in front of an upstream.

Real processes and HTTP: the upstream is `tokentrail serve` itself on the demo model, the
proxy in front of it runs 2 workers, and the client is the official `openai` package.
Each worker names itself in an ``x-tokentrail-worker`` header (its pid) and `/health`
lists every worker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.env import require
from tests.helpers.servers import Server, start_server
from tokentrail.server.config import usable_cores, worker_count

require("uvicorn")
openai = require("openai")

DEMO = Path(__file__).resolve().parents[1] / "src" / "tokentrail" / "demo_model"
#: Prompts the demo model answers with all 24 tokens (no end-of-text token early).
PROMPTS = ["Once upon a time", "The cat sat", "In a hole in the ground", "Long ago"]
WORKER = "x-tokentrail-worker"
#: Seconds a killed worker's replacement may take to load and serve on a busy box.
REPLACE_TIMEOUT = 240.0
#: The demo model's end-of-text ids: barred to keep a stream going.
EOS_IDS = (0, 2)


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require("mlx_lm", "the demo upstream runs on MLX")
    server = start_server(None, tmp_path_factory.mktemp("logs") / "upstream.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(upstream: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The proxy with 2 workers; port 0 and the info log: `start_server` waits for the
    URL, which the supervisor logs once both workers serve."""
    log = tmp_path_factory.mktemp("logs") / "proxy.log"
    args = ("--upstream", upstream.url, "--tokenizer", str(DEMO), "--workers", "2")
    server = start_server(None, log, *args, port=0, log_level="info")
    yield server
    server.stop()
    assert server.proc.returncode == 0, server.log_tail()


def _ids(segments_of: list[dict[str, Any]]) -> list[tuple[int, int]]:
    return [(t["index"], t["id"]) for e in segments_of for s in e["segments"] for t in s["tokens"]]


def _stream(url: str, model: str, prompt: str) -> tuple[int, str, list[tuple[int, int]]]:
    """One streamed completion on a fresh connection: (the worker's pid, text, ids)."""
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
        raw = client.completions.with_raw_response.create(
            model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True, logprobs=1
        )
        chunks = list(raw.parse())
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    exts = [c.model_extra["tokentrail"] for c in chunks if c.model_extra.get("tokentrail")]
    return int(raw.headers[WORKER]), text, _ids(exts)


def _direct(upstream: Server, prompt: str) -> tuple[str, list[tuple[int, int]]]:
    body = {"model": upstream.model, "prompt": prompt, "max_tokens": 24, "temperature": 0}
    theirs = httpx.post(upstream.url + "/v1/completions", json=body, timeout=120).json()
    return theirs["choices"][0]["text"], _ids([theirs["tokentrail"]])


def _worker_pids(server: Server) -> dict[int, int]:
    """/health's workers: index -> pid."""
    return {w["index"]: w["pid"] for w in server.health()["workers"]}


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped by its new parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _counter(server: Server, sample: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def _concurrent_streams(proxy: Server, rounds: int) -> list[tuple[int, str, list[Any]]]:
    """`rounds` x len(PROMPTS) streams, each round's at once."""
    results = []
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        for _ in range(rounds):
            results += pool.map(lambda p: _stream(proxy.url, proxy.model, p), PROMPTS)
    return results


def test_two_workers_serve_concurrent_streams_exactly(proxy: Server, upstream: Server) -> None:
    want = {p: _direct(upstream, p) for p in PROMPTS}
    served: set[int] = set()
    for _ in range(5):  # the kernel hands connections to whichever worker accepts first
        results = _concurrent_streams(proxy, 2)
        for (pid, text, ids), prompt in zip(results, PROMPTS * 2, strict=True):
            assert (text, ids) == want[prompt], prompt  # each stream is the upstream's
            served.add(pid)
        if len(served) == 2:
            break
    pids = _worker_pids(proxy)
    assert sorted(pids) == [0, 1]
    assert served == set(pids.values())  # both workers served streams


def test_a_reply_that_ends_on_the_models_second_end_token_ends_there(
    proxy: Server, upstream: Server
) -> None:
    """The demo model ends on id 2 as well as on its tokenizer's ``eos_token`` (id 0):
    its generation config lists both. "She said" ends on id 2 upstream, so the proxy's
    reply ends there too, with the same ids and no end token of its own added after."""
    text, ids = _direct(upstream, "She said")
    assert len(ids) < 24  # the upstream ended on an end token, not the limit
    _, proxied_text, proxied_ids = _stream(proxy.url, proxy.model, "She said")
    assert (proxied_text, proxied_ids) == (text, ids)


def test_metrics_sum_the_workers_and_health_reports_each(proxy: Server) -> None:
    sample = 'tokentrail_http_requests_total{path="/v1/completions",status="200"}'
    before = _counter(proxy, sample)
    results = _concurrent_streams(proxy, 3)
    assert len({pid for pid, _, _ in results}) == 2, "one worker took every request"
    assert _counter(proxy, sample) == before + len(results)
    # Each worker counts its own in its state; /metrics is their sum.
    done = 'tokentrail_generations_total{outcome="completed"}'
    deadline = time.monotonic() + 30
    while True:
        health = proxy.health()
        total = _counter(proxy, done)
        if sum(w["completed"] for w in health["workers"]) == total or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert sum(w["completed"] for w in health["workers"]) == total
    assert all(w["completed"] > 0 for w in health["workers"])
    assert health["worker"] in {w["pid"] for w in health["workers"]}


def test_a_killed_worker_drops_its_stream_and_is_replaced(proxy: Server) -> None:
    with openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0) as client:
        raw = client.completions.with_raw_response.create(
            model=proxy.model, prompt="Once upon a time", max_tokens=480, temperature=0,
            stream=True, logit_bias={str(i): -100 for i in EOS_IDS},
        )
        victim = int(raw.headers[WORKER])
        chunks = iter(raw.parse())
        next(chunks)  # the stream is under way
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        finish = None
        with pytest.raises((httpx.TransportError, openai.APIError)):
            for chunk in chunks:
                finish = chunk.choices[0].finish_reason if chunk.choices else finish
        ended_in = time.monotonic() - killed_at
    assert finish is None  # it did not run to its end
    assert ended_in < 10, f"the stream hung {ended_in:.1f} s after its worker died"

    deadline = time.monotonic() + REPLACE_TIMEOUT
    while True:
        pids = _worker_pids(proxy)
        if len(pids) == 2 and victim not in pids.values():
            break
        assert proxy.proc.poll() is None, proxy.log_tail()
        assert time.monotonic() < deadline, f"no replacement in /health: {pids}"
        time.sleep(1)
    assert "was killed by SIGKILL; starting a replacement" in proxy.log.read_text()
    # The replacement serves: fresh connections reach it, and exactly.
    fresh = set(pids.values())
    seen: set[int] = set()
    for _ in range(10):
        seen |= {pid for pid, _, _ in _concurrent_streams(proxy, 1)}
        if seen == fresh:
            break
    assert seen == fresh


def test_a_port_the_workers_serve_is_in_use_for_another_server(proxy: Server) -> None:
    """The workers' sockets share their port with each other only: a second server with
    workers on it is refused (exit 2, one line), as any server on a port in use."""
    r = subprocess.run(
        [sys.executable, "-m", "tokentrail", "serve", "--port", str(proxy.port), "--workers",
         "2", "--upstream", "http://127.0.0.1:9", "--tokenizer", str(DEMO)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "Address already in use" in lines[0], lines


def test_workers_are_refused_for_an_engine_in_this_process() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "tokentrail", "serve", "--port", "0", "--workers", "2",
         "--engine", "mlx"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "--workers 2 needs --upstream" in lines[0], lines
    assert "one process" in lines[0]


def test_auto_is_the_usable_cores() -> None:
    assert worker_count("auto") == usable_cores() == len(os.sched_getaffinity(0))
    assert worker_count("3") == 3


def test_an_upstream_that_does_not_answer_exits_2_with_one_line() -> None:
    """Worker 0 proves the configuration: its one line is the only one, its status the
    server's."""
    from tests.helpers.net import free_port

    r = subprocess.run(
        [sys.executable, "-m", "tokentrail", "serve", "--port", "0", "--workers", "2",
         "--upstream", f"http://127.0.0.1:{free_port()}", "--tokenizer", str(DEMO)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "cannot reach the upstream" in lines[0], lines


def test_workers_stop_when_their_supervisor_is_killed(
    upstream: Server, tmp_path: Path
) -> None:
    """SIGKILL leaves the supervisor no time to stop its workers: they notice it is gone
    and stop themselves, freeing the port."""
    args = ("--upstream", upstream.url, "--tokenizer", str(DEMO), "--workers", "2")
    server = start_server(None, tmp_path / "proxy.log", *args, port=0, log_level="info")
    pids: list[int] = []
    try:
        pids = list(_worker_pids(server).values())
        assert len(pids) == 2
        server.proc.kill()
        server.proc.wait(30)
        deadline = time.monotonic() + 30
        while any(_running(pid) for pid in pids):
            assert time.monotonic() < deadline, "orphaned workers kept running"
            time.sleep(0.5)
        with pytest.raises(httpx.TransportError):
            httpx.get(server.url + "/health", timeout=5)
    finally:
        server.stop()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
