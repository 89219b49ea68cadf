"""`tokentrail serve --upstream` in front of llama-server vs llama-server directly.

Starts llama.cpp's `llama-server` on a GGUF model (SmolLM2-135M-Instruct by default)
with 16 parallel slots, and the proxy in front of it, both on loopback. For C = 1, 4, 16
concurrent streaming chat clients (the same prompts, greedy, the end-of-turn token
suppressed with logit_bias so each request makes exactly --max-tokens tokens), it runs
the direct and the proxied case alternately, --repeat times, and reports, side by side,
the median throughput (generated tokens per second, all clients together), its ratio
proxy/direct, and the median time to first token and what the proxy adds to it.

    python benchmarks/bench_proxy.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf \
        [--server PATH/llama-server] [--output benchmarks/results/proxy.md]

The proxy runs one generation at a time (tokentrail's server queue), so at C > 1 its
throughput is one stream's while llama-server's grows with its parallel slots: the
numbers show that cost as it is.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
SERVER = Path.home() / ".cache/tokentrail/llama.cpp-0.3.36/build/bin/llama-server"
PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a Python list is.",
    "用中文写一句关于春天的话。",
    "Describe a cat in three sentences.",
]
EOS = 2  # SmolLM2's <|im_end|>


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait(url: str, proc: subprocess.Popen[bytes], path: str = "/health") -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the server exited")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} did not start")


async def one(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, n: int
) -> tuple[int, float]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
        "logit_bias": {str(EOS): -100},
    }
    start = time.perf_counter()
    ttft = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or [{}]
            if ttft is None and (choices[0].get("delta") or {}).get("content"):
                ttft = time.perf_counter() - start
    return n, ttft if ttft is not None else float("nan")


async def run(url: str, clients: int, n: int) -> tuple[float, float]:
    """(tokens per second over all clients, median TTFT) for one round."""
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        start = time.perf_counter()
        results = await asyncio.gather(
            *(one(client, url, model, PROMPTS[k % len(PROMPTS)], n) for k in range(clients))
        )
        wall = time.perf_counter() - start
    return sum(t for t, _ in results) / wall, statistics.median(x for _, x in results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--server", type=Path, default=SERVER)
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    logs = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    lport, pport = free_port(), free_port()
    slots = max(levels)
    llama = subprocess.Popen(
        [
            str(args.server),
            "-m",
            str(args.gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(lport),
            "-c",
            str(512 * slots),
            "-np",
            str(slots),
            "-t",
            "2",
            "--no-webui",
        ],
        stdout=(logs / "llama.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    direct = f"http://127.0.0.1:{lport}"
    proxy = None
    try:
        wait(direct, llama)
        env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
        proxy = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tokentrail",
                "serve",
                "--upstream",
                direct,
                "--tokenizer",
                str(args.gguf),
                "--port",
                str(pport),
                "--log-level",
                "warning",
                "--max-queue",
                str(4 * slots),
            ],
            stdout=(logs / "proxy.log").open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        proxied = f"http://127.0.0.1:{pport}"
        wait(proxied, proxy)
        asyncio.run(run(direct, 1, 4))  # warm up both
        asyncio.run(run(proxied, 1, 4))
        rows = []
        for c in levels:
            d_tps, d_ttft, p_tps, p_ttft = [], [], [], []
            for _ in range(args.repeat):
                tps, ttft = asyncio.run(run(direct, c, args.max_tokens))
                d_tps.append(tps)
                d_ttft.append(ttft)
                tps, ttft = asyncio.run(run(proxied, c, args.max_tokens))
                p_tps.append(tps)
                p_ttft.append(ttft)
            row = {
                "clients": c,
                "direct_tok_s": statistics.median(d_tps),
                "proxy_tok_s": statistics.median(p_tps),
                "ratio": statistics.median(p_tps) / statistics.median(d_tps),
                "direct_ttft_ms": 1000 * statistics.median(d_ttft),
                "proxy_ttft_ms": 1000 * statistics.median(p_ttft),
            }
            row["added_ttft_ms"] = row["proxy_ttft_ms"] - row["direct_ttft_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for p in (proxy, llama):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(20)
    if args.output:
        lines = [
            "# Proxy (`tokentrail serve --upstream`) vs llama-server directly",
            "",
            f"Model {args.gguf.name}, {args.max_tokens} tokens per request, greedy, medians of "
            f"{args.repeat} alternating rounds; {platform.platform()}, "
            f"{os.cpu_count()} CPUs (shared). Command: `python benchmarks/bench_proxy.py "
            f"--gguf {args.gguf.name} --max-tokens {args.max_tokens} --repeat {args.repeat}`.",
            "",
            "| clients | direct tok/s | proxy tok/s | ratio | direct TTFT ms | proxy TTFT ms "
            "| added TTFT ms |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['clients']} | {r['direct_tok_s']:.1f} | {r['proxy_tok_s']:.1f} | "
                f"{r['ratio']:.2f} | {r['direct_ttft_ms']:.1f} | {r['proxy_ttft_ms']:.1f} | "
                f"{r['added_ttft_ms']:.1f} |"
            )
        args.output.write_text("\n".join(lines) + "\n", encoding="utf-8")
        args.output.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
