"""Load test: `tokentrail serve` against `mlx_lm.server` on loopback (a benchmark, not a test).

Starts each server in turn on the same model folder, then runs C concurrent streaming
chat clients (C = 1, 4, 16 by default), each sending the same fixed requests
(temperature 0, end-of-sequence suppressed with logit_bias, so every request generates
exactly --max-tokens tokens; logprobs with 5 alternatives asked of both, and
tokentrail's attribution always on). Reports throughput (completion tokens from
`usage` over wall time), time to first token (TTFT) and inter-token latency (ITL)
p50/p99 for each, and the ratios.

    python benchmarks/bench_server.py                       # the built-in demo model
    python benchmarks/bench_server.py --model PATH --output benchmarks/results/server.md

`mlx_lm.server` sends a chunk only when text is ready and ours one per token, so ITL is
the gap between content-bearing chunks on both sides; throughput counts tokens from
`usage` either way.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    "What is a Python list?",
    "Explain the with statement.",
    "How do generators work?",
    "What does the import system do?",
]


@dataclass
class RequestResult:
    ok: bool
    tokens: int = 0
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    error: str = ""


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def model_folder(model: str | None) -> Path:
    if model is not None:
        return Path(model)
    import tokentrail

    return Path(tokentrail.__file__).resolve().parent / "demo_model"


def special_ids(folder: Path) -> list[int]:
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    return sorted(t["id"] for t in data.get("added_tokens", []) if t.get("special"))


def start_server(kind: str, folder: Path, clients: int, log: Path) -> tuple[subprocess.Popen, str]:
    """Start tokentrail serve or mlx_lm.server on a free port; wait until it answers."""
    port = free_port()
    if kind == "tokentrail":
        cmd = [sys.executable, "-m", "tokentrail.server", "--model", str(folder),
               "--port", str(port), "--max-batch", str(clients), "--max-queue",
               str(clients * 4), "--log-level", "warning"]
        probe = "/health"
    else:
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(folder), "--port",
               str(port), "--log-level", "WARNING"]
        probe = "/v1/models"
    out = log.open("wb")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{kind} exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url + probe, timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{kind} did not start in 300 s")


def body_for(i: int, model_name: str, max_tokens: int, bias: dict[str, int]) -> dict[str, Any]:
    return {
        "model": model_name,
        "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logit_bias": bias,
        "logprobs": True,
        "top_logprobs": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> RequestResult:
    start = time.perf_counter()
    last = None
    res = RequestResult(ok=False)
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}"
                await r.aread()
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.tokens = int(chunk["usage"]["completion_tokens"])
                choices = chunk.get("choices") or [{}]
                if not (choices[0].get("delta") or {}).get("content"):
                    continue  # no text yet (ours: a held-back token; theirs: none sent)
                if last is None:
                    res.ttft = now - start
                else:
                    res.gaps.append(now - last)
                last = now
        res.ok = res.tokens > 0
        if not res.ok:
            res.error = "no usage in the stream"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_level(
    url: str,
    model_name: str,
    clients: int,
    requests_each: int,
    max_tokens: int,
    bias: dict[str, int],
    first_prompt: int = 0,
) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker(c: int) -> list[RequestResult]:
            out = []
            for r in range(requests_each):
                out.append(
                    await one_request(
                        client,
                        url,
                        body_for(
                            first_prompt + c * requests_each + r, model_name, max_tokens, bias
                        ),
                    )
                )
            return out

        t0 = time.perf_counter()
        per_client = await asyncio.gather(*(worker(c) for c in range(clients)))
        wall = time.perf_counter() - t0
    return [r for rs in per_client for r in rs], wall


def summarize(results: list[RequestResult], wall: float) -> dict[str, Any]:
    good = [r for r in results if r.ok]
    gaps = [g for r in good for g in r.gaps]
    ttfts = [r.ttft for r in good]
    tokens = sum(r.tokens for r in good)
    return {
        "requests": len(results),
        "errors": len(results) - len(good),
        "tokens": tokens,
        "tok_s": tokens / wall if wall else float("nan"),
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p99": percentile(ttfts, 0.99),
        "itl_p50": percentile(gaps, 0.5),
        "itl_p99": percentile(gaps, 0.99),
        "streaming_tok_s": 1 / statistics.mean(gaps) if gaps else float("nan"),
        "wall": wall,
        "error_kinds": sorted({r.error for r in results if not r.ok}),
    }


def bench(kind: str, folder: Path, args: argparse.Namespace, levels: list[int],
          bias: dict[str, int], notes: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    log = Path(tempfile.mkdtemp(prefix=f"bench-{kind}-")) / "server.log"
    proc, url = start_server(kind, folder, max(levels), log)
    rows = []
    try:
        # mlx_lm.server serves the model it loaded as "default_model".
        name = "default_model" if kind == "mlx_lm" else httpx.get(url + "/v1/models").json()[
            "data"][0]["id"]
        asyncio.run(run_level(url, name, 1, 2, args.max_tokens, bias))  # warm-up
        for c in levels:
            results, wall = asyncio.run(
                run_level(url, name, c, args.requests, args.max_tokens, bias)
            )
            rows.append((c, summarize(results, wall)))
            s = rows[-1][1]
            print(f"{kind} C={c}: {s['tok_s']:.1f} tok/s, TTFT p50 {s['ttft_p50'] * 1e3:.1f} ms, "
                  f"ITL p50 {s['itl_p50'] * 1e3:.2f} ms, errors {s['errors']}", flush=True)
        if kind == "tokentrail":
            notes["batch_kind"] = httpx.get(url + "/health").json().get("batch_kind")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the demo model)")
    ap.add_argument("--clients", default="1,4,16", help="concurrency levels (comma list)")
    ap.add_argument("--requests", type=int, default=2, help="requests per client per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--output", type=Path, default=None, help="write the markdown report here")
    args = ap.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    folder = model_folder(args.model)
    bias = {str(i): -100 for i in special_ids(folder)}
    notes: dict[str, Any] = {}
    ours = bench("tokentrail", folder, args, levels, bias, notes)
    theirs = bench("mlx_lm", folder, args, levels, bias, notes)

    import mlx.core as mx
    import mlx_lm

    lines = [
        "# Server load benchmark: tokentrail serve vs mlx_lm.server",
        "",
        f"`python benchmarks/bench_server.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
        "",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs visible, {platform.system()} "
        f"{platform.release()}; Python {platform.python_version()}, mlx {mx.__version__} "
        f"({mx.default_device()}), mlx-lm {mlx_lm.__version__}",
        f"- model: `{folder.name}`; chat prompts cycled from {len(PROMPTS)} fixed ones; "
        f"max_tokens {args.max_tokens}, temperature 0, EOS suppressed, logprobs with 5 "
        f"alternatives; {args.requests} requests per client; servers run one at a time",
        f"- tokentrail serve `--max-batch {max(levels)}`, batch `{notes.get('batch_kind')}` "
        "(the engine's own batched decoding, or `SerialBatch`: one generator per sequence, "
        "a model call each per step); mlx_lm.server with its defaults (BatchGenerator)",
        f"- load average when done: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
        "(the CPUs are shared with the client process and anything else running)",
        "",
        "| clients | tok/s ours | tok/s mlx_lm | ratio | TTFT p50 ours / mlx_lm (ms) "
        "| ITL p50 ours / mlx_lm (ms) | ITL p99 ours / mlx_lm (ms) | errors |",
        "|---:|---:|---:|---:|---|---|---|---:|",
    ]
    for (c, a), (_, b) in zip(ours, theirs, strict=True):
        lines.append(
            f"| {c} | {a['tok_s']:.1f} | {b['tok_s']:.1f} | {a['tok_s'] / b['tok_s']:.2f} | "
            f"{a['ttft_p50'] * 1e3:.1f} / {b['ttft_p50'] * 1e3:.1f} | "
            f"{a['itl_p50'] * 1e3:.2f} / {b['itl_p50'] * 1e3:.2f} | "
            f"{a['itl_p99'] * 1e3:.2f} / {b['itl_p99'] * 1e3:.2f} | "
            f"{a['errors']} / {b['errors']} |"
        )
    errors = sorted({e for rows in (ours, theirs) for _, s in rows for e in s["error_kinds"]})
    if errors:
        lines += ["", "Errors seen: " + "; ".join(errors)]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(report, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
