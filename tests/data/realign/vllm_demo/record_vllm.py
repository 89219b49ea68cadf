"""Record real vLLM streams of the built-in demo model, as the proxy asks for them.

    python -m tests.data.realign.vllm_demo.record_vllm --vllm-python .venv-vllm/bin/python
        [--out DIR]     (from the repository root)

The server is vLLM's own OpenAI server (the version is written to MANIFEST.json; the CPU
build that ``scripts/setup_vllm.sh`` installs), started here on loopback with

    python -m vllm.entrypoints.openai.api_server --model src/tokentrail/demo_model \\
        --dtype float32 --max-model-len 512 --enforce-eager     (VLLM_CPU_KVCACHE_SPACE=1)

For every prompt (CJK, emoji, code, mixed scripts) and temperature (0, and 1.5 with a
fixed seed), the llama.cpp recorder's (`record_llamacpp.py`), it records one
``/v1/completions`` stream asked the way ``tokentrail serve --upstream`` asks a vLLM
upstream: the prompt as token ids (the chat template applied by vLLM's own
``/tokenize``), ``logprobs`` 5, ``return_token_ids``, ``return_tokens_as_token_ids``,
``skip_special_tokens`` false, ``stream_options`` ``include_usage``; ``min_tokens`` keeps
the end-of-text tokens away for the first `MIN` tokens so each stream is long enough to
time. Each stream is kept as the server sent it (one parsed SSE ``data:`` object a
line).

Ground truth: the same request once more without streaming (vLLM's ``token_ids`` and
logprobs for the whole answer). A recording is kept only if the stream's ids and text
equal the ground truth's, so the generation is known to be the same one. MANIFEST.json
lists, per recording, the ids, the text and ``usage``'s count. tokentrail is not used.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from tests.data.realign.llamacpp.record_llamacpp import PROMPTS, SEED, TEMPS
from tests.helpers.net import free_port

REPO = Path(__file__).resolve().parents[4]
HERE = Path(__file__).resolve().parent
DEMO = REPO / "src" / "tokentrail" / "demo_model"
N = 48
MIN = 32
TOP = 5
NAME = "demo"


def ask(prompt_ids: list[int], temp: float, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": NAME, "prompt": prompt_ids, "max_tokens": N, "min_tokens": MIN,
        "temperature": temp, "seed": SEED, "logprobs": TOP,
        "return_token_ids": True, "return_tokens_as_token_ids": True,
        "skip_special_tokens": False, "stream": stream,
    }  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def sse(client: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def read_stream(chunks: list[dict[str, Any]]) -> tuple[list[int], str, int | None]:
    """(ids, text, usage's completion count) of one recorded stream."""
    ids: list[int] = []
    text = ""
    total = None
    for c in chunks:
        for ch in c.get("choices") or []:
            ids += ch.get("token_ids") or []
            text += ch.get("text") or ""
        if c.get("usage"):
            total = c["usage"]["completion_tokens"]
    return ids, text, total


def record(client: httpx.Client, out: Path) -> list[dict[str, Any]]:
    manifest = []
    for pname, text in PROMPTS.items():
        messages = [{"role": "user", "content": text}]
        tok = client.post("/tokenize", json={"model": NAME, "messages": messages,
                                             "add_generation_prompt": True})  # fmt: skip
        tok.raise_for_status()
        prompt_ids = tok.json()["tokens"]
        for tname, temp in TEMPS.items():
            truth = client.post("/v1/completions", json=ask(prompt_ids, temp, False))
            truth.raise_for_status()
            choice = truth.json()["choices"][0]
            chunks = sse(client, ask(prompt_ids, temp, True))
            ids, streamed, total = read_stream(chunks)
            if ids != choice["token_ids"] or streamed != choice["text"]:
                raise SystemExit(f"{pname} {tname}: the stream is not the ground truth's")
            name = f"vllm_v1_completions_{pname}_{tname}"
            path = out / f"{name}.jsonl"
            path.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in chunks))
            manifest.append({
                "name": name, "file": path.name, "endpoint": "v1_completions",
                "prompt": text, "prompt_ids": prompt_ids, "temperature": temp, "seed": SEED,
                "ids": ids, "content": streamed, "usage_completion_tokens": total,
            })  # fmt: skip
            print(f"{name}: {len(ids)} tokens")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True, type=Path)
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    version = subprocess.run(
        [str(args.vllm_python), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    port = free_port()
    cmd = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model",
           str(DEMO), "--served-model-name", NAME, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "512", "--enforce-eager"]  # fmt: skip
    log = (args.out / "vllm.log").open("w")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as client:
            deadline = time.monotonic() + 900
            while True:
                try:
                    client.get("/v1/models").raise_for_status()
                    break
                except httpx.HTTPError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit("vLLM did not start: see vllm.log") from None
                    time.sleep(2)
            manifest = record(client, args.out)
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
        (args.out / "vllm.log").unlink()
    about = {"server": f"vLLM {version} (OpenAI server, CPU build)", "model": "demo_model",
             "recordings": manifest}  # fmt: skip
    (args.out / "MANIFEST.json").write_text(json.dumps(about, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
