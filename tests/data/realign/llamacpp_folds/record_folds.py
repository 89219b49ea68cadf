"""Record real llama-server `/v1` streams that fold tokens, for the position tests.

    python tests/data/realign/llamacpp_folds/record_folds.py --gguf SmolLM2.Q4_1.gguf \
        [--server PATH/llama-server] [--out DIR]

The server and its flags are those of ../llamacpp/record_llamacpp.py (llama-server
0.5.0-dev from llama-cpp-python 0.3.36's sdist, ``-c 2048 -np 1 -t 2``). Each stream
here is one that folds, greedy (temperature 0):

- ``stop``: a stop string that starts inside one token and ends inside the next (chosen
  from the greedy text, ``n fro`` for SmolLM2); llama.cpp sends no entry for the token
  that straddles it and puts the text it held back on the entry of the token that
  completed the stop string;
- ``emoji_nousage``: emoji (several byte tokens folded into one entry each) without
  ``stream_options.include_usage``: nothing says how many tokens a fold held.

Ground truth for each: the same request to ``/completion`` without streaming, with
``return_tokens`` (the ids; llama.cpp's own), the prompt templated by the server's
``/apply-template``. MANIFEST.json lists the ids, each token's bytes (from the GGUF), the
content and usage's count (or null). tokentrail is not used.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "llamacpp"))
from record_llamacpp import SERVER, free_port, gguf_pieces, sse  # noqa: E402

N = 24
CASES: dict[str, dict[str, Any]] = {
    "stop": {"prompt": "Describe the history of mathematics in two sentences.",
             "stop": ["n fro"], "usage": True},
    "emoji_nousage": {"prompt": "Reply with three emoji and the word 你好.", "usage": False},
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--server", type=Path, default=SERVER)
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args()
    vocab = gguf_pieces(args.gguf)
    port = free_port()
    cmd = [str(args.server), "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-c", "2048", "-np", "1", "-t", "2", "--no-webui"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    manifest = []
    try:
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
        for _ in range(600):
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        for case, spec in CASES.items():
            messages = [{"role": "user", "content": spec["prompt"]}]
            prompt = client.post("/apply-template", json={"messages": messages}).json()["prompt"]
            stop = spec.get("stop") or []
            truth = client.post("/completion", json={
                "prompt": prompt, "n_predict": N, "temperature": 0, "return_tokens": True,
                "stream": False, "cache_prompt": False, "stop": stop}).json()  # fmt: skip
            body: dict[str, Any] = {"messages": messages, "max_tokens": N, "temperature": 0,
                                    "logprobs": True, "top_logprobs": 2, "stream": True}
            if stop:
                body["stop"] = stop
            if spec["usage"]:
                body["stream_options"] = {"include_usage": True}
            chunks = sse(client, "/v1/chat/completions", body)
            content = "".join((ch.get("delta") or {}).get("content") or ""
                              for c in chunks for ch in c.get("choices") or [])
            total = next((c["usage"]["completion_tokens"] for c in chunks if c.get("usage")),
                         None)  # fmt: skip
            name = f"llamacpp_folds_v1_chat_{case}"
            if content != truth["content"]:
                print(f"skipped {name}: {content!r} is not {truth['content']!r}")
                continue
            (args.out / f"{name}.jsonl").write_text(
                "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in chunks), "utf-8"
            )
            ids = truth["tokens"]
            manifest.append({"name": name, "file": f"{name}.jsonl", "endpoint": "v1_chat",
                             "prompt": spec["prompt"], "stop": stop, "temperature": 0,
                             "ids": ids, "bytes": [list(vocab[i]) for i in ids],
                             "content": content, "completion_tokens": total,
                             "stop_type": truth.get("stop_type")})  # fmt: skip
            print(f"{name}: {len(ids)} tokens")
    finally:
        proc.terminate()
        proc.wait(10)
    (args.out / "MANIFEST.json").write_text(
        json.dumps({"server": "llama-server 0.5.0-dev (llama-cpp-python 0.3.36 sdist)",
                    "model": args.gguf.name, "recordings": manifest},
                   indent=1, ensure_ascii=False) + "\n", "utf-8")  # fmt: skip


if __name__ == "__main__":
    main()
