"""The proxy's own cost per token against a fast upstream, and what a user sees (issue #32).

The upstream is llama.cpp's `llama-server` running the demo model's GGUF (2.2M parameters,
`scripts/demo_model_to_gguf.py`): fast enough that the proxy's per-token CPU shows. The
proxy (`tokentrail serve --upstream`, its defaults) runs in front of it on loopback. Two
parts, each direct and through the proxy side by side in alternating rounds:

- ``top5``: at --top5-clients concurrent streaming chat clients (16 and 64), --max-tokens
  tokens each (end tokens suppressed with logit_bias, so every request makes exactly that
  many), ``logprobs`` with ``top_logprobs=5`` asked in both cases. Reported: tokens/s, the
  proxy's process CPU time per completion token (HTTP in and out, SSE and JSON, realign,
  align, formatting), the upstream's process CPU time per token, and the part the proxy's
  upstream reader spends parsing and realigning (`GET /tokentrail/upstream`).
- ``user``: at --user-clients (1, 4, 16, 64): direct clients ask NO logprobs (as a plain
  llama-server user would), the proxy's clients ask nothing either (the proxy at its
  defaults, its attribution on). Reported: tokens/s and their ratio, median time to
  first content, what the proxy adds.

``--pin-upstream`` gives llama-server the last usable core and the proxy and the clients
the others, for the direct and the proxied rounds alike: the case of an upstream whose
work runs on hardware of its own (a GPU), where the proxy's CPU cannot slow the model.
Without it, on a small machine the proxy's and the clients' CPU preempt the upstream's
compute thread, and that, not the proxy's delivery, is what a ratio below 1 then shows.

``--profile FILE`` also samples the proxy with py-spy (if installed) during one extra
top-5 round at the largest top-5 client count, and writes the functions that took its
time (own and inclusive) to FILE. Run everything under ``flock /tmp/tt-bench.lock``:

    flock /tmp/tt-bench.lock python benchmarks/bench_proxy_cpu.py \\
        [--server $TOKENTRAIL_LLAMA_SERVER] [--output benchmarks/results/proxy-cpu.md]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_proxy
import httpx
from bench_proxy import cpu_seconds, free_port, reader_cost, spawn, start_proxy, wait

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "src" / "tokentrail" / "demo_model"
PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a list is.",
    "Describe a cat in three sentences.",
    "Tell me about the weather.",
]
EOS = (0, 2)  # <|endoftext|> and <|im_end|>: the demo model's, and SmolLM2's
TOP = 5
#: The clients' HTTP library (`--client`).
CLIENT = "httpx"


def gguf_path() -> Path:
    """The demo model's GGUF (converted once, cached)."""
    script = REPO / "scripts" / "demo_model_to_gguf.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def start_llama(args: argparse.Namespace, logs: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [str(args.server), "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-c", str(512 * args.slots), "-np", str(args.slots), "-t", str(args.threads)]
    cmd += ["--no-webui"]
    proc = spawn(cmd, logs / "llama.log")
    url = f"http://127.0.0.1:{port}"
    wait(url, proc)
    return proc, url


def pin_upstream(pid: int) -> None:
    """Put process `pid` (every thread) on the last usable core and this process, and
    what it starts from now on, on the others; SystemExit with one core."""
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        raise SystemExit("--pin-upstream needs at least 2 usable cores")
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {usable[-1]})
    os.sched_setaffinity(0, set(usable[:-1]))


def chat_body(model: str, prompt: str, n: int, top: int | None) -> dict[str, Any]:
    """One streamed greedy chat request of exactly `n` tokens (end tokens barred);
    `top` None asks no logprobs."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
        "logit_bias": {str(e): -100 for e in EOS},
    }
    if top is not None:
        body["logprobs"] = True
        body["top_logprobs"] = top
    return body


def has_content(payload: str | bytes) -> bool:
    """Whether a chunk's JSON carries text in its first choice's delta."""
    choices = json.loads(payload).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


async def one(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, n: int, top: int | None
) -> tuple[int, float, int]:
    """(tokens, time to first content, HTTP status) of one streamed chat request;
    `top` None asks no logprobs."""
    body = chat_body(model, prompt, n, top)
    start = time.perf_counter()
    ttft = float("nan")
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return 0, ttft, r.status_code
        async for line in r.aiter_lines():
            if ttft == ttft or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if has_content(line[6:]):
                ttft = time.perf_counter() - start
    return n, ttft, 200


async def one_aiohttp(
    client: Any, url: str, model: str, prompt: str, n: int, top: int | None
) -> tuple[int, float, int]:
    """`one` on aiohttp: the same request and timing, a cheaper reader (the clients share
    this machine's cores with both servers)."""
    body = chat_body(model, prompt, n, top)
    start = time.perf_counter()
    ttft = float("nan")
    async with client.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            await r.read()
            return 0, ttft, r.status
        async for line in r.content:
            if ttft == ttft or not line.startswith(b"data: {"):
                continue
            if has_content(line[6:]):
                ttft = time.perf_counter() - start
    return n, ttft, 200


async def client_json(client: Any, url: str) -> Any:
    """GET `url` as JSON with either client."""
    if isinstance(client, httpx.AsyncClient):
        return (await client.get(url)).json()
    async with client.get(url) as r:
        return await r.json()


async def round_(url: str, clients: int, n: int, top: int | None) -> tuple[float, float, int]:
    """(tokens/s over all clients, median TTFT s, requests not answered 200)."""
    if CLIENT == "aiohttp":
        import aiohttp

        conn = aiohttp.TCPConnector(limit=0)
        opened: Any = aiohttp.ClientSession(
            connector=conn, timeout=aiohttp.ClientTimeout(total=600)
        )
        ask = one_aiohttp
    else:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        opened = httpx.AsyncClient(timeout=600, limits=limits)
        ask = one
    async with opened as client:
        model = (await client_json(client, url + "/v1/models"))["data"][0]["id"]
        start = time.perf_counter()
        results = await asyncio.gather(
            *(ask(client, url, model, PROMPTS[k % len(PROMPTS)], n, top) for k in range(clients))
        )
        wall = time.perf_counter() - start
    ttfts = [x for _, x, s in results if s == 200 and x == x]
    median = statistics.median(ttfts) if ttfts else float("nan")
    return sum(t for t, _, _ in results) / wall, median, sum(s != 200 for _, _, s in results)


class Side:
    """One side's samples (tokens/s, TTFT, CPU s of the proxy and of the upstream)."""

    def __init__(self) -> None:
        self.tps: list[float] = []
        self.ttft: list[float] = []
        self.failed = 0
        self.proxy_cpu = 0.0
        self.up_cpu = 0.0
        self.tokens = 0

    def run(self, url: str, c: int, n: int, top: int | None, pids: tuple[int, int]) -> None:
        p0, u0 = cpu_seconds(pids[0]), cpu_seconds(pids[1])
        tps, ttft, failed = asyncio.run(round_(url, c, n, top))
        self.proxy_cpu += cpu_seconds(pids[0]) - p0
        self.up_cpu += cpu_seconds(pids[1]) - u0
        self.tokens += (c - failed) * n
        self.tps.append(tps)
        self.ttft.append(ttft)
        self.failed += failed

    def per_token(self, cpu: float) -> float:
        return 1e6 * cpu / self.tokens if self.tokens else float("nan")


def measure(
    part: str, levels: list[int], urls: tuple[str, str], pids: tuple[int, int],
    args: argparse.Namespace, tops: tuple[int | None, int | None],
) -> list[dict[str, Any]]:  # fmt: skip
    """Alternating rounds, direct then proxied, at each client count."""
    med = statistics.median
    rows = []
    for c in levels:
        direct, proxied = Side(), Side()
        before = reader_cost(urls[1])
        for _ in range(args.repeat):
            direct.run(urls[0], c, args.max_tokens, tops[0], pids)
            proxied.run(urls[1], c, args.max_tokens, tops[1], pids)
        after = reader_cost(urls[1])
        n = after.get("tokens", 0) - before.get("tokens", 0)
        row = {
            "part": part,
            "clients": c,
            "direct_tok_s": med(direct.tps),
            "proxy_tok_s": med(proxied.tps),
            "ratio": med(proxied.tps) / med(direct.tps),
            "direct_ttft_ms": 1000 * med(direct.ttft),
            "proxy_ttft_ms": 1000 * med(proxied.ttft),
            "failed": direct.failed + proxied.failed,
            "proxy_cpu_us_per_token": proxied.per_token(proxied.proxy_cpu),
            "proxy_idle_cpu_us_per_token": direct.per_token(direct.proxy_cpu),
            "direct_upstream_cpu_us_per_token": direct.per_token(direct.up_cpu),
            "proxy_upstream_cpu_us_per_token": proxied.per_token(proxied.up_cpu),
        }
        row["added_ttft_ms"] = row["proxy_ttft_ms"] - row["direct_ttft_ms"]
        for key in ("parse", "realign"):
            spent = after.get(f"{key}_s", 0.0) - before.get(f"{key}_s", 0.0)
            row[f"{key}_us_per_token"] = 1e6 * spent / n if n else float("nan")
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def profile(url: str, pid: int, args: argparse.Namespace, logs: Path) -> str:
    """py-spy's samples of the proxy over one top-5 round: the top functions (markdown)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return "(py-spy is not installed: no profile)"
    raw = logs / "profile.txt"
    rec = subprocess.Popen(
        [spy, "record", "-p", str(pid), "-r", "250", "-f", "raw", "-o", str(raw), "--nonblocking",
         "--idle" if args.idle else "--gil"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    time.sleep(1.0)
    c = max(args.top5_levels)
    asyncio.run(round_(url, c, args.max_tokens, TOP))
    rec.send_signal(2)  # SIGINT: py-spy writes what it sampled
    rec.wait(60)
    print(f"profile samples: {raw}", flush=True)
    return summarize(raw.read_text() if raw.exists() else "")


def summarize(collapsed: str, top: int = 25) -> str:
    """The functions with the most samples, own (leaf) and inclusive, from py-spy's raw
    (collapsed stacks) output, as a markdown table."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        total += k
        frames = [f.split(" (")[0] + " " + _where(f) for f in stack.split(";")]
        own[frames[-1]] += k
        for f in set(frames):
            incl[f] += k
    if not total:
        return "(no samples)"
    lines = [f"{total} samples (the thread holding the GIL).", ""]
    for title, counter in (("own", own), ("inclusive", incl)):
        lines += [f"By {title} time:", "", "| function | own % | inclusive % |", "|---|---:|---:|"]
        for name, _ in counter.most_common(top):
            share = f"{100 * own[name] / total:.1f} | {100 * incl[name] / total:.1f}"
            lines.append(f"| `{name}` | {share} |")
        lines.append("")
    return "\n".join(lines)


def _where(frame: str) -> str:
    """`file:line` of a py-spy frame ``name (path:line)``, the path cut to its last parts."""
    if " (" not in frame:
        return ""
    path = frame.rsplit(" (", 1)[1].rstrip(")")
    return "(" + "/".join(path.split("/")[-2:]).split(":")[0] + ")"


def table(rows: list[dict[str, Any]], part: str) -> list[str]:
    if part == "top5":
        head = [
            "| clients | direct tok/s | proxy tok/s | ratio | proxy CPU µs/token "
            "| parse µs/token | realign µs/token | upstream CPU µs/token direct | proxied |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        return head + [
            f"| {r['clients']} | {r['direct_tok_s']:.0f} | {r['proxy_tok_s']:.0f} | "
            f"{r['ratio']:.2f} | {r['proxy_cpu_us_per_token']:.0f} | "
            f"{r['parse_us_per_token']:.0f} | {r['realign_us_per_token']:.0f} | "
            f"{r['direct_upstream_cpu_us_per_token']:.0f} | "
            f"{r['proxy_upstream_cpu_us_per_token']:.0f} |"
            for r in rows if r["part"] == part
        ]  # fmt: skip
    head = [
        "| clients | direct tok/s (no logprobs) | proxy tok/s (defaults) | ratio "
        "| direct TTFT ms | proxy TTFT ms | added ms | proxy CPU µs/token "
        "| upstream CPU µs/token direct | proxied |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    return head + [
        f"| {r['clients']} | {r['direct_tok_s']:.0f} | {r['proxy_tok_s']:.0f} | "
        f"{r['ratio']:.2f} | {r['direct_ttft_ms']:.1f} | {r['proxy_ttft_ms']:.1f} | "
        f"{r['added_ttft_ms']:+.1f} | {r['proxy_cpu_us_per_token']:.0f} | "
        f"{r['direct_upstream_cpu_us_per_token']:.0f} | "
        f"{r['proxy_upstream_cpu_us_per_token']:.0f} |"
        for r in rows if r["part"] == part
    ]  # fmt: skip


def report(args: argparse.Namespace, rows: list[dict[str, Any]], prof: str | None) -> str:
    lines = [
        f"Upstream llama-server ({args.gguf.name}, {args.slots} slots, -t {args.threads}); "
        f"{args.max_tokens} tokens per request, greedy, streaming chat; medians of "
        f"{args.repeat} alternating rounds; "
        + ("llama-server pinned to the last core, the proxy and the clients to the rest; "
           if args.pin_upstream else "")
        + f"{platform.platform()}, {os.cpu_count()} CPUs "
        f"(shared); clients on {CLIENT}. "
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"Command: `python {' '.join(sys.argv)}`",
        "",
        f"Top-{TOP} logprobs asked on both sides:",
        "",
        *table(rows, "top5"),
        "",
        "User view: direct asks no logprobs, the proxy at its defaults:",
        "",
        *table(rows, "user"),
    ]
    if prof is not None:
        lines += ["", "Profile of the proxy (py-spy) over one top-5 round:", "", prof]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", type=Path, default=os.environ.get("TOKENTRAIL_LLAMA_SERVER"))
    ap.add_argument("--gguf", type=Path, help="default: the demo model's GGUF")
    ap.add_argument(
        "--tokenizer", type=Path, help="the proxy's --tokenizer (default: the demo model's; "
        "with another --gguf, that GGUF)"
    )
    ap.add_argument("--slots", type=int, default=64, help="llama-server's -np (default 64)")
    ap.add_argument("--threads", type=int, default=1, help="llama-server's -t (default 1)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--top5-clients", default="16,64")
    ap.add_argument("--user-clients", default="1,4,16,64")
    ap.add_argument("--profile", action="store_true", help="sample the proxy with py-spy")
    ap.add_argument(
        "--pin-upstream", action="store_true",
        help="llama-server on the last usable core, the proxy and the clients on the rest",
    )
    ap.add_argument(
        "--idle", action="store_true", help="(profile) all samples, not only the GIL holder's"
    )
    ap.add_argument(
        "--proxy-repo", type=Path, help="run the proxy from this checkout's src/ (before/after)"
    )
    ap.add_argument("--output", type=Path, help="append the markdown report to this file")
    ap.add_argument(
        "--client", choices=("httpx", "aiohttp"), default="httpx",
        help="the clients' HTTP library (aiohttp reads a chunk for about a third of "
        "httpx's CPU; the clients share the cores with both servers)",
    )  # fmt: skip
    args = ap.parse_args()
    global CLIENT
    CLIENT = args.client
    if args.proxy_repo is not None:
        bench_proxy.REPO = args.proxy_repo.resolve()
    if args.server is None:
        raise SystemExit("give --server or set TOKENTRAIL_LLAMA_SERVER")
    if args.tokenizer is None:
        args.tokenizer = DEMO if args.gguf is None else args.gguf
    args.gguf = args.gguf or gguf_path()
    args.top5_levels = [int(c) for c in args.top5_clients.split(",") if c]
    args.user_levels = [int(c) for c in args.user_clients.split(",") if c]
    logs = Path(tempfile.mkdtemp(prefix="bench-proxy-cpu-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        up, direct = start_llama(args, logs)
        procs.append(up)
        if args.pin_upstream:
            pin_upstream(up.pid)
        proxy, proxied = start_proxy(direct, str(args.tokenizer), logs)
        procs.append(proxy)
        pids = (proxy.pid, up.pid)
        for url in (direct, proxied):  # warm up both
            asyncio.run(round_(url, 2, 8, TOP))
        rows = measure("top5", args.top5_levels, (direct, proxied), pids, args, (TOP, TOP))
        rows += measure("user", args.user_levels, (direct, proxied), pids, args, (None, None))
        prof = profile(proxied, proxy.pid, args, logs) if args.profile else None
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                p.wait(60)
    text = report(args, rows, prof)
    print(text)
    if args.output:
        with args.output.open("a", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
