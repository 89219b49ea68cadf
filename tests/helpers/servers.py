"""Start a server process on loopback, wait until it answers, stop it.

One way for every server the tests run: `tokentrail.server` (`start_server`), llama.cpp's
`llama-server` (`start_llama_server`) and any other command (`launch`). A server that
exits or does not answer in time fails the calling test (or fixture) with its log.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import tokentrail
from tests.helpers.env import REPO
from tests.helpers.llamacpp import llama_server_binary
from tests.helpers.net import free_port

DEMO_MODEL = Path(tokentrail.__file__).resolve().parent / "demo_model"
#: Seconds to import MLX and load a model on a busy CI box.
STARTUP_TIMEOUT = 240.0
#: What `tokentrail serve` logs (at info) once it listens: the URL, so `--port 0` works.
SERVING = re.compile(r"serving \S+ on (http://127\.0\.0\.1:(\d+))")


@dataclass
class Server:
    """A server process listening on loopback, with its log."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    model: str = ""  # the model id it serves, when it says
    model_dir: Path | None = None  # the model folder (or GGUF file) it serves

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def health(self) -> dict[str, Any]:
        import httpx

        r = httpx.get(self.url + "/health", timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def client(self) -> Any:
        """The official `openai` client for this server: no retries, a long timeout."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=300)

    def stop(self) -> None:
        """Terminate the process (kill it if it does not exit in 20 s), then kill what it
        leaves in its process group: a server's children (vLLM's engine core, 2 GB or
        more) can outlive it, and would hold that memory for the rest of the run."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # `spawn` made it a group's leader


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Run `cmd` in the repository with stdout and stderr into `log`; do not wait."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with log.open("wb") as out:  # a session of its own: `Server.stop` ends its whole group
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=REPO,
                                start_new_session=True)


def _give_up(proc: subprocess.Popen[bytes], log: Path, why: str) -> None:
    Server(proc, "", log).stop()
    pytest.fail(f"{why}:\n{log.read_text(errors='replace')[-4000:]}", pytrace=False)


def wait_ready(
    proc: subprocess.Popen[bytes],
    log: Path,
    url: str,
    *,
    path: str = "/health",
    timeout: float = STARTUP_TIMEOUT,
    any_status: bool = False,
) -> None:
    """Poll `url + path` until it answers 200 (or anything, with `any_status`)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            _give_up(proc, log, f"server exited with {proc.returncode}")
        try:
            r = httpx.get(url + path, timeout=5)
            if any_status or r.status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            _give_up(proc, log, f"server did not start in {timeout} s")
        time.sleep(0.2)


def wait_for_log(
    proc: subprocess.Popen[bytes], log: Path, pattern: re.Pattern[str], timeout: float
) -> re.Match[str]:
    """Wait until `log` shows `pattern` (e.g. the URL a `--port 0` server logs)."""
    deadline = time.monotonic() + timeout
    while True:
        found = pattern.search(log.read_text(errors="replace"))
        if found is not None:
            return found
        if proc.poll() is not None:
            _give_up(proc, log, f"server exited with {proc.returncode}")
        if time.monotonic() > deadline:
            _give_up(proc, log, f"server did not log {pattern.pattern!r} in {timeout} s")
        time.sleep(0.1)


def launch(
    cmd: list[str],
    log: Path,
    url: str,
    *,
    path: str = "/health",
    timeout: float = STARTUP_TIMEOUT,
    any_status: bool = False,
    env: dict[str, str] | None = None,
) -> Server:
    """Start `cmd` (a server that will listen at `url`) and wait until it answers."""
    proc = spawn(cmd, log, env)
    wait_ready(proc, log, url, path=path, timeout=timeout, any_status=any_status)
    return Server(proc, url, log)


def start_server(
    model_dir: Path | None,
    log: Path,
    *args: str,
    port: int | None = None,
    log_level: str | None = "warning",
    api_key: str | None = None,
    timeout: float = STARTUP_TIMEOUT,
    env: dict[str, str] | None = None,
) -> Server:
    """Start `python -m tokentrail.server` (model_dir None: the built-in demo) and wait
    until it serves. `port=0` lets the server pick one and reads it from its log (which
    needs `log_level` "info" or None); `api_key` is passed as `--api-key` and sent."""
    import httpx

    port = free_port() if port is None else port
    cmd = [sys.executable, "-m", "tokentrail.server", "--port", str(port)]
    if log_level is not None:
        cmd += ["--log-level", log_level]
    if api_key is not None:
        cmd += ["--api-key", api_key]
    cmd += args
    if model_dir is not None:
        cmd += ["--model", str(model_dir)]
    proc = spawn(cmd, log, env)
    url = f"http://127.0.0.1:{port}" if port else ""
    if not port:
        url = wait_for_log(proc, log, SERVING, timeout).group(1)
    wait_ready(proc, log, url, timeout=timeout)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    models = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()
    return Server(proc, url, log, models["data"][0]["id"], model_dir or DEMO_MODEL)


def start_proxy(upstream: Server, log: Path, *flags: str) -> Server:
    """`tokentrail serve --upstream` in front of `upstream`, its model's tokenizer given
    as `--tokenizer` (`upstream.model_dir`), with `flags` besides."""
    return start_server(None, log, "--upstream", upstream.url, "--tokenizer",
                        str(upstream.model_dir), *flags)  # fmt: skip


def start_llama_server(
    gguf: Path, log: Path, *, parallel: int = 1, metrics: bool = False
) -> Server:
    """llama.cpp's own `llama-server` on `gguf` (2 threads, 2048 tokens per slot);
    `metrics`: with its Prometheus ``/metrics`` (``--metrics``)."""
    port = free_port()
    cmd = [str(llama_server_binary()), "-m", str(gguf), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "-c", str(2048 * parallel), "-np", str(parallel)]
    cmd += ["-t", "2", "--no-webui", *(["--metrics"] if metrics else [])]
    server = launch(cmd, log, f"http://127.0.0.1:{port}", timeout=120)
    server.model_dir = gguf
    return server


def llama_greedy(llama: Server, ids: list[int], n: int) -> list[int]:
    """llama-server's own greedy tokens after prompt `ids` (its native /completion), with
    SmolLM2's end-of-turn token (2) barred, as the proxy tests' requests bar it."""
    import httpx

    body = {"prompt": ids, "n_predict": n, "temperature": 0, "return_tokens": True,
            "logit_bias": [[2, -100.0]]}  # fmt: skip
    r = httpx.post(llama.url + "/completion", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


@contextlib.contextmanager
def llama_with_proxy(gguf: Path, logs: Path) -> Iterator[tuple[Server, Server]]:
    """llama-server on `gguf` and `tokentrail serve --upstream` in front of it, both
    stopped on leaving."""
    llama = start_llama_server(gguf, logs / "llama.log")
    try:
        proxy = start_proxy(llama, logs / "proxy.log")
        try:
            yield llama, proxy
        finally:
            proxy.stop()
    finally:
        llama.stop()


def pick_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """None for the installed demo model, else a freshly built tiny model."""
    from tests.helpers.models import build_tiny_llama

    if (DEMO_MODEL / "config.json").is_file():
        return None
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
