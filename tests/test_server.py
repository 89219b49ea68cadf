"""The OpenAI-compatible server, tested as a real uvicorn process on loopback.

The server runs on the built-in demo model (or, when it is not installed, a tiny
random-weight Llama), one sequence at a time, driven with the official `openai` client
and raw httpx: models, chat, completions, SSE framing, bad input and concurrent streams.
The tokenizers library's own decode is the oracle for every text. The limits (hang-ups,
overload, body size) and raw token bytes run on a tiny byte-level model of their own in
tests/test_server_stress.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.env import require

openai = require("openai")
require("mlx_lm")
require("uvicorn")

import tokentrail  # noqa: E402
from tests.helpers.models import build_tiny_llama, eos_id, special_ids  # noqa: E402
from tests.helpers.responses import (  # noqa: E402
    check_attribution,
    check_token_bytes,
    ext,
    sse_events,
)
from tests.helpers.servers import DEMO_MODEL, Server, pick_model_dir, start_server  # noqa: E402

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = pick_model_dir(tmp_path_factory)
    # One sequence at a time: these tests pin the FIFO queue (tests/test_server_batch.py
    # covers the continuous batch).
    srv = start_server(
        model_dir, tmp_path_factory.mktemp("logs") / "main.log", "--max-queue", "8",
        "--max-batch", "1",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tok(server: Server) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(server.model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


# -- models, health ----------------------------------------------------------------------------


def test_models_lists_the_served_model(server: Server, client: Any) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    if server.model_dir == DEMO_MODEL:
        assert server.model == "tokentrail-demo"
    health = server.health()
    assert health["status"] == "ok"
    assert health["model"] == server.model
    assert health["max_queue"] == 8


# -- chat ----------------------------------------------------------------------------------------


def test_chat_stream_equals_non_stream_with_logprobs(server: Server, client: Any, tok: Any) -> None:
    kw: dict[str, Any] = {
        "model": server.model,
        "messages": [{"role": "user", "content": "What does the with statement do?"}],
        "temperature": 0.8,
        "seed": 11,
        "max_tokens": 40,
        "logprobs": True,
        "top_logprobs": 3,
    }
    full = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    content = full.choices[0].message.content
    lps = full.choices[0].logprobs.content
    n = full.usage.completion_tokens
    assert n == len(lps) >= 1
    assert full.choices[0].finish_reason in ("stop", "length")
    if full.choices[0].finish_reason == "length":
        assert n == 40

    # Usage comes last, alone; every other chunk carries exactly one token.
    # (The second request may reuse the first one's prompt cache: only cached_tokens differ.)
    assert chunks[-1].choices == []
    for field in ("completion_tokens", "prompt_tokens", "total_tokens"):
        assert getattr(chunks[-1].usage, field) == getattr(full.usage, field)
    token_chunks = chunks[:-1]
    assert len(token_chunks) == n
    assert token_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in token_chunks) == content
    assert [c.choices[0].finish_reason for c in token_chunks] == [None] * (n - 1) + [
        full.choices[0].finish_reason
    ]
    # Each token is listed once, in the chunk whose content its text went into (a
    # held-back token later, with its neighbours): the entries join to the content.
    streamed = [e for c in token_chunks for e in c.choices[0].logprobs.content]
    assert b"".join(bytes(e.bytes) for e in streamed) == content.encode()
    for a, b in zip(streamed, lps, strict=True):
        assert (a.token, a.bytes) == (b.token, b.bytes)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
        assert len(a.top_logprobs) == 3
        tops = [t.logprob for t in a.top_logprobs]
        assert tops == sorted(tops, reverse=True)

    # The extension: the token of each step, its segment, and the text oracle.
    exts = [ext(c) for c in token_chunks]
    assert [e["token"]["index"] for e in exts] == list(range(n))
    ids = [e["token"]["id"] for e in exts]
    specials = set(special_ids(server.model_dir))
    check_token_bytes(tok, specials, ids, [bytes(lp.bytes) for lp in lps])
    assert tok.decode(ids, skip_special_tokens=True) == content
    for c, e in zip(token_chunks, exts, strict=True):
        assert "".join(s["text"] for s in e["segments"]) == c.choices[0].delta.content
    check_attribution(exts, n)
    whole = ext(full)
    assert [s["text"] for s in whole["segments"]] == [
        s["text"] for e in exts for s in e["segments"]
    ]
    assert "".join(s["text"] for s in whole["segments"]) == content


def test_chat_max_completion_tokens_gives_length(server: Server, client: Any) -> None:
    bias = {str(i): -100 for i in special_ids(server.model_dir)}
    r = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Describe Python in detail."}],
        max_completion_tokens=7,
        temperature=0,
        logit_bias=bias,
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7
    assert r.choices[0].logprobs is None


def test_eos_token_is_reported_with_empty_text(server: Server, client: Any, tok: Any) -> None:
    eos = eos_id(server.model_dir)
    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=20,
            temperature=0,
            logit_bias={str(eos): 100},
            logprobs=True,
            stream=True,
        )
    )
    assert len(chunks) == 1
    (c,) = chunks
    assert c.choices[0].delta.content == ""
    assert c.choices[0].finish_reason == "stop"
    # Listed with the text it produced (none), not with '<|im_end|>' the content omits;
    # the extension still names it exactly.
    (entry,) = c.choices[0].logprobs.content
    assert (entry.token, entry.bytes) == ("", [])
    assert str(ext(c)["token"]["text"]) == tok.id_to_token(eos)
    e = ext(c)
    assert e["token"]["id"] == eos
    assert e["segments"] == [
        {
            "text": "",
            "tokens": [
                {
                    "index": 0,
                    "id": eos,
                    "start": 0,
                    "end": 0,
                    "logprob": e["token"]["logprob"],
                    "text": e["token"]["text"],
                    "bytes": e["token"]["bytes"],
                }
            ],
            "confidence": e["segments"][0]["confidence"],
        }
    ]


# -- completions --------------------------------------------------------------------------------


def test_completion_stream_equals_non_stream_with_logprobs(
    server: Server, client: Any, tok: Any
) -> None:
    prompt = "A list comprehension"
    kw: dict[str, Any] = {
        "model": server.model,
        "prompt": prompt,
        "temperature": 0.7,
        "seed": 5,
        "max_tokens": 32,
        "logprobs": 4,
    }
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    choice = full.choices[0]
    text = choice.text
    n = full.usage.completion_tokens
    assert full.usage.prompt_tokens == len(tok.encode(prompt).ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert len(lp.text_offset) == n
    assert all(1 <= len(t) <= 4 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    assert all(o <= len(text) for o in lp.text_offset)

    assert len(chunks) == n
    assert "".join(c.choices[0].text for c in chunks) == text
    # Tokens are listed in the chunk whose text they went into (see the chat test).
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset
    assert [
        v for c in chunks for v in c.choices[0].logprobs.token_logprobs
    ] == pytest.approx(lp.token_logprobs, abs=1e-5)
    exts = [ext(c) for c in chunks]
    ids = [e["token"]["id"] for e in exts]
    assert tok.decode(ids, skip_special_tokens=True) == text
    check_attribution(exts, n)
    # A token whose text is final at once starts where its offset says.
    for c, e in zip(chunks, exts, strict=True):
        segs = e["segments"]
        if segs and c.choices[0].logprobs.text_offset:
            off = c.choices[0].logprobs.text_offset[0]
            assert text[off : off + len(segs[0]["text"])] == segs[0]["text"]


def test_stop_string_trims_text_and_reports_its_tokens(server: Server, client: Any) -> None:
    bias = {str(i): -100 for i in special_ids(server.model_dir)}
    kw: dict[str, Any] = {
        "model": server.model,
        "prompt": "The dictionary type",
        "temperature": 0,
        "max_tokens": 40,
        "logit_bias": bias,
    }
    text = client.completions.create(**kw).choices[0].text
    windows = [
        text[i : i + 2]
        for i in range(len(text) // 2, len(text) - 1)
        if "\ufffd" not in text[i : i + 2] and text[i : i + 2].strip()
    ]
    if not windows:
        pytest.skip(f"the model's greedy text {text!r} has no usable stop string")
    stop = windows[0]
    expected = text[: text.index(stop)]
    full = client.completions.create(stop=[stop], **kw)
    assert full.choices[0].text == expected
    assert full.choices[0].finish_reason == "stop"
    assert ext(full)["stop"]["string"] == stop
    chunks = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    exts = [ext(c) for c in chunks]
    assert exts[-1]["stop"]["string"] == stop
    assert exts[-1]["stop"]["tokens"], "the tokens that carried the stop string are listed"
    check_attribution(exts, len(chunks))


def test_completion_prompt_as_token_ids(server: Server, client: Any, tok: Any) -> None:
    ids = tok.encode("Strings are").ids
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=8, temperature=0)
    by_text = client.completions.create(
        model=server.model, prompt="Strings are", max_tokens=8, temperature=0
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


# -- SSE framing and raw bytes -----------------------------------------------------------------


def test_sse_framing(server: Server) -> None:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Name a loop."}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
    }
    with (
        httpx.Client(timeout=300) as c,
        c.stream("POST", server.url + "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        raw = r.read()
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert len({ch["id"] for ch in chunks}) == 1
    assert all("usage" not in ch for ch in chunks)  # not asked for
    assert all(ch["choices"][0]["logprobs"] is None for ch in chunks)



# -- bad input ------------------------------------------------------------------------------------




@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (CHAT, {"messages": MSG, "temperature": "hot"}, 400, "temperature"),
        (CHAT, {"messages": MSG, "temperature": 2.5}, 400, "temperature"),
        (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
        (CHAT, {"messages": MSG, "max_tokens": 1.5}, 400, "max_tokens"),
        (CHAT, {"messages": MSG, "max_tokens": True}, 400, "max_tokens"),
        (CHAT, {"messages": MSG, "n": 99}, 400, "n"),  # at most 16 (and --max-batch)
        (CHAT, {"messages": MSG, "top_p": 0}, 400, "top_p"),
        (CHAT, {"messages": MSG, "top_k": "5"}, 400, "top_k"),
        (CHAT, {"messages": MSG, "min_p": 1.5}, 400, "min_p"),
        (CHAT, {"messages": MSG, "repetition_penalty": 0}, 400, "repetition_penalty"),
        (CHAT, {"messages": MSG, "seed": -1}, 400, "seed"),
        (CHAT, {"messages": MSG, "stop": [1, 2]}, 400, "stop"),
        (CHAT, {"messages": MSG, "stop": ""}, 400, "stop"),
        (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
        (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools"),
        (
            CHAT,
            {"messages": MSG, "response_format": {"type": "json_schema"}},  # no schema
            400,
            "response_format",
        ),
        (CHAT, {"messages": MSG, "logprobs": "yes"}, 400, "logprobs"),
        (CHAT, {"messages": MSG, "logit_bias": {"-1": 5}}, 400, "logit_bias"),
        (CHAT, {"messages": MSG, "logit_bias": {"1": 500}}, 400, "logit_bias"),
        (CHAT, {"messages": MSG, "logit_bias": {"x": 1}}, 400, "logit_bias"),
        (CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        (CHAT, {"messages": MSG, "frequency_penalty": -2.5}, 400, "frequency_penalty"),
        (CHAT, {"messages": MSG, "model": "gpt-4o"}, 404, "model"),
        (CHAT, {"messages": MSG, "model": 7}, 400, "model"),
        (CHAT, {}, 400, "messages"),
        (CHAT, {"messages": []}, 400, "messages"),
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
        (CHAT, {"messages": "hi"}, 400, "messages"),
        (COMP, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        (COMP, {"prompt": "x", "logprobs": True}, 400, "logprobs"),
        (COMP, {"prompt": [["a"], "b"]}, 400, "prompt"),
        (COMP, {"prompt": [10**9]}, 400, "prompt"),
        (COMP, {"prompt": 5}, 400, "prompt"),
        (COMP, {"prompt": "x", "echo": "yes"}, 400, "echo"),
        (COMP, {"prompt": "x", "best_of": 3}, 400, "best_of"),
        (COMP, {}, 400, "prompt"),
        (COMP, {"prompt": ""}, 400, "prompt"),
    ],
)
def test_bad_values_get_openai_errors_naming_the_field(
    server: Server, path: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"
    assert err["message"]
    if param is not None:
        assert param in err["message"] or param == "model"


@pytest.mark.parametrize(
    ("method", "path", "content", "status", "code"),
    [
        ("POST", CHAT, b"{not json", 400, "invalid_json"),
        ("POST", CHAT, b"", 400, "invalid_json"),
        ("POST", CHAT, b"[1, 2]", 400, "invalid_json"),
        ("POST", CHAT, b"\xff\xfe{}", 400, "invalid_json"),
        ("POST", COMP, b"[" * 50000, 400, "invalid_json"),
        ("GET", CHAT, b"", 405, "method_not_allowed"),
        ("GET", "/v1/nothing", b"", 404, "not_found"),
    ],
)
def test_malformed_requests_get_json_errors(
    server: Server, method: str, path: str, content: bytes, status: int, code: str
) -> None:
    r = httpx.request(
        method,
        server.url + path,
        content=content,
        timeout=60,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["code"] == code


def test_openai_client_sees_bad_request(server: Server, client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model, messages=MSG, n=99)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")


# -- concurrency, hang-ups, overload --------------------------------------------------------------


async def _stream_job(
    client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]
) -> tuple[str, list[int], str]:
    async with client.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        raw = await r.aread()
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    key = "delta" if path == CHAT else None
    parts = [
        (ch["choices"][0][key]["content"] if key else ch["choices"][0]["text"]) for ch in chunks
    ]
    ids = [ch["tokentrail"]["token"]["id"] for ch in chunks]
    return "".join(parts), ids, chunks[0]["id"]


def test_concurrent_streams_are_not_mixed_and_run_in_order(server: Server) -> None:
    jobs = [
        (CHAT, {"messages": [{"role": "user", "content": "What is a tuple?"}], "seed": 1}),
        (COMP, {"prompt": "The for statement", "seed": 2}),
        (CHAT, {"messages": [{"role": "user", "content": "Explain generators."}], "seed": 3}),
        (COMP, {"prompt": "Exceptions are", "seed": 4}),
    ]
    for _, body in jobs:
        body.update(
            model=server.model,
            stream=True,
            temperature=0.9,
            max_tokens=32,
            logit_bias={str(i): -100 for i in special_ids(server.model_dir)},
        )

    async def alone() -> list[tuple[str, list[int], str]]:
        async with httpx.AsyncClient(timeout=300) as c:
            return [await _stream_job(c, server.url, p, b) for p, b in jobs]

    queued: list[int] = []

    async def together() -> list[tuple[str, list[int], str]]:
        base = server.health()
        done_before = base["completed"] + base["cancelled"] + base["failed"]
        async with httpx.AsyncClient(timeout=300) as c:
            tasks = []
            for i, (p, b) in enumerate(jobs):
                tasks.append(asyncio.create_task(_stream_job(c, server.url, p, b)))
                # Start the next one only once this one is in the server (FIFO check).
                while True:
                    h = await c.get(server.url + "/health")
                    s = h.json()
                    queued.append(s["queued"])
                    done = s["completed"] + s["cancelled"] + s["failed"] - done_before
                    if s["active"] + s["queued"] + done >= i + 1:
                        break
                    await asyncio.sleep(0.01)
            return list(await asyncio.gather(*tasks))

    solo = asyncio.run(alone())
    both = asyncio.run(together())
    for (text_a, ids_a, _), (text_b, ids_b, _) in zip(solo, both, strict=True):
        assert ids_b == ids_a
        assert text_b == text_a
    assert len({t for t, _, _ in solo}) == 4, "different prompts and seeds, different texts"
    assert max(queued) >= 1, "some requests waited while another one ran"
    recent = [j["id"] for j in server.health()["recent"]]
    order = [job_id for _, _, job_id in both]
    assert [i for i in recent if i in order] == order  # served first come, first served


# -- the app in process ---------------------------------------------------------------------------


def test_create_app_with_a_model_loaded_in_this_thread(tmp_path: Path) -> None:
    """Weights loaded on the caller's thread serve from the worker thread; / and its
    static files are served."""
    from starlette.testclient import TestClient

    from tokentrail.server import create_app

    model, tokenizer = tokentrail.load(build_tiny_llama(tmp_path / "tiny"))
    expected = "".join(
        r.text for r in tokentrail.stream_generate(model, tokenizer, "abc", max_tokens=6)
    )
    app = create_app(model, tokenizer, model_name="in-process", max_queue=1)
    with TestClient(app) as c:
        r = c.post(COMP, json={"prompt": "abc", "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
        assert r.json()["model"] == "in-process"
        page = c.get("/")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert '<div id="output"' in page.text
        for asset in ("/static/page.js", "/static/page.css"):
            assert c.get(asset).status_code == 200
    with pytest.raises(ValueError, match="both model and tokenizer"):
        create_app(model, None)
