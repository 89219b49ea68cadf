"""`tokentrail serve --upstream`: the proxy in front of real servers on loopback.

Upstreams, started here: llama.cpp's `llama-server` on SmolLM2-135M-Instruct (GGUF),
`tokentrail serve` itself on the demo model, and `mlx_lm.server` on the demo model. The
client is the official `openai` package, against the proxy.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.env import require
from tests.helpers.llamacpp import find_smollm2, llama_server_binary
from tests.helpers.net import free_port
from tests.helpers.servers import Server, launch, start_llama_server, start_server

require("uvicorn")
openai = require("openai")

DEMO = Path(__file__).resolve().parents[1] / "src" / "tokentrail" / "demo_model"
PROMPTS = [
    "Reply with three emoji and the word 你好.",
    "用中文写一句关于春天的话。",
    "Write a Python function that reverses a string. Only code.",
]


def ext(obj: Any) -> dict[str, Any]:
    return obj.model_extra["tokentrail"]


def attributed(exts: list[dict[str, Any]]) -> tuple[list[int], list[int], str]:
    """(indices of every token in the segments and stop tokens, refused indices, text).

    A token whose bytes straddle two segments is listed in each (invariant 3): it is
    counted once here, so `seen` is each token's index once, in order."""
    seen: list[int] = []
    refused: list[int] = []
    text = ""

    def note(index: int) -> None:
        if not seen or seen[-1] != index:
            seen.append(index)

    for e in exts:
        for seg in e.get("segments") or []:
            text += seg["text"]
            for t in seg["tokens"]:
                note(t["index"])
            refused += [r["index"] for r in seg.get("refused") or []]
        for t in (e.get("stop") or {}).get("tokens") or []:
            note(t["index"])
    return seen, refused, text


# -- llama.cpp ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    llama_server_binary()
    gguf = find_smollm2()
    server = start_llama_server(gguf, tmp_path_factory.mktemp("logs") / "llama-server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(llama: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    log = tmp_path_factory.mktemp("logs") / "proxy.log"
    gguf = llama.model_dir
    server = start_server(None, log, "--upstream", llama.url, "--tokenizer", str(gguf))
    yield server
    server.stop()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_chat_stream_through_the_proxy_attributes_every_token_once(
    proxy: Any, llama: Server, prompt: str
) -> None:
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x")
    messages = [{"role": "user", "content": prompt}]
    chunks = list(
        client.chat.completions.create(
            model=proxy.model,
            messages=messages,
            max_tokens=40,
            temperature=0,
            stream=True,
            logprobs=True,
            top_logprobs=3,
            stream_options={"include_usage": True},
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    exts = [ext(c) for c in chunks if c.model_extra.get("tokentrail")]
    n = next(c.usage.completion_tokens for c in chunks if c.usage)

    # Every completion token is attributed exactly once, in order.
    seen, refused, text = attributed(exts)
    assert seen == list(range(n))
    assert text == content
    assert set(refused) <= set(seen)

    # The content is the upstream's own for the same request (greedy).
    direct = httpx.post(
        llama.url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 40, "temperature": 0},
        timeout=120,
    ).json()
    assert content == direct["choices"][0]["message"]["content"]

    # Logprobs carry raw bytes: together they spell the content.
    entries = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == n
    # (A token llama.cpp sent neither id nor bytes for, at a cut-off end, has a special
    # token with no text standing for it: its bytes are that token's, not text.)
    fillers = {
        r["index"]
        for e in exts
        for s in e.get("segments") or []
        for r in s.get("refused") or []
        if "special token stands for it" in r["reason"]
    }
    finish = next(c.choices[0].finish_reason for c in chunks[::-1] if c.choices)
    if finish == "stop":
        fillers.add(n - 1)  # the end-of-turn token: its bytes are its name, not text
    joined = b"".join(bytes(e.bytes) for i, e in enumerate(entries) if i not in fillers)
    assert joined.decode("utf-8") == content
    # A token llama.cpp did not identify has no logprob: nothing is made up.
    for e, i in zip(entries, range(n), strict=True):
        assert (e.logprob is None) == (i in refused)


def test_completion_whole_response_through_the_proxy(proxy: Any, llama: Server) -> None:
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x")
    out = client.completions.create(
        model=proxy.model, prompt="def reverse(s):", max_tokens=24, temperature=0, logprobs=2
    )
    direct = httpx.post(
        llama.url + "/completion",
        json={"prompt": "def reverse(s):", "n_predict": 24, "temperature": 0},
        timeout=120,
    ).json()
    assert out.choices[0].text == direct["content"]
    seen, refused, text = attributed([ext(out)])
    assert seen == list(range(out.usage.completion_tokens)) and text == out.choices[0].text
    assert refused == []  # plain code: llama.cpp sent every token's id


def test_upstream_gone_is_an_openai_shaped_502(
    llama: Server, tmp_path_factory: pytest.TempPathFactory
) -> None:
    gguf = llama.model_dir
    other = start_llama_server(gguf, tmp_path_factory.mktemp("logs") / "doomed.log")
    log = tmp_path_factory.mktemp("logs") / "proxy-doomed.log"
    server = start_server(None, log, "--upstream", other.url, "--tokenizer", str(gguf))
    try:
        other.stop()
        r = httpx.post(
            server.url + "/v1/completions",
            json={"model": server.model, "prompt": "hi", "max_tokens": 4},
            timeout=60,
        )
        assert r.status_code == 502
        err = r.json()["error"]
        assert err["type"] == "upstream_error" and "upstream" in err["message"]
    finally:
        server.stop()


def test_bad_upstream_flags_exit_2_with_one_line(tmp_path: Path) -> None:
    import subprocess

    base = [sys.executable, "-m", "tokentrail", "serve", "--port", str(free_port())]
    cases = [
        (["--upstream", "http://127.0.0.1:9"], "--upstream needs --tokenizer"),
        (["--upstream", "ftp://x", "--tokenizer", str(DEMO)], "must be an http(s) URL"),
        (
            ["--upstream", f"http://127.0.0.1:{free_port()}", "--tokenizer", str(DEMO)],
            "cannot reach the upstream",
        ),
    ]
    for args, says in cases:
        proc = subprocess.run([*base, *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr


# -- tokentrail as the upstream ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tt_upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    require("mlx_lm", "the demo upstream runs on MLX")
    server = start_server(None, tmp_path_factory.mktemp("logs") / "tt-upstream.log")
    yield server
    server.stop()


def test_tokentrail_serve_as_the_upstream(
    tt_upstream: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    log = tmp_path_factory.mktemp("logs") / "proxy-tt.log"
    server = start_server(None, log, "--upstream", tt_upstream.url, "--tokenizer", str(DEMO))
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
        theirs = httpx.post(
            tt_upstream.url + "/v1/completions",
            json={**body, "model": tt_upstream.model},
            timeout=120,
        ).json()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        chunks = list(
            client.completions.create(model=server.model, stream=True, logprobs=1, **body)
        )
        ours_text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert ours_text == theirs["choices"][0]["text"]
        exts = [ext(c) for c in chunks if c.model_extra.get("tokentrail")]
        _, refused, text = attributed(exts)
        assert refused == [] and text == ours_text
        # The same ids, at the same indices, as the upstream's own extension.
        want = [
            (t["index"], t["id"]) for s in theirs["tokentrail"]["segments"] for t in s["tokens"]
        ]
        got = [(t["index"], t["id"]) for e in exts for s in e["segments"] for t in s["tokens"]]
        assert got == want
    finally:
        server.stop()


# -- mlx_lm.server as the upstream ---------------------------------------------------------------


@pytest.fixture(scope="module")
def mlx_upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require("mlx_lm", "mlx_lm.server is the upstream here")
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(DEMO)]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    log = tmp_path_factory.mktemp("logs") / "mlx.log"
    server = launch(cmd, log, f"http://127.0.0.1:{port}", path="/v1/models", any_status=True)
    yield server.url
    server.stop()


def test_mlx_lm_server_as_the_upstream_says_what_it_cannot_do(
    mlx_upstream: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    log = tmp_path_factory.mktemp("logs") / "proxy-mlx.log"
    server = start_server(None, log, "--upstream", mlx_upstream, "--tokenizer", str(DEMO))
    try:
        # It says, once, that mlx_lm.server streams no logprobs and takes no id prompts.
        assert "streams carry no logprobs" in log.read_text()
        body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        chunks = list(client.completions.create(model=server.model, stream=True, **body))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        exts = [ext(c) for c in chunks if c.model_extra.get("tokentrail")]
        seen, refused, seg_text = attributed(exts)
        assert seen == list(range(16)) and refused == [] and seg_text == text
        # The ids are the ones mlx_lm.server reports in its own (whole) response.
        theirs = httpx.post(
            mlx_upstream + "/v1/completions",
            json={**body, "prompt": "Once upon a time", "logprobs": True},
            timeout=120,
        ).json()
        want = [e["id"] for e in theirs["choices"][0]["logprobs"]["content"]]
        got = [t["id"] for e in exts for s in e["segments"] for t in s["tokens"]]
        assert got == want
    finally:
        server.stop()


def test_client_hanging_up_stops_the_upstream(
    llama: Server, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Closing the stream to the proxy closes the proxy's stream to llama-server, which
    stops generating long before its token limit. (A llama-server and a proxy of its
    own, so no earlier test's streams share it.) The oracle is llama-server's own count
    of decode calls (``llamacpp:n_decode_total`` on its ``/metrics``), one per token
    generated for a lone request: it must stop rising, far below the 1,500 tokens asked.
    (Its ``/slots`` was the oracle before; it sometimes reported the only slot idle while
    it streamed this request, in about one module run in three on a 2-core machine.)"""
    import time

    gguf = llama.model_dir
    own = start_llama_server(gguf, tmp_path_factory.mktemp("logs") / "hang-up.log",
                             metrics=True)  # fmt: skip
    log = tmp_path_factory.mktemp("logs") / "proxy-hang-up.log"
    proxy = start_server(None, log, "--upstream", own.url, "--tokenizer", str(gguf))
    try:
        _hang_up_and_watch(proxy, own, time)
    finally:
        proxy.stop()
        own.stop()


def _decodes(llama: Server) -> float:
    """llama-server's decode calls so far (its ``llamacpp:n_decode_total``)."""
    text = httpx.get(llama.url + "/metrics", timeout=10).raise_for_status().text
    for line in text.splitlines():
        if line.startswith("llamacpp:n_decode_total"):
            return float(line.split()[-1])
    raise AssertionError(f"llama-server's /metrics has no n_decode_total:\n{text[:500]}")


def _hang_up_and_watch(proxy: Any, llama: Server, time: Any) -> None:
    asked = 1500
    body = {
        "model": proxy.model,
        "messages": [{"role": "user", "content": "Tell me a very long story about a dragon."}],
        "max_tokens": asked,
        "temperature": 1.0,
        "seed": 3,
        "stream": True,
        # No early end: SmolLM2's <|endoftext|> and <|im_end|> are suppressed, so the
        # request really runs for 1500 tokens unless the hang-up stops it.
        "logit_bias": {"0": -100, "2": -100},
    }
    before = _decodes(llama)
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, timeout=120) as r:
        got, seen = [], []
        for line in r.iter_lines():
            seen.append(line)
            if line.startswith("data:"):
                got.append(line)
            if len(got) == 3:
                break
        assert len(got) == 3, (r.status_code, seen)
        at_hang_up = _decodes(llama) - before
    # 1500 tokens take llama-server over 10 s here; a cancelled request stops within a
    # few token times. Wait until the count holds still for a second.
    deadline = time.monotonic() + 30
    last = _decodes(llama)
    while True:
        time.sleep(1.0)
        now = _decodes(llama)
        if now == last:
            break
        assert time.monotonic() < deadline, "llama-server kept generating after the hang-up"
        last = now
    made = last - before
    assert at_hang_up >= 3, (at_hang_up, made)  # the proxied request did reach it
    assert made < asked / 3, f"llama-server went on to {made:.0f} of {asked} tokens"


def test_upstream_timeout_is_an_openai_shaped_504(tmp_path_factory: pytest.TempPathFactory) -> None:
    """An upstream that accepts the request but never answers: 504 upstream_timeout."""
    import json
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Slow(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            data = json.dumps({"data": [{"id": "m", "owned_by": "vllm"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            time.sleep(6)

    slow = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=slow.serve_forever, daemon=True).start()
    log = tmp_path_factory.mktemp("logs") / "proxy-slow.log"
    url = f"http://127.0.0.1:{slow.server_address[1]}"
    server = start_server(
        None, log, "--upstream", url, "--tokenizer", str(DEMO), "--upstream-timeout", "1"
    )
    try:
        r = httpx.post(
            server.url + "/v1/completions",
            json={"model": server.model, "prompt": "hi", "max_tokens": 4},
            timeout=60,
        )
        assert r.status_code == 504, r.text
        err = r.json()["error"]
        assert err["code"] == "upstream_timeout" and "within 1.0 s" in err["message"]
    finally:
        server.stop()
        slow.shutdown()


# -- vLLM's dialect (no vLLM runs here: its documented wire format, replayed) ---------------------


def test_vllm_dialect_asks_for_ids_and_reads_them(corpus: Path) -> None:
    """The engine asks a vLLM upstream for `return_token_ids` and
    `return_tokens_as_token_ids`, and turns its stream (the recording that follows vLLM's
    documented format, served here on loopback) into exactly its ids."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tokentrail import load_vocab
    from tokentrail.engines.upstream.engine import UpstreamEngine
    from tokentrail.sampling import SamplingParams

    data = Path(__file__).resolve().parent / "data" / "realign"
    entry = next(
        e
        for e in json.loads((data / "MANIFEST.json").read_text("utf-8"))
        if e["name"] == "vllm_completions_return_token_ids"
    )
    lines = (data / entry["file"]).read_text("utf-8").splitlines()
    asked: list[dict[str, Any]] = []

    class Replay(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, body: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            models = {"data": [{"id": "EleutherAI/pythia-1b", "owned_by": "vllm"}]}
            self._send(json.dumps(models).encode(), "application/json")

        def do_POST(self) -> None:
            asked.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            sse = "".join(f"data: {line}\n\n" for line in lines) + "data: [DONE]\n\n"
            self._send(sse.encode(), "text/event-stream")

    replay = ThreadingHTTPServer(("127.0.0.1", 0), Replay)
    threading.Thread(target=replay.serve_forever, daemon=True).start()
    try:
        vocab = load_vocab(corpus / "tokenizers" / entry["tokenizer"])
        engine = UpstreamEngine(f"http://127.0.0.1:{replay.server_address[1]}/v1", vocab)
        assert engine.dialect == "vllm" and engine.model == "EleutherAI/pythia-1b"
        prompt = [27128, 23120, 275, 1264, 20477, 27]
        steps = list(engine.generate(prompt, SamplingParams(top_logprobs=3), len(entry["ids"])))
    finally:
        replay.shutdown()
    (body,) = asked
    assert body["prompt"] == prompt and body["stream"] is True
    assert body["return_token_ids"] is True and body["return_tokens_as_token_ids"] is True
    assert body["logprobs"] == 3 and body["model"] == "EleutherAI/pythia-1b"
    assert [s.token for s in steps] == entry["ids"]
    assert all(s.refused is None for s in steps)  # type: ignore[attr-defined]
