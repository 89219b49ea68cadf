"""What greedy sampling filters cost llama-server per token (issue #32).

A greedy request takes the highest logit whatever top-k, top-p and min-p keep, yet
llama-server runs them, or without them walks the whole vocabulary in its temperature
and sampling steps. This sends the proxy's greedy `/completion` body (prompt ids from the
demo model's chat template, ``n_probs`` 5, ``return_tokens``, end tokens barred so each
request makes exactly --max-tokens tokens) to llama-server on the demo model's GGUF,
--clients at once, in alternating rounds:

- ``no-filter``: ``top_k`` 0, ``top_p`` 1, ``min_p`` 0 stated (what the proxy sent for
  every request before 2026-12-06);
- ``defaults``: none of them (llama-server's own: 40, 0.95, 0.05; what a direct client
  sends, and what the proxy now sends for a greedy request).

Reported: llama-server's CPU per completion token and the throughput, every round.
llama-server runs on the last usable core and the clients on the others (as
`bench_proxy_cpu.py --pin-upstream`), so its throughput is its own core's.

    flock /tmp/tt-bench.lock python benchmarks/bench_upstream_filters.py [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from bench_proxy import cpu_seconds
from bench_proxy_cpu import DEMO, EOS, PROMPTS, gguf_path, pin_upstream, start_llama


def prompt_ids() -> list[list[int]]:
    """The chat prompts as the proxy sends them: ids of the demo model's template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEMO), local_files_only=True)
    out = []
    for p in PROMPTS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def body(ids: list[int], n: int, variant: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt": ids, "n_predict": n, "stream": True, "return_tokens": True,
        "cache_prompt": True, "temperature": 0, "n_probs": 5, "repeat_penalty": 1.0,
        "logit_bias": [[e, -100] for e in EOS],
    }  # fmt: skip
    if variant == "no-filter":
        out.update(top_k=0, top_p=1.0, min_p=0.0)
    return out


async def round_(url: str, pid: int, prompts: list[list[int]], args: argparse.Namespace,
                 variant: str) -> tuple[float, float]:  # fmt: skip
    """(upstream CPU µs per token, tokens/s) of --clients streams of --max-tokens."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def one(k: int) -> None:
            payload = body(prompts[k % len(prompts)], args.max_tokens, variant)
            async with s.post(url + "/completion", json=payload) as r:
                r.raise_for_status()
                async for _ in r.content.iter_any():
                    pass

        start, cpu = time.perf_counter(), cpu_seconds(pid)
        await asyncio.gather(*(one(k) for k in range(args.clients)))
        tokens = args.clients * args.max_tokens
        return 1e6 * (cpu_seconds(pid) - cpu) / tokens, tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", type=Path, default=os.environ.get("TOKENTRAIL_LLAMA_SERVER"))
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    if args.server is None:
        raise SystemExit("give --server or set TOKENTRAIL_LLAMA_SERVER")
    args.gguf = gguf_path()
    prompts = prompt_ids()
    up, url = start_llama(args, Path(tempfile.mkdtemp(prefix="bench-filters-")))
    runs: dict[str, list[tuple[float, float]]] = {"no-filter": [], "defaults": []}
    try:
        pin_upstream(up.pid)
        asyncio.run(round_(url, up.pid, prompts, argparse.Namespace(clients=4, max_tokens=8),
                           "defaults"))  # fmt: skip
        for _ in range(args.rounds):
            for variant, got in runs.items():
                got.append(asyncio.run(round_(url, up.pid, prompts, args, variant)))
                print(json.dumps({"variant": variant, "upstream_us_per_token": got[-1][0],
                                  "tokens_per_s": got[-1][1]}), flush=True)  # fmt: skip
    finally:
        up.terminate()
        up.wait(60)
    print(f"\nllama-server on the demo GGUF, pinned to one core, {args.clients} clients x "
          f"{args.max_tokens} tokens, greedy, n_probs 5; medians of {args.rounds} rounds:\n")
    print("| greedy request | upstream CPU µs/token | tokens/s |\n|---|---:|---:|")
    for variant, got in runs.items():
        cpu = statistics.median(c for c, _ in got)
        tps = statistics.median(t for _, t in got)
        print(f"| {variant} | {cpu:.0f} | {tps:,.0f} |")


if __name__ == "__main__":
    main()
