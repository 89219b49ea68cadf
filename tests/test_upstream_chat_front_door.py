"""`tokentrail serve --upstream URL --upstream-chat` goes through the server's one front
door (issue 28): the body cap (413), the same pydantic validation (a 400 naming
`param`), the same admission queue (429 when full, counted in /metrics), one shared
upstream client, and the server's one -inf rule for logprobs (-9999.0).

The upstream is `tokentrail serve` itself on the demo model (MLX on CPU), started here;
the client is the official `openai` package. The -inf case replays a recorded stream
from a small HTTP server of the test's own, since no real server here sends a -inf
logprob on a chat stream (Python's `json.dumps` writes one as ``-Infinity``).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.env import require
from tests.helpers.servers import Server, start_server

require("uvicorn")
openai = require("openai")

DEMO = Path(__file__).resolve().parents[1] / "src" / "tokentrail" / "demo_model"
MESSAGES = [{"role": "user", "content": "Tell me a story."}]
#: The proxy's limits here: one request at a time, none waiting, small bodies.
MAX_BODY = 4096


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require("mlx_lm", "the demo upstream runs on MLX")
    log = tmp_path_factory.mktemp("logs") / "upstream.log"
    server = start_server(None, log, log_level="info")  # info: its access log
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(upstream: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "proxy.log"
    args = ("--upstream", upstream.url, "--tokenizer", str(DEMO), "--upstream-chat",
            "--max-batch", "1", "--max-queue", "0", "--max-body-bytes", str(MAX_BODY))  # fmt: skip
    server = start_server(None, log, *args)
    yield server
    server.stop()


def client(server: Server) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def metric(server: Server, name: str, **labels: str) -> float:
    """One sample of the server's /metrics (0 when it has none yet)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" (\S+)"
    found = re.search(r"^" + pattern + r"$", text, re.M)
    return float(found.group(1)) if found else 0.0


def wait_idle(server: Server, within: float = 60.0) -> None:
    """Until the server runs no request (a generous bound: not a hang)."""
    deadline = time.monotonic() + within
    while server.health()["active"]:
        assert time.monotonic() < deadline, server.health()
        time.sleep(0.1)


def test_chat_is_the_upstreams_own_with_its_tokens(proxy: Server, upstream: Server) -> None:
    """The answer is the upstream's own chat answer (greedy), its tokens the upstream's ids."""
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    theirs = post(upstream, "/v1/chat/completions", {**body, "model": upstream.model}).json()
    chunks = list(
        client(proxy).chat.completions.create(
            model=proxy.model, stream=True, logprobs=True, **body
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == theirs["choices"][0]["message"]["content"]
    want = [t["id"] for s in theirs["tokentrail"]["segments"] for t in s["tokens"]]
    got: dict[int, int] = {}
    for c in chunks:
        for s in (c.model_extra.get("tokentrail") or {}).get("segments") or []:
            got.update({t["index"]: t["id"] for t in s["tokens"] or []})
    assert [got[k] for k in sorted(got)] == want


def test_oversized_body_is_413_as_on_the_main_path(proxy: Server) -> None:
    big = [{"role": "user", "content": "x" * (MAX_BODY + 1)}]
    r = post(proxy, "/v1/chat/completions", {"model": proxy.model, "messages": big})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"
    # The completions route (the main path) answers the same.
    main = post(proxy, "/v1/completions", {"model": proxy.model, "prompt": "x" * (MAX_BODY + 1)})
    assert main.status_code == 413 and main.json()["error"] == r.json()["error"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"n": 2}, "n"),
        ({"model": "another-model"}, "model"),
    ],
)
def test_bad_field_is_a_400_naming_param(proxy: Server, extra: dict[str, Any], param: str) -> None:
    r = post(proxy, "/v1/chat/completions", {"model": proxy.model, "messages": MESSAGES, **extra})
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


def test_one_upstream_client_is_kept_and_reused(proxy: Server, upstream: Server) -> None:
    """Requests one after another reach the upstream on one connection (its access log
    shows the same client port), and the proxy opened one client."""
    before = upstream.log.read_text()
    completed = metric(proxy, "tokentrail_generations_total", outcome="completed")
    tokens = metric(proxy, "tokentrail_generated_tokens_total")
    for stream in (False, True, False):
        body = {"model": proxy.model, "messages": MESSAGES, "max_tokens": 3, "stream": stream}
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            r.read()
    # The upstream writes its access line once its response is out, which can come after
    # the proxy's answer reached us: read the log until the third line is there.
    deadline = time.monotonic() + 30
    while True:
        logged = upstream.log.read_text()[len(before) :]
        ports = re.findall(r'127\.0\.0\.1:(\d+) "POST /v1/chat/completions', logged)
        if len(ports) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(ports) == 3 and len(set(ports)) == 1, logged[-2000:]
    # Counted as the batch's requests are.
    wait_idle(proxy)
    assert metric(proxy, "tokentrail_generations_total", outcome="completed") == completed + 3
    assert metric(proxy, "tokentrail_generated_tokens_total") == tokens + 9
    report = httpx.get(proxy.url + "/tokentrail/upstream", timeout=30).json()
    assert report["streams"]["chat_clients_opened"] == 1


# -- the -inf rule, on a recorded stream -------------------------------------------------------


def recorded_stream(ids: list[int], pieces: list[bytes]) -> bytes:
    """vLLM's chat stream shape for `ids` (one token a chunk), the first token's logprob
    and every alternative -inf, written as Python's json.dumps writes it (-Infinity)."""
    out = []
    for k, (tid, data) in enumerate(zip(ids, pieces, strict=True)):
        text = data.decode("utf-8")
        alt = {"token": text, "logprob": float("-inf"), "bytes": list(data)}
        entry = {"token": text, "logprob": float("-inf") if k == 0 else -0.5,
                 "bytes": list(data), "top_logprobs": [alt]}  # fmt: skip
        last = k == len(ids) - 1
        chunk = {"id": "x", "object": "chat.completion.chunk", "model": "m",
                 "choices": [{"index": 0, "delta": {"content": text}, "token_ids": [tid],
                              "logprobs": {"content": [entry]},
                              "finish_reason": "stop" if last else None}]}  # fmt: skip
        out.append(f"data: {json.dumps(chunk)}\n\n")
    out.append("data: [DONE]\n\n")
    return "".join(out).encode()


def send_json(handler: BaseHTTPRequestHandler, obj: Any) -> None:
    data = json.dumps(obj).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


@dataclass
class Replayed:
    """A proxy in front of the recorded stream; the stream stops after its first event
    until `gate` is set (it is, but while a test holds it)."""

    proxy: Server
    ids: list[int]
    gate: threading.Event


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replayed]:
    from tokentrail.vocab import load_vocab

    vocab = load_vocab(DEMO)
    ids = vocab.encode("Hello there")
    stream = recorded_stream(ids, [vocab.pieces[i] or b"" for i in ids])
    assert b"-Infinity" in stream
    head, _, rest = stream.partition(b"\n\n")
    gate = threading.Event()
    gate.set()

    class Replay(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            send_json(self, {"data": [{"id": "m", "owned_by": "vllm"}]})

        def do_POST(self) -> None:  # the body ends with the connection (HTTP/1.0)
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(head + b"\n\n")
            self.wfile.flush()
            gate.wait(120)
            self.wfile.write(rest)

    http = ThreadingHTTPServer(("127.0.0.1", 0), Replay)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{http.server_address[1]}"
    log = tmp_path_factory.mktemp("logs") / "proxy-replay.log"
    args = ("--upstream", url, "--tokenizer", str(DEMO), "--upstream-chat",
            "--max-batch", "1", "--max-queue", "0", "--upstream-timeout", "600")  # fmt: skip
    server = start_server(None, log, *args)
    yield Replayed(server, ids, gate)
    gate.set()
    server.stop()
    http.shutdown()


def test_minus_infinity_logprob_is_minus_9999_on_the_wire(replayed: Replayed) -> None:
    proxy, ids = replayed.proxy, replayed.ids
    body = {"model": proxy.model, "messages": MESSAGES, "logprobs": True, "top_logprobs": 1}
    chunks = list(client(proxy).chat.completions.create(stream=True, **body))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content or []]  # fmt: skip
    assert [e.logprob for e in entries] == [-9999.0] + [-0.5] * (len(ids) - 1)
    assert all(a.logprob == -9999.0 for e in entries for a in e.top_logprobs)
    tokens = [t for c in chunks for s in (c.model_extra.get("tokentrail") or {}).get("segments")
              or [] for t in s["tokens"]]  # fmt: skip
    assert [t["id"] for t in tokens] == ids
    assert tokens[0]["logprob"] == -9999.0 and tokens[0]["top_logprobs"][0]["logprob"] == -9999.0
    whole = client(proxy).chat.completions.create(**body)
    assert whole.choices[0].logprobs.content[0].logprob == -9999.0
    ext = whole.model_extra["tokentrail"]["segments"][0]["tokens"][0]
    assert ext["logprob"] == -9999.0


def test_full_queue_is_429_and_the_place_is_freed(replayed: Replayed) -> None:
    """With one place and no queue, a chat whose upstream answer is under way holds the
    place: another chat request, or a completion, is a 429 (counted as rejected, as on
    the main path); once it has ended the next one gets in."""
    proxy, gate = replayed.proxy, replayed.gate
    rejected = metric(proxy, "tokentrail_generations_total", outcome="rejected")
    body = {"model": proxy.model, "messages": MESSAGES, "stream": True}
    gate.clear()
    try:
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body,
                          timeout=120) as held:  # fmt: skip
            assert held.status_code == 200
            lines = held.iter_lines()
            assert next(lines).startswith("data:")  # the upstream's first token came
            with pytest.raises(openai.RateLimitError) as e:
                client(proxy).chat.completions.create(model=proxy.model, messages=MESSAGES)
            assert e.value.body["code"] == "queue_full"
            r = post(proxy, "/v1/completions", {"model": proxy.model, "prompt": "hi"})
            assert r.status_code == 429 and "Retry-After" in r.headers
            assert r.json()["error"]["code"] == "queue_full"
            gate.set()
            assert [line for line in lines if line][-1] == "data: [DONE]"
    finally:
        gate.set()
    assert metric(proxy, "tokentrail_generations_total", outcome="rejected") == rejected + 2
    wait_idle(proxy)  # freed once the answer is written out
    r = client(proxy).chat.completions.create(model=proxy.model, messages=MESSAGES)
    assert r.choices[0].message.content == "Hello there"


@pytest.mark.parametrize("stream", [True, False])
def test_hang_up_frees_the_place_while_the_upstream_is_silent(
    replayed: Replayed, stream: bool
) -> None:
    """A client that hangs up while the upstream sends nothing more: its place is freed
    at once (not when the upstream times out, 600 s here), counted as cancelled."""
    proxy, gate = replayed.proxy, replayed.gate
    cancelled = metric(proxy, "tokentrail_generations_total", outcome="cancelled")
    body = {"model": proxy.model, "messages": MESSAGES, "stream": stream}
    gate.clear()
    try:
        patience = httpx.Timeout(3.0, connect=30.0)  # then the client gives up and hangs up
        with (
            pytest.raises(httpx.ReadTimeout),
            httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body,
                         timeout=patience) as r,
        ):  # fmt: skip
            for _ in r.iter_lines():
                pass
        wait_idle(proxy, within=30.0)
    finally:
        gate.set()
    assert metric(proxy, "tokentrail_generations_total", outcome="cancelled") == cancelled + 1


# -- a whole upstream answer with a tool call (llama-server's shape), streamed on ----------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]  # fmt: skip
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def llama_whole(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, list[int]]]:
    """A proxy in front of a server that speaks llama-server's dialect and answers a
    request with tools whole (as llama-server must: no logprobs with tools + stream):
    a tool call whose text the tokens spell, in no text field."""
    from tokentrail.vocab import load_vocab

    vocab = load_vocab(DEMO)
    ids = vocab.encode(CALL)
    pieces = [vocab.pieces[i] or b"" for i in ids]
    entries = [{"id": i, "token": p.decode("utf-8"), "logprob": -0.25, "bytes": list(p),
                "top_logprobs": []} for i, p in zip(ids, pieces, strict=True)]  # fmt: skip
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    answer = {"id": "x", "object": "chat.completion", "model": "m",
              "choices": [{"index": 0, "finish_reason": "tool_calls",
                           "message": {"role": "assistant", "content": None,
                                       "tool_calls": [call]},
                           "logprobs": {"content": entries}}],
              "usage": {"prompt_tokens": 7, "completion_tokens": len(ids)}}  # fmt: skip
    sent: list[dict[str, Any]] = []

    class Whole(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            send_json(self, {"data": [{"id": "m", "owned_by": "llamacpp"}]})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            if self.path == "/v1/chat/completions":
                sent.append(body)
            send_json(self, answer)

    http = ThreadingHTTPServer(("127.0.0.1", 0), Whole)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{http.server_address[1]}"
    log = tmp_path_factory.mktemp("logs") / "proxy-llama-whole.log"
    server = start_server(None, log, "--upstream", url, "--tokenizer", str(DEMO), "--upstream-chat")
    yield server, ids
    server.stop()
    http.shutdown()
    # A request with tools went whole (the startup check sends others), with logprobs.
    with_tools = [b for b in sent if "tools" in b]
    assert with_tools and all(b["stream"] is False and b["logprobs"] for b in with_tools)


def test_a_whole_upstream_answer_with_a_tool_call_is_streamed_on(
    llama_whole: tuple[Server, list[int]],
) -> None:
    proxy, ids = llama_whole
    body = {"model": proxy.model, "messages": MESSAGES, "tools": TOOLS, "logprobs": True}
    chunks = list(client(proxy).chat.completions.create(stream=True, **body))
    pieces = [p for c in chunks if c.choices for p in c.choices[0].delta.tool_calls or []]
    assert [p.function.name for p in pieces] == ["get_weather"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    ext = next(c for c in reversed(chunks) if c.choices).model_extra["tokentrail"]
    segs = [s for c in chunks for s in (c.model_extra.get("tokentrail") or {}).get("segments")
            or []]  # fmt: skip
    listed = {t["index"]: t["id"] for s in segs for t in s["tokens"] or []}
    assert [listed[k] for k in sorted(listed)] == ids
    raw = b"".join(bytes(t["bytes"])[t["start"] : t["end"]]
                   for s in segs if s["channel"] == "tool_call" for t in s["tokens"])  # fmt: skip
    assert ext["tool_calls"][0]["raw"] == raw.decode() and "get_weather" in raw.decode()
    (field,) = [f for f in ext["fields"] if f["path"] == "/tool_calls/0/arguments/city"]
    assert field["value"] == "Paris" and field["tokens"]
    whole = client(proxy).chat.completions.create(**body)
    assert whole.choices[0].message.tool_calls[0].function.arguments == '{"city": "Paris"}'
    assert whole.choices[0].finish_reason == "tool_calls"
    assert whole.usage is not None and whole.usage.completion_tokens == len(ids)
