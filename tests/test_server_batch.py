"""The continuous batch: concurrent requests decode together and never mix.

A real `tokentrail serve` (the demo model, `--max-batch 4`) on loopback, driven with the
official `openai` client and raw sockets. Each request's stream must equal the same
request served alone, whatever runs next to it; a client that stops reading must not
hold anybody up and must be dropped after `--client-timeout`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.helpers.env import require

openai = require("openai")
require("mlx_lm")
require("uvicorn")
prometheus_parser = require("prometheus_client.parser")

from tests.helpers.models import build_tiny_llama, special_ids  # noqa: E402
from tests.helpers.responses import (  # noqa: E402
    check_attribution,
    stream_raw,
    wait_until_finished,
)
from tests.helpers.servers import pick_model_dir, start_server  # noqa: E402

CLIENT_TIMEOUT = 2.0
#: Both servers: four sequences decode together; a client that stops reading is dropped.
BATCH = ("--max-batch", "4", "--client-timeout", str(CLIENT_TIMEOUT), "--log-level", "info")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model_dir = pick_model_dir(tmp_path_factory)
    log = tmp_path_factory.mktemp("logs") / "batch.log"
    srv = start_server(model_dir, log, *BATCH, "--max-queue", "8")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def long_context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A tiny random model with a context long enough for an endless stream."""
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-long"), context=1 << 20)
    srv = start_server(model_dir, tmp_path_factory.mktemp("logs") / "long.log", *BATCH)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def no_eos(server: Any) -> dict[str, float]:
    """logit_bias that keeps the model from ending (special tokens, EOS among them)."""
    return {str(i): -100 for i in special_ids(server.model_dir)}


def metrics(server: Any) -> dict[str, float]:
    """Every sample of /metrics, parsed by prometheus_client's own parser."""
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out: dict[str, float] = {}
    for family in prometheus_parser.text_string_to_metric_families(r.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


async def _stream(client: Any, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed request through the openai client: its text, ids and extensions."""
    create = client.chat.completions.create if kind == "chat" else client.completions.create
    stream = await create(stream=True, **body)
    text, ids, exts, finish = [], [], [], None
    async for chunk in stream:
        ext = chunk.model_extra["tokentrail"]
        exts.append(ext)
        ids.append(ext["token"]["id"])
        choice = chunk.choices[0]
        text.append((choice.delta.content or "") if kind == "chat" else choice.text)
        finish = choice.finish_reason or finish
    return {"text": "".join(text), "ids": ids, "exts": exts, "finish": finish}


def _requests(server: Any, no_eos: dict[str, float]) -> list[tuple[str, dict[str, Any]]]:
    """Four requests that differ in every setting a sequence carries."""
    m = server.model
    return [
        ("chat", {"model": m, "messages": [{"role": "user", "content": "What is a tuple?"}],
                  "max_tokens": 40, "temperature": 0, "logprobs": True, "top_logprobs": 3}),
        ("completion", {"model": m, "prompt": "The for statement", "max_tokens": 48,
                        "temperature": 0.9, "seed": 7, "logit_bias": no_eos}),
        ("chat", {"model": m, "messages": [{"role": "user", "content": "Explain generators."}],
                  "max_tokens": 32, "temperature": 0.7, "extra_body": {"top_k": 20}, "seed": 3,
                  "stop": ["\n\n", "."], "logit_bias": no_eos}),
        ("completion", {"model": m, "prompt": "Exceptions are", "max_tokens": 24,
                        "temperature": 0, "logprobs": 5, "logit_bias": no_eos}),
    ]


def _together(server: Any, jobs: list[tuple[str, dict[str, Any]]]) -> tuple[Any, Any, int]:
    """Each request served alone, then all at once; and the largest batch seen."""

    def new_client() -> Any:  # one per event loop
        return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

    async def alone() -> list[dict[str, Any]]:
        client = new_client()
        return [await _stream(client, kind, body) for kind, body in jobs]

    async def together() -> tuple[list[dict[str, Any]], int]:
        most = 0

        async def watch() -> None:
            nonlocal most
            async with httpx.AsyncClient(timeout=30) as c:
                while True:
                    most = max(most, (await c.get(server.url + "/health")).json()["batch_size"])
                    await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        client = new_client()
        out = await asyncio.gather(*(_stream(client, kind, body) for kind, body in jobs))
        watcher.cancel()
        return list(out), most

    solo = asyncio.run(alone())
    both, most = asyncio.run(together())
    return solo, both, most


def test_concurrent_clients_never_mix(server: Any, no_eos: dict[str, float]) -> None:
    jobs = _requests(server, no_eos)
    solo, both, most = _together(server, jobs)
    assert most >= 2, "the requests never decoded together"
    assert server.health()["batch_kind"]  # SerialBatch, or the engine's own
    for (_, body), a, b in zip(jobs, solo, both, strict=True):
        # Every generated token is attributed exactly once, in order, in every stream.
        check_attribution(b["exts"], len(b["ids"]))
        assert len(b["ids"]) == (body["max_tokens"] if b["finish"] == "length" else len(b["ids"]))
        if body["temperature"] == 0:  # greedy: the same tokens whatever runs beside it
            assert b["ids"] == a["ids"], body
            assert b["text"] == a["text"], body
            assert b["exts"] == a["exts"], body
            assert b["finish"] == a["finish"]
    assert len({r["text"] for r in solo}) == 4


def test_concurrent_seeded_sampling_never_mixes(server: Any, no_eos: dict[str, float]) -> None:
    jobs = [job for job in _requests(server, no_eos) if job[1]["temperature"] > 0]
    solo, both, most = _together(server, jobs)
    assert most >= 2
    for (_, body), a, b in zip(jobs, solo, both, strict=True):
        assert b["ids"] == a["ids"], body
        assert b["exts"] == a["exts"], body


def test_n_choices_are_sequences_of_the_batch(server: Any, no_eos: dict[str, float]) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    body = {"model": server.model, "prompt": "A list is", "max_tokens": 12,
            "temperature": 1.0, "seed": 11, "logit_bias": no_eos}
    whole = client.completions.create(n=3, **body)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.usage.completion_tokens == 36
    assert len({c.text for c in whole.choices}) > 1, "seeded choices should differ"
    ext = whole.model_extra["tokentrail"]
    assert [sum(len(s["text"]) for s in e["segments"]) for e in ext["choices"]] == [
        len(c.text) for c in whole.choices
    ]
    texts = ["", "", ""]
    for chunk in client.completions.create(n=3, stream=True, **body):
        i = chunk.choices[0].index
        assert chunk.model_extra["tokentrail"]["choice"] == i
        texts[i] += chunk.choices[0].text
    assert texts == [c.text for c in whole.choices]
    over = httpx.post(server.url + "/v1/completions", json={**body, "n": 5}, timeout=60)
    assert over.status_code == 400 and over.json()["error"]["param"] == "n"


def _stalled_stream(server: Any, no_eos: dict[str, float]) -> socket.socket:
    """A raw socket that asks for an endless stream and never reads a byte of it."""
    body = json.dumps({"model": server.model, "prompt": "Never read", "max_tokens": 100000,
                       "temperature": 1.0, "seed": 1, "logit_bias": no_eos,
                       "stream": True}).encode()
    port = int(server.url.rsplit(":", 1)[1])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )
    return sock


def _timed(server: Any, n: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions",
                   json={"model": server.model, "prompt": "Quick", "max_tokens": n,
                         "temperature": 0}, timeout=120)
    assert r.status_code == 200
    return time.perf_counter() - t0, r.json()["usage"]["completion_tokens"]


def test_stalled_client_delays_nobody_and_is_dropped(long_context: Any) -> None:
    server = long_context
    no_eos = {str(i): -100 for i in special_ids(server.model_dir)}
    _timed(server, 8)
    alone, n = _timed(server, 8)
    per_token = alone / n
    before = server.health()
    sock = _stalled_stream(server, no_eos)
    try:
        deadline = time.monotonic() + 30
        while server.health()["active"] == before["active"]:  # it is generating
            assert time.monotonic() < deadline
            time.sleep(0.02)
        busy, _ = _timed(server, 8)
        # Decoding beside one more sequence costs some time per step, never a wait for
        # the stalled one (before the batch, this waited until it finished: forever).
        assert busy < alone + max(0.5, 16 * per_token), (busy, alone)
        deadline = time.monotonic() + CLIENT_TIMEOUT + 30
        while True:
            h = server.health()
            if h["dropped"] == before["dropped"] + 1:
                break
            assert time.monotonic() < deadline, h
            time.sleep(0.1)
        assert h["active"] == 0 and h["batch_size"] == 0
        assert h["recent"][-1]["outcome"] == "dropped"
        # The server closes the connection: reading drains what it had sent, then EOF.
        sock.settimeout(CLIENT_TIMEOUT + 20)
        while sock.recv(65536):
            pass
    finally:
        sock.close()
    assert _timed(server, 4)[1] == 4


def test_cached_tokens_are_reported_and_counted(server: Any) -> None:
    body = {"model": server.model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me about dictionaries."}]}
    before = metrics(server)
    reported = 0
    for _ in range(2):  # the second turn resends the same prompt
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
        usage = r["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert 0 <= cached <= usage["prompt_tokens"]
        reported += cached
    after = metrics(server)
    key = "tokentrail_prompt_cache_hit_tokens_total"
    assert after[key] - before[key] == reported


def test_metrics_parse_and_move(server: Any) -> None:
    before = metrics(server)
    r = httpx.post(server.url + "/v1/completions",
                   json={"model": server.model, "prompt": "Count", "max_tokens": 6,
                         "temperature": 0, "stream": True}, timeout=60)
    assert r.status_code == 200
    n = sum(1 for line in r.text.splitlines() if line.startswith("data: {"))
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": 3}, timeout=60)
    assert bad.status_code == 400
    after = metrics(server)

    def moved(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert moved("tokentrail_http_requests_total{path=/v1/completions,status=200}") == 1
    assert moved("tokentrail_http_requests_total{path=/v1/completions,status=400}") == 1
    assert moved("tokentrail_generated_tokens_total") == n
    assert moved("tokentrail_generations_total{outcome=completed}") == 1
    assert moved("tokentrail_time_to_first_token_seconds_count") == 1
    assert moved("tokentrail_inter_token_latency_seconds_count") == n - 1
    assert after["tokentrail_queue_depth"] == 0
    assert after["tokentrail_batch_size"] == 0
    assert 'POST /v1/completions HTTP/1.1" 400' in server.log_tail()  # the access log


def test_a_hang_up_stops_only_its_own_sequence(server: Any, no_eos: dict[str, float]) -> None:
    keep = {"model": server.model, "prompt": "Dictionaries map", "max_tokens": 64,
            "temperature": 0, "logit_bias": no_eos, "stream": True}
    leave = {**keep, "prompt": "Sets hold", "max_tokens": 400}

    async def ids_of(c: httpx.AsyncClient, body: dict[str, Any], stop_after: int = 0) -> Any:
        out: list[int] = []
        job_id = None
        async with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    job_id = chunk["id"]
                    out.append(chunk["tokentrail"]["token"]["id"])
                    if stop_after and len(out) == stop_after:
                        break  # hang up mid-stream
        return out, job_id

    async def scenario() -> tuple[Any, Any, Any]:
        async with httpx.AsyncClient(timeout=120) as c:
            solo = await ids_of(c, keep)
            left, kept = await asyncio.gather(ids_of(c, leave, stop_after=5), ids_of(c, keep))
            return solo, left, kept

    (solo, _), (_, left_id), (kept, _) = asyncio.run(scenario())
    assert kept == solo and len(kept) == 64
    job, _ = wait_until_finished(server, left_id)
    assert job["outcome"] == "cancelled"
    assert job["generated_tokens"] < 400


def test_text_is_aligned_in_the_prompts_context(long_context: Any) -> None:
    """A prompt that ends in the middle of a character: the continuation's text is what
    the tokenizer decodes after the prompt's own final text, and the open prompt token
    is attributed (index -1) in the first segment that uses it."""
    from tokenizers import Tokenizer

    server = long_context
    tok = Tokenizer.from_file(str(server.model_dir / "tokenizer.json"))
    prompt = tok.encode("caf\u00e9").ids[:-1]  # "caf" and the lead byte of "é"
    no_eos = {str(i): -100 for i in special_ids(server.model_dir)}
    body = {"model": server.model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "logit_bias": no_eos, "stream": True}
    _, chunks = stream_raw(server.url, "/v1/completions", body)
    ids = [c["tokentrail"]["token"]["id"] for c in chunks]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == tok.decode(prompt + ids)[len("caf"):]
    spans = [t for c in chunks for s in c["tokentrail"]["segments"] for t in s["tokens"]]
    first = next(s for c in chunks for s in c["tokentrail"]["segments"] if s["text"])
    assert [t["index"] for t in spans if t["index"] < 0] == [-1]
    assert first["tokens"][0]["index"] == -1 and first["tokens"][0]["id"] == prompt[-1]
    seen: list[int] = []  # every generated token attributed, once, in order
    for t in spans:
        if t["index"] >= 0 and (not seen or seen[-1] != t["index"]):
            seen.append(t["index"])
    assert seen == list(range(len(ids)))
