"""The OpenAI-compatible server, tested as a real uvicorn process on loopback.

Two servers run for the module: the main one on the built-in demo model (or, when it
is not installed, a tiny random-weight Llama), driven with the official `openai`
client and raw httpx; and a stress one on a tiny random-weight Llama with a byte-level
tokenizer and an unbounded context (so a generation can be made to run for as long as a
test needs), a queue of 2 and a small body limit, for hang-ups, overload and the raw
bytes of tokens that are not valid UTF-8 on their own. The tokenizers library's own
decode is the oracle for every text.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import require

openai = require("openai")
require("mlx_lm")
require("uvicorn")

import tokentrail  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL = Path(tokentrail.__file__).resolve().parent / "demo_model"
STARTUP_TIMEOUT = 240.0  # seconds to import MLX and load a model on a busy CI box
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# -- model and server helpers (also used by test_page.py) ---------------------------------


def build_tiny_llama(out: Path, context: int = 4096) -> Path:
    """A 2-layer random-weight Llama over a byte-level tokenizer (one token per byte).

    Random weights emit arbitrary bytes, so most multi-byte characters are incomplete
    or invalid: the hard case for raw token bytes and held-back text.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    out.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": CHATML,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "clean_up_tokenization_spaces": False,
            }
        ),
        encoding="utf-8",
    )
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "vocab_size": len(vocab),
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": context,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config), encoding="utf-8")
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A `python -m tokentrail.server` process listening on loopback."""

    proc: subprocess.Popen[bytes]
    url: str
    model: str
    model_dir: Path
    log: Path

    def health(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/health", timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_server(model_dir: Path | None, log: Path, *args: str) -> Server:
    """Start the server (model_dir None: the built-in demo) and wait until it serves."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "tokentrail.server",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *args,
    ]
    if model_dir is not None:
        cmd += ["--model", str(model_dir)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        try:
            r = httpx.get(url + "/health", timeout=5)
            if r.status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server did not start in {STARTUP_TIMEOUT} s:\n{log.read_text()}")
        time.sleep(0.2)
    name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    return Server(proc, url, name, model_dir or DEMO_MODEL, log)


def pick_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """None for the installed demo model, else a freshly built tiny model."""
    if (DEMO_MODEL / "config.json").is_file():
        return None
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def special_ids(model_dir: Path) -> list[int]:
    data = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    return sorted(t["id"] for t in data.get("added_tokens", []) if t.get("special"))


def eos_id(model_dir: Path) -> int:
    """The id of the end-of-sequence token, as the model folder declares it."""
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
            if isinstance(eos, list) and eos:
                return int(eos[0])
            if isinstance(eos, int):
                return eos
    raise AssertionError(f"no eos_token_id in {model_dir}")


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


@pytest.fixture(scope="module")
def tok(server: Server) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(server.model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


# -- checks shared by tests ------------------------------------------------------------------


def ext(obj: Any) -> dict[str, Any]:
    """The tokentrail extension of an openai-client object or a plain dict."""
    if isinstance(obj, dict):
        return obj["tokentrail"]
    return obj.model_extra["tokentrail"]


def e_token_text(chunk: Any) -> str:
    """The text of a streamed chunk's token, as the extension names it."""
    return str(ext(chunk)["token"]["text"])


def check_token_bytes(tok: Any, specials: set[int], ids: list[int], raw: list[bytes]) -> None:
    """`raw` are the real bytes of `ids`: they decode as the tokenizer decodes them."""
    assert len(ids) == len(raw)
    plain = [(i, b) for i, b in zip(ids, raw, strict=True) if i not in specials]
    for i, b in plain:
        assert tok.decode([i]) == b.decode("utf-8", "replace"), (i, b)
    joined = b"".join(b for _, b in plain)
    assert joined.decode("utf-8", "replace") == tok.decode(ids, skip_special_tokens=True)


def check_attribution(chunk_exts: list[dict[str, Any]], n_tokens: int) -> None:
    """Every generated token appears, in order, in the segments (or the stop tokens)."""
    seen: list[int] = []
    for e in chunk_exts:
        for seg in e["segments"]:
            for t in seg["tokens"]:
                if not seen or seen[-1] != t["index"]:
                    seen.append(t["index"])
            assert seg["confidence"] is not None
            assert seg["confidence"]["n_tokens"] == len(seg["tokens"])
        for t in e.get("stop", {}).get("tokens", []):
            if not seen or seen[-1] != t["index"]:
                seen.append(t["index"])
    assert seen == list(range(n_tokens))


def wait_until_finished(server: Server, job_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Poll /health until job `job_id` is among the finished ones; return it and /health."""
    deadline = time.monotonic() + 120
    while True:
        h = server.health()
        done = [j for j in h["recent"] if j["id"] == job_id]
        if done:
            return done[0], h
        assert time.monotonic() < deadline, f"generation never stopped: {h}"
        time.sleep(0.05)


def sse_events(raw: bytes) -> list[str]:
    """Split an SSE body into its data payloads, checking the framing strictly."""
    assert raw.endswith(b"\n\n"), raw[-200:]
    events = raw[:-2].split(b"\n\n")
    out = []
    for event in events:
        assert event.startswith(b"data: "), event[:200]
        assert b"\n" not in event, event[:200]
        out.append(event[len(b"data: ") :].decode("utf-8"))
    return out


def stream_raw(url: str, path: str, body: dict[str, Any]) -> tuple[httpx.Response, list[Any]]:
    with httpx.Client(timeout=300) as c, c.stream("POST", url + path, json=body) as r:
        raw = r.read()
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    return r, [json.loads(e) for e in events[:-1]]


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
    assert e_token_text(c) == tok.id_to_token(eos)
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


# -- bad input ------------------------------------------------------------------------------------


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


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
            {"messages": MSG, "response_format": {"type": "json_object"}},
            400,
            "response_format",
        ),
        (CHAT, {"messages": MSG, "logprobs": "yes"}, 400, "logprobs"),
        (CHAT, {"messages": MSG, "logit_bias": {"-1": 5}}, 400, "logit_bias"),
        (CHAT, {"messages": MSG, "logit_bias": {"1": 500}}, 400, "logit_bias"),
        (CHAT, {"messages": MSG, "logit_bias": {"x": 1}}, 400, "logit_bias"),
        (CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        (CHAT, {"messages": MSG, "presence_penalty": 0.5}, 400, "presence_penalty"),
        (CHAT, {"messages": MSG, "model": "gpt-4o"}, 404, "model"),
        (CHAT, {"messages": MSG, "model": 7}, 400, "model"),
        (CHAT, {}, 400, "messages"),
        (CHAT, {"messages": []}, 400, "messages"),
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
        (CHAT, {"messages": "hi"}, 400, "messages"),
        (COMP, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        (COMP, {"prompt": "x", "logprobs": True}, 400, "logprobs"),
        (COMP, {"prompt": ["a", "b"]}, 400, "prompt"),
        (COMP, {"prompt": [10**9]}, 400, "prompt"),
        (COMP, {"prompt": 5}, 400, "prompt"),
        (COMP, {"prompt": "x", "echo": True}, 400, "echo"),
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
