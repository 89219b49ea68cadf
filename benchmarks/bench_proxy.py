"""`tokentrail serve --upstream` in front of llama-server and vLLM vs each directly.

For each upstream (llama.cpp's `llama-server` on a GGUF, SmolLM2-135M-Instruct by
default, with --slots parallel slots; vLLM's OpenAI server on the same model as a
Hugging Face folder, when --vllm-python is given) it starts the upstream and the proxy
in front of it, both on loopback, one upstream at a time. For C = 1, 4, 16, 64
concurrent streaming chat clients (the same prompts, greedy, the end-of-turn token
suppressed with logit_bias so each request makes exactly --max-tokens tokens, logprobs
with top_logprobs=5 asked for in both cases; the proxy adds its attribution; with
``--plain``, what a user of the upstream sends: no logprobs on either side, the proxy at its
defaults adding its attribution all the same) it runs the
direct and the proxied case alternately, --repeat times, and reports side by side the
median throughput (generated tokens per second, all clients together) and its ratio
proxy/direct, the median time to first token of each and what the proxy adds, the
requests answered 429, and the proxy's cost per token: its process's CPU time per
generated token (HTTP in and out, JSON, realigning, aligning, formatting), and the part
its upstream reader spends parsing SSE/JSON and realigning (`GET /tokentrail/upstream`,
``streams``).

    python benchmarks/bench_proxy.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf \\
        [--vllm-python .venv-vllm/bin/python --vllm-model FOLDER] [--no-llama] [--plain] \\
        [--output benchmarks/results/proxy.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
TOP = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait(
    url: str, proc: subprocess.Popen[bytes], path: str = "/health", limit: float = 900
) -> None:
    deadline = time.monotonic() + limit
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


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start `cmd` in a session of its own (`stop` ends its whole group: vLLM's engine core
    would outlive its server)."""
    return subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        start_new_session=True,
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Terminate the server (kill it after 60 s), then kill what is left of its process
    group: vLLM's engine core outlived its API server and held 2.3 GB."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def start_llama(args: argparse.Namespace, logs: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    port = free_port()
    cmd = [str(args.server), "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-c", str(512 * args.slots), "-np", str(args.slots), "-t", str(args.threads)]
    cmd += ["--no-webui"]
    proc = spawn(cmd, logs / "llama.log")
    url = f"http://127.0.0.1:{port}"
    wait(url, proc)
    return proc, url, str(args.gguf)


def start_vllm(args: argparse.Namespace, logs: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    port = free_port()
    cmd = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", str(args.vllm_model), "--served-model-name", "smollm2"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    cmd += ["--max-model-len", "2048", "--enforce-eager"]
    proc = spawn(cmd, logs / "vllm.log", {"VLLM_CPU_KVCACHE_SPACE": "1"})
    url = f"http://127.0.0.1:{port}"
    wait(url, proc, "/v1/models")
    return proc, url, str(args.vllm_model)


def start_proxy(upstream: str, tokenizer: str, logs: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The proxy with its default settings (its queue included), once its startup check
    of the upstream is over: the check's own requests would share the upstream with the
    first measured ones."""
    port = free_port()
    cmd = [sys.executable, "-m", "tokentrail", "serve", "--upstream", upstream]
    cmd += ["--tokenizer", tokenizer, "--port", str(port), "--log-level", "warning"]
    proc = spawn(cmd, logs / "proxy.log", {"PYTHONPATH": str(REPO / "src")})
    url = f"http://127.0.0.1:{port}"
    wait(url, proc)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        check = httpx.get(url + "/tokentrail/upstream", timeout=30).json()
        if check.get("status") != "running":
            break
        time.sleep(0.5)
    return proc, url


async def one(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, n: int, top: int | None
) -> tuple[int, float, int]:
    """(tokens, time to first content, HTTP status) of one streamed chat request (no
    logprobs asked when `top` is None)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
        "logit_bias": {str(EOS): -100},
    }
    if top is not None:
        body.update(logprobs=True, top_logprobs=top)
    start = time.perf_counter()
    ttft = float("nan")
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return 0, ttft, r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft != ttft:  # nan: no content yet
                choices = json.loads(line[6:]).get("choices") or [{}]
                if (choices[0].get("delta") or {}).get("content"):
                    ttft = time.perf_counter() - start
    return n, ttft, 200


async def run(url: str, clients: int, n: int, top: int | None = TOP) -> tuple[float, float, int]:
    """(tokens per second over all clients, median TTFT, 429s) for one round."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        start = time.perf_counter()
        results = await asyncio.gather(
            *(one(client, url, model, PROMPTS[k % len(PROMPTS)], n, top)
              for k in range(clients))
        )
        wall = time.perf_counter() - start
    ttfts = [x for _, x, s in results if s == 200 and x == x]
    median = statistics.median(ttfts) if ttfts else float("nan")
    return sum(t for t, _, _ in results) / wall, median, sum(s == 429 for _, _, s in results)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def reader_cost(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/tokentrail/upstream", timeout=10)
    return dict(r.json().get("streams") or {}) if r.status_code == 200 else {}


def measure(
    name: str, direct: str, proxied: str, pid: int, args: argparse.Namespace, repeat: int
) -> list[dict[str, Any]]:
    """Alternating rounds at each client count; one row per count."""
    asyncio.run(run(direct, 1, 4))  # warm up both
    asyncio.run(run(proxied, 1, 4))
    rows = []
    for c in args.levels:
        d_tps, d_ttft, p_tps, p_ttft, rejected, cpu, tokens = [], [], [], [], 0, 0.0, 0
        before = reader_cost(proxied)
        for _ in range(repeat):
            tps, ttft, n429 = asyncio.run(run(direct, c, args.max_tokens, args.top))
            d_tps.append(tps)
            d_ttft.append(ttft)
            rejected += n429
            tic = cpu_seconds(pid)
            tps, ttft, n429 = asyncio.run(run(proxied, c, args.max_tokens, args.top))
            cpu += cpu_seconds(pid) - tic
            tokens += (c - n429) * args.max_tokens
            p_tps.append(tps)
            p_ttft.append(ttft)
            rejected += n429
        after = reader_cost(proxied)
        rows.append(
            row(name, c, d_tps, d_ttft, p_tps, p_ttft, rejected, cpu, tokens, before, after)
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def row(
    name: str,
    c: int,
    d_tps: list[float],
    d_ttft: list[float],
    p_tps: list[float],
    p_ttft: list[float],
    rejected: int,
    cpu: float,
    tokens: int,
    before: dict[str, Any],
    after: dict[str, Any],
) -> dict[str, Any]:
    med = statistics.median
    out = {
        "upstream": name,
        "clients": c,
        "direct_tok_s": med(d_tps),
        "proxy_tok_s": med(p_tps),
        "ratio": med(p_tps) / med(d_tps),
        "direct_ttft_ms": 1000 * med(d_ttft),
        "proxy_ttft_ms": 1000 * med(p_ttft),
        "rejected_429": rejected,
        "proxy_cpu_us_per_token": 1e6 * cpu / tokens if tokens else float("nan"),
    }
    out["added_ttft_ms"] = out["proxy_ttft_ms"] - out["direct_ttft_ms"]
    n = after.get("tokens", 0) - before.get("tokens", 0)
    for key in ("parse", "realign"):
        spent = after.get(f"{key}_s", 0.0) - before.get(f"{key}_s", 0.0)
        out[f"{key}_us_per_token"] = 1e6 * spent / n if n else float("nan")
    return out


def bench_upstream(
    name: str,
    start: Callable[[argparse.Namespace, Path], tuple[subprocess.Popen[bytes], str, str]],
    args: argparse.Namespace,
    logs: Path,
    repeat: int,
) -> list[dict[str, Any]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        up, direct, tokenizer = start(args, logs)
        procs.append(up)
        proxy, proxied = start_proxy(direct, tokenizer, logs)
        procs.append(proxy)
        return measure(name, direct, proxied, proxy.pid, args, repeat)
    finally:
        for p in reversed(procs):
            stop(p)


def write(args: argparse.Namespace, rows: list[dict[str, Any]], command: str) -> None:
    lines = [
        "# Proxy (`tokentrail serve --upstream`) vs its upstream directly",
        "",
        f"Model SmolLM2-135M-Instruct ({args.gguf.name} for llama-server with {args.slots} "
        f"slots and {args.threads} thread(s); its float32 HF folder for vLLM), "
        f"{args.max_tokens} tokens per request, "
        + ("greedy, no logprobs asked on either side (what a user of the upstream sends; "
           "the proxy at its defaults adds its attribution), " if args.plain else
           f"greedy, logprobs with top_logprobs={TOP} in both cases (the proxy adds its "
           "attribution), ")
        + f"medians of alternating rounds ({args.repeat} for llama-server, "
        f"{args.vllm_repeat} for vLLM); {platform.platform()}, {os.cpu_count()} CPUs "
        f"(shared by other jobs). Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"Command: `{command}`",
        "",
        "| upstream | clients | direct tok/s | proxy tok/s | ratio | direct TTFT ms "
        "| proxy TTFT ms | added TTFT ms | 429s | proxy CPU µs/token | parse µs/token "
        "| realign µs/token |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['upstream']} | {r['clients']} | {r['direct_tok_s']:.1f} | "
            f"{r['proxy_tok_s']:.1f} | {r['ratio']:.2f} | {r['direct_ttft_ms']:.1f} | "
            f"{r['proxy_ttft_ms']:.1f} | {r['added_ttft_ms']:+.1f} | {r['rejected_429']} | "
            f"{r['proxy_cpu_us_per_token']:.0f} | {r['parse_us_per_token']:.0f} | "
            f"{r['realign_us_per_token']:.0f} |"
        )
    args.output.write_text("\n".join(lines) + "\n", encoding="utf-8")
    args.output.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--server", type=Path, default=SERVER)
    ap.add_argument("--slots", type=int, default=16, help="llama-server's -np (default 16)")
    ap.add_argument("--threads", type=int, default=2, help="llama-server's -t (default 2)")
    ap.add_argument("--vllm-python", type=Path, help="a python with vLLM (skip vLLM without)")
    ap.add_argument("--vllm-model", type=Path, help="the HF folder vLLM serves")
    ap.add_argument("--clients", default="1,4,16,64")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--vllm-repeat", type=int, default=2)
    ap.add_argument("--plain", action="store_true",
                    help="no logprobs asked on either side (a plain user's request)")
    ap.add_argument("--no-llama", action="store_true", help="vLLM only (with --vllm-python)")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    args.levels = [int(c) for c in args.clients.split(",")]
    args.top = None if args.plain else TOP
    logs = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    rows = [] if args.no_llama else bench_upstream("llama-server", start_llama, args, logs,
                                                   args.repeat)
    if args.vllm_python is not None:
        rows += bench_upstream("vLLM", start_vllm, args, logs, args.vllm_repeat)
    if args.output:
        write(args, rows, "python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
