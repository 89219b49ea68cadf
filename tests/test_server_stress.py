"""The server's limits on a tiny byte-level model: raw token bytes, body size, hang-ups
and overload, as a real uvicorn process on loopback.

The model is a tiny random-weight Llama with a byte-level tokenizer (one token per byte,
so most multi-byte characters come out incomplete or invalid) and an unbounded context
(so a generation can be made to run for as long as a test needs); the server has a queue
of 2, a small body limit and one sequence at a time. The tokenizers library's own decode
is the oracle for every text.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.helpers.env import require

openai = require("openai")
require("mlx_lm")
require("uvicorn")

from tests.helpers.models import build_tiny_llama, special_ids  # noqa: E402
from tests.helpers.responses import (  # noqa: E402
    check_attribution,
    check_token_bytes,
    stream_raw,
    wait_until_finished,
)
from tests.helpers.servers import Server, start_server  # noqa: E402

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


@pytest.fixture(scope="module")
def stress(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-stress"), context=1 << 20)
    srv = start_server(
        model_dir,
        tmp_path_factory.mktemp("logs") / "stress.log",
        "--max-queue",
        "2",
        "--max-body-bytes",
        "65536",
        "--model-name",
        "tiny-stress",
        "--max-batch",
        "1",
    )
    yield srv
    srv.stop()


# -- raw bytes -----------------------------------------------------------------


def test_bytes_are_raw_when_tokens_are_not_valid_utf8(stress: Server) -> None:
    """One token per byte: lead bytes are held back (empty content) yet reported."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(stress.model_dir / "tokenizer.json"))
    specials = special_ids(stress.model_dir)
    body = {
        "model": stress.model,
        "prompt": "héllo wörld ✓",
        "max_tokens": 120,
        "temperature": 1.0,
        "seed": 3,
        "logprobs": 2,
        "logit_bias": {str(i): -100 for i in specials},
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    _, chunks = stream_raw(stress.url, "/v1/completions", body)
    usage = chunks[-1]["usage"]
    chunks = chunks[:-1]
    assert len(chunks) == usage["completion_tokens"] == 120
    ids = [ch["tokentrail"]["token"]["id"] for ch in chunks]
    raw = [bytes(ch["tokentrail"]["token"]["bytes"]) for ch in chunks]
    text = "".join(ch["choices"][0]["text"] for ch in chunks)
    assert text == tok.decode(ids, skip_special_tokens=True)
    check_token_bytes(tok, set(specials), ids, raw)
    assert all(len(b) == 1 for b in raw)  # the real byte, not an encoded U+FFFD
    held = [ch for ch in chunks if ch["choices"][0]["text"] == ""]
    assert held, "some lead byte was held back until the next token decided it"
    listed = [t for ch in chunks for t in ch["choices"][0]["logprobs"]["tokens"]]
    for ch in held:
        assert ch["tokentrail"]["segments"] == []
        # Held back: listed later, with the token that completes its text, in OpenAI's
        # lossless form for a token that is not valid UTF-8 on its own.
        assert ch["choices"][0]["logprobs"]["tokens"] == []
        lone = bytes(ch["tokentrail"]["token"]["bytes"])
        assert "bytes:" + "".join(f"\\x{b:02x}" for b in lone) in listed
    assert len(listed) == 120
    check_attribution([ch["tokentrail"] for ch in chunks], 120)
    non_stream = httpx.post(
        stress.url + "/v1/completions",
        json={**body, "stream": False, "stream_options": None},
        timeout=300,
    ).json()
    assert non_stream["choices"][0]["text"] == text


# -- body size --------------------------------------------------------------------------------


def test_oversized_bodies_get_413(stress: Server) -> None:
    big = {"prompt": "x" * 70000, "max_tokens": 1}
    r = httpx.post(stress.url + COMP, json=big, timeout=60)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"}'

    r = httpx.post(
        stress.url + COMP,
        content=chunked(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert stress.health()["status"] == "ok"


# -- concurrency, hang-ups, overload --------------------------------------------------------------


def test_hang_up_stops_generation_and_next_request_is_served(stress: Server) -> None:
    specials = special_ids(stress.model_dir)
    body = {
        "model": stress.model,
        "prompt": "Once upon a time",
        "max_tokens": 100000,
        "temperature": 1.0,
        "seed": 9,
        "logit_bias": {str(i): -100 for i in specials},
        "stream": True,
    }
    before = stress.health()
    with httpx.Client(timeout=300) as c, c.stream("POST", stress.url + COMP, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        data = []
        for line in lines:
            if line.startswith("data: "):
                data.append(json.loads(line[6:]))
                if len(data) == 2:
                    break
        job_id = data[0]["id"]
        running = stress.health()["running"]
        assert running is not None and running["id"] == job_id
        at_hang_up = running["generated_tokens"]
    # Leaving the block closes the connection mid-stream.
    job, h = wait_until_finished(stress, job_id)
    assert job["outcome"] == "cancelled"
    assert job["generated_tokens"] < 100000
    # Stopped within a few dozen tokens of the hang-up (at ~100 tokens/s: well under a
    # second of slack for the loopback close to reach the server).
    assert job["generated_tokens"] - at_hang_up <= 64, (job, at_hang_up)
    assert h["active"] == 0
    assert h["cancelled"] == before["cancelled"] + 1
    assert stress.health()["generated_tokens"] == h["generated_tokens"]  # nothing runs on
    r = httpx.post(
        stress.url + COMP,
        json={"model": stress.model, "prompt": "abc", "max_tokens": 5, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] <= 5


def test_hang_up_while_not_streaming_stops_generation(stress: Server) -> None:
    specials = special_ids(stress.model_dir)
    body = {
        "model": stress.model,
        "messages": [{"role": "user", "content": "Go on forever."}],
        "max_tokens": 100000,
        "temperature": 1.0,
        "logit_bias": {str(i): -100 for i in specials},
    }
    before = stress.health()

    async def scenario() -> str:
        async with httpx.AsyncClient(timeout=300) as c:
            task = asyncio.create_task(c.post(stress.url + CHAT, json=body))
            while True:  # wait until it is generating, then hang up
                s = (await c.get(stress.url + "/health")).json()
                if s["running"] is not None and s["running"]["generated_tokens"] > 0:
                    break
                await asyncio.sleep(0.02)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return str(s["running"]["id"])

    job_id = asyncio.run(scenario())
    job, h = wait_until_finished(stress, job_id)
    assert job["outcome"] == "cancelled"
    assert job["generated_tokens"] < 100000
    assert h["cancelled"] == before["cancelled"] + 1


def test_overload_gets_429_with_retry_after_then_recovers(stress: Server) -> None:
    specials = special_ids(stress.model_dir)
    long_body = {
        "model": stress.model,
        "prompt": "Load",
        "max_tokens": 100000,
        "temperature": 1.0,
        "logit_bias": {str(i): -100 for i in specials},
        "stream": True,
    }
    before = stress.health()

    async def scenario() -> tuple[httpx.Response, dict[str, Any]]:
        async with httpx.AsyncClient(timeout=300) as c:

            async def hold() -> None:
                async with c.stream("POST", stress.url + COMP, json=long_body) as r:
                    async for _ in r.aiter_bytes():
                        pass

            # One runs, two wait (max_queue=2); the fourth is refused.
            tasks = [asyncio.create_task(hold()) for _ in range(3)]
            while True:
                s = (await c.get(stress.url + "/health")).json()
                if s["active"] == 1 and s["queued"] == 2:
                    break
                await asyncio.sleep(0.02)
            refused = await c.post(stress.url + COMP, json={**long_body, "stream": False})
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return refused, s

    refused, full = asyncio.run(scenario())
    assert full["queued"] == 2
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) >= 1
    err = refused.json()["error"]
    assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"

    oa = openai.OpenAI(base_url=stress.url + "/v1", api_key="unused", max_retries=0)
    deadline = time.monotonic() + 120
    while True:  # all three hung up: the running one stops, the queued ones never start
        h = stress.health()
        if h["active"] == 0 and h["queued"] == 0 and h["cancelled"] >= before["cancelled"] + 3:
            break
        assert time.monotonic() < deadline, h
        time.sleep(0.05)
    assert h["rejected"] == before["rejected"] + 1
    assert h["cancelled"] == before["cancelled"] + 3
    r = oa.completions.create(model=stress.model, prompt="after", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens <= 3
    assert stress.health()["status"] == "ok"


