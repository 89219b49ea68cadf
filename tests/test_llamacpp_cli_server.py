"""`tokentrail generate --engine llamacpp --model smollm2` end to end, and the server over
the llamacpp engine driven by the official `openai` client on loopback.

The server runs as a real uvicorn process built with `create_app(engine="llamacpp")`
(the engine registry, as `tokentrail serve` loads models). Oracle for texts and ids:
llama-cpp-python's own chat completion on a separate `Llama` over the same file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.env import require
from tests.helpers.net import free_port
from tests.helpers.servers import launch
from tokentrail import stream_generate

REPO = Path(__file__).resolve().parents[1]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
STARTUP_TIMEOUT = 180.0


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokentrail", *args], capture_output=True, text=True,
        timeout=300, cwd=REPO, check=False,
    )


def test_generate_cli_json_on_smollm2_equals_the_engine(smollm2_gguf: Path, smol: Any) -> None:
    res = cli("generate", "--engine", "llamacpp", "--model", "smollm2", "--chat", "--json",
              "--max-tokens", "12", "--top-logprobs", "3", CHAT[0]["content"])
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    engine, tok = smol
    want = list(stream_generate(engine, tok, CHAT, max_tokens=12, top_logprobs=3))
    assert [r["token"] for r in rows] == [r.token for r in want]
    assert "".join(r["text"] for r in rows) == "".join(r.text for r in want)
    assert all(len(r["top_logprobs"]) == 3 for r in rows)
    seen = sorted({t["index"] for r in rows for t in r["last_segment_tokens"]})
    assert seen == list(range(len(rows)))


def test_generate_cli_terminal_mode_prints_text_and_summary(smollm2_gguf: Path) -> None:
    res = cli("generate", "--engine", "llamacpp", "--model", str(smollm2_gguf), "--chat",
              "--max-tokens", "8", "Say hello.")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()
    assert "tokens/s" in res.stderr and "least confident segments" in res.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "{vocab}"], "vocabulary-only"),
        (["--model", "{missing}"], "not found"),
        (["--model", "{folder}"], "is a folder"),
    ],
)
def test_generate_cli_bad_gguf_exits_2_with_one_line(
    corpus: Path, llama_cpp: Any, tmp_path: Path, args: list[str], needle: str
) -> None:
    vocab = corpus / "tokenizers" / "llama2" / "ggml-vocab-llama-spm.gguf"
    subst = {"vocab": str(vocab), "missing": str(tmp_path / "nope.gguf"), "folder": str(tmp_path)}
    argv = [a.format(**subst) for a in args]
    res = cli("generate", "--engine", "llamacpp", *argv, "hi")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert needle in lines[0] and lines[0].startswith("tokentrail generate: error:")


# -- the server -------------------------------------------------------------------------------


SERVE = (
    "import sys, uvicorn\n"
    "from tokentrail.server import create_app\n"
    "app = create_app(model_path=sys.argv[1], engine='llamacpp', model_name='smollm2',\n"
    "                 load_options={'n_ctx': 2048})\n"
    "uvicorn.run(app, host='127.0.0.1', port=int(sys.argv[2]), log_level='warning')\n"
)


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require("uvicorn")
    port = free_port()
    log = tmp_path_factory.mktemp("llamacpp-serve") / "server.log"
    cmd = [sys.executable, "-c", SERVE, str(smollm2_gguf), str(port)]
    srv = launch(cmd, log, f"http://127.0.0.1:{port}", timeout=STARTUP_TIMEOUT)
    yield srv.url
    srv.stop()


def test_openai_chat_on_smollm2_answers_and_attributes_every_token(
    server: str, smol_ref: Any
) -> None:
    openai = require("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    kw: dict[str, Any] = {"model": "smollm2", "messages": CHAT, "temperature": 0,
                          "max_tokens": 24, "logprobs": True, "top_logprobs": 3}
    full = client.chat.completions.create(**kw)
    content = full.choices[0].message.content
    ref = smol_ref.create_chat_completion(CHAT, max_tokens=24, temperature=0.0)
    assert content == ref["choices"][0]["message"]["content"]
    assert content.strip()
    n = full.usage.completion_tokens
    assert n == len(full.choices[0].logprobs.content) >= 1

    chunks = list(client.chat.completions.create(stream=True, **kw))
    token_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in token_chunks) == content
    exts = [c.model_extra["tokentrail"] for c in token_chunks]
    assert [e["token"]["index"] for e in exts] == list(range(n))
    seen: list[int] = []
    for e in exts:
        for seg in e["segments"]:
            for t in seg["tokens"]:
                if not seen or seen[-1] != t["index"]:
                    seen.append(t["index"])
        for t in e.get("stop", {}).get("tokens", []):
            if not seen or seen[-1] != t["index"]:
                seen.append(t["index"])
    assert seen == list(range(n))
    # Each token is listed once, in the chunk its text went into (held-back ones later).
    streamed = [e for c in token_chunks for e in c.choices[0].logprobs.content]
    # Compared with a whole reply that finds the prompt cache as the stream did: the
    # stream reused the first reply's prompt and evaluated only its last token anew (as
    # llama-server does), and llama.cpp's logits at a position depend on the batch it
    # was evaluated in (its batch and single-token kernels differ; up to ~0.15 in a
    # logprob on this Q4_1 model with the portable x86-64 build), so a cold and a warm
    # reply may carry different logprobs for the same ids.
    warm = client.chat.completions.create(**kw)
    assert warm.choices[0].message.content == content
    for lp, b in zip(streamed, warm.choices[0].logprobs.content, strict=True):
        assert (lp.token, lp.bytes) == (b.token, b.bytes)
        assert lp.logprob == pytest.approx(b.logprob, abs=1e-5)
