"""What `tokentrail serve --upstream` asks its upstream for: only what the request needs.

A real llama-server runs the demo model's GGUF; between it and the proxy sits a small
recording HTTP server (real sockets, it forwards every request and streams the answer
back unchanged) that keeps the bodies the proxy sent. A client (the official `openai`
package) that asks no logprobs gets a reply whose segments carry llama-server's own ids
for the same prompt, while the proxy asked llama-server for ids only (``return_tokens``,
no ``n_probs``: no top-k sorted per token). A client that asks for alternatives still
has them asked for.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.env import require
from tests.helpers.servers import Server, start_llama_server, start_server

require("uvicorn")
openai = require("openai")

DEMO = Path(__file__).resolve().parents[1] / "src" / "tokentrail" / "demo_model"


class Recorder:
    """A forwarding HTTP server in front of `upstream` that records each POST body."""

    def __init__(self, upstream: str) -> None:
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                r = httpx.get(upstream + self.path, timeout=30)
                self._answer(r.status_code, r.headers.get("content-type", ""), [r.content])

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                recorder.bodies.append((self.path, json.loads(raw)))
                with httpx.stream(
                    "POST", upstream + self.path, content=raw, timeout=60,
                    headers={"Content-Type": "application/json"},
                ) as r:  # fmt: skip
                    self._answer(r.status_code, r.headers.get("content-type", ""), r.iter_raw())

            def _answer(self, status: int, kind: str, parts: Any) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for part in parts:
                    if part:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                        self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def completions(self) -> list[dict[str, Any]]:
        """The /completion bodies sent so far."""
        return [b for p, b in self.bodies if p == "/completion"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def setup(
    demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Recorder, Any]]:
    logs = tmp_path_factory.mktemp("logs")
    llama = start_llama_server(demo_gguf, logs / "llama-server.log", parallel=2)
    recorder = Recorder(llama.url)
    proxy = start_server(
        None, logs / "proxy.log", "--upstream", recorder.url, "--tokenizer", str(DEMO)
    )
    for _ in range(600):  # the proxy's startup check sends requests of its own: let it end
        if httpx.get(proxy.url + "/tokentrail/upstream", timeout=30).json()["status"] != "running":
            break
        time.sleep(0.2)
    yield llama, recorder, proxy
    proxy.stop()
    recorder.close()
    llama.stop()


def stream(proxy: Any, **options: Any) -> list[Any]:
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x")
    return list(
        client.chat.completions.create(
            model=proxy.model,
            messages=[{"role": "user", "content": "Write a short poem about the sea."}],
            max_tokens=24,
            temperature=0,
            stream=True,
            **options,
        )
    )


def segment_tokens(chunks: list[Any]) -> list[dict[str, Any]]:
    """Every token of the extension's segments, each once (by index), in order."""
    out: list[dict[str, Any]] = []
    for c in chunks:
        ext = (c.model_extra or {}).get("tokentrail") or {}
        for seg in ext.get("segments") or []:
            for t in seg["tokens"]:
                if not out or out[-1]["index"] != t["index"]:
                    out.append(t)
    return out


def test_no_logprobs_asks_ids_only_and_segments_keep_exact_ids(setup: Any) -> None:
    llama, recorder, proxy = setup
    before = len(recorder.completions())
    chunks = stream(proxy)
    (asked,) = recorder.completions()[before:]
    assert "n_probs" not in asked and asked["return_tokens"] is True
    # Greedy: no filters sent (they cannot change the choice), as a direct client asks.
    assert not {"top_k", "top_p", "min_p"} & set(asked)

    tokens = segment_tokens(chunks)
    assert [t["index"] for t in tokens] == list(range(len(tokens)))
    assert all(t["logprob"] is None and "top_logprobs" not in t for t in tokens)
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)
    # The ids are llama-server's own for the same prompt ids (greedy), asked directly.
    direct = httpx.post(
        llama.url + "/completion",
        json={k: asked[k] for k in ("prompt", "n_predict", "temperature")}
        | {"return_tokens": True},
        timeout=60,
    ).json()
    assert [t["id"] for t in tokens] == direct["tokens"][: len(tokens)]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == direct["content"][: len(text)] and text


def test_alternatives_asked_are_asked_upstream(setup: Any) -> None:
    _, recorder, proxy = setup
    before = len(recorder.completions())
    chunks = stream(proxy, logprobs=True, top_logprobs=2)
    (asked,) = recorder.completions()[before:]
    assert asked["n_probs"] == 2
    tokens = segment_tokens(chunks)
    assert tokens and all(isinstance(t["logprob"], float) for t in tokens)
    assert all(len(t["top_logprobs"]) == 2 for t in tokens)


def test_logprobs_without_alternatives_still_asks_for_logprobs(setup: Any) -> None:
    _, recorder, proxy = setup
    before = len(recorder.completions())
    chunks = stream(proxy, logprobs=True)
    (asked,) = recorder.completions()[before:]
    assert asked["n_probs"] == 1  # llama-server's least: the token's own logprob
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]  # fmt: skip
    assert entries and all(e.logprob <= 0 for e in entries)


def test_sampling_asks_for_no_filter_where_the_client_asked_none(setup: Any) -> None:
    """At a temperature above 0, the proxy states "no filter" (llama-server's defaults
    would keep the 40 likeliest tokens with p >= 0.05 of the top one and draw from
    those), so the token is drawn from the distribution the client asked for."""
    _, recorder, proxy = setup
    before = len(recorder.completions())
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x")
    reply = client.chat.completions.create(
        model=proxy.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=1.0, seed=7,
    )  # fmt: skip
    (asked,) = recorder.completions()[before:]
    assert (asked["top_k"], asked["top_p"], asked["min_p"]) == (0, 1.0, 0.0)
    assert asked["temperature"] == 1.0 and reply.choices[0].message.content is not None
