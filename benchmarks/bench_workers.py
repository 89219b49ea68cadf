"""`tokentrail serve --upstream --workers N`: the proxy's throughput with N workers vs 1.

An upstream fast enough that the proxy's own per-token work is what limits: llama.cpp's
`llama-server` on the demo model's GGUF (2.2M parameters; `scripts/demo_model_to_gguf.py`
writes it), `--slots` slots. In front of it the proxy runs with `--workers 1` and with
`--workers N`, one proxy up at a time, alternating, `--rounds` times. Each run: `--clients`
concurrent clients, each streaming `--requests` completions one after the other
(greedy, the end-of-text tokens barred with `logit_bias`, so each makes exactly
`--max-tokens` tokens, `logprobs` 5). Reported, as medians over the rounds: throughput
(completion tokens per second, all clients together), its ratio N workers / 1 worker, and
CPU per completion token of the proxy (the supervisor and its workers) and of the
upstream, read from /proc (Linux).

The clients run in this process (one asyncio loop on aiohttp, raw SSE bytes, only the
last chunk's usage parsed; their CPU per token is reported too), so on a small machine
the clients, the upstream and the proxy share the cores: say so next to the figures.
Each client also times the gaps between successive reads of its stream: a stall of the
proxy (a garbage collection of its whole heap, say) shows as a long one (p99 and max).
`--proxy-repo` runs the proxy from another checkout's src/ (before and after a change);
`--before PATH` compares two checkouts in one run instead: each round runs 1 worker from
PATH's src/ and 1 from this checkout's (or `--proxy-repo`'s), and reports each side's
medians, the proxy's CPU per token after / before, and each round's ratio. The sides
take turns to go first, as the 1- and N-worker runs do: with the old fixed order, a
change that moved no per-token code measured 3-5% more CPU per token on whichever side
ran second, in 4 of 5 runs on this 2-vCPU machine (`results/proxy-cpu.md`, "The order
of an A/B").
`--vllm-python PATH` makes the upstream vLLM's OpenAI server (that python's vLLM, CPU
build) on the same demo model instead of llama-server: the proxy then speaks its vLLM
dialect (`/v1/completions` with `return_token_ids` and ``token_id:N`` alternatives), the
frames a GPU-rate vLLM upstream sends; with `--replay` the measured requests are answered
from vLLM's own recorded responses.

`--replay` puts `replay_upstream.py` between the proxy and llama-server: each request it
has not seen goes to llama-server and is recorded, each later identical one is answered
from the recording (the greedy requests here repeat after the warm-up), so the upstream
costs about 5 µs of CPU per token and the proxy is the limit, as in front of a GPU that
does the upstream's work on its own hardware. `--pace MS` has the replay space each
stream's events by MS ms (a model making a token every MS ms per sequence): each read of
the proxy then brings one event, the low-load cost per event.

`--pin` gives the proxy cores of its own: its processes run on the first `--workers`
usable cores, and the upstream, the replay and the clients (this process) on the rest,
for both the 1-worker and the N-worker runs (each process inherits the cores it was
started on). That is the issue's case "when the proxy is the bottleneck" on a machine
with cores to spare, which a 2-core machine is not: it needs more usable cores than
`--workers`, and says so otherwise.

    flock /tmp/tt-bench.lock python benchmarks/bench_workers.py \\
        [--workers 2] [--clients 32] [--replay] [--output /tmp/workers.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
from bench_proxy import free_port, spawn, stop, wait
from bench_proxy_cpu import start_llama
from bench_server import percentile

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "src" / "tokentrail" / "demo_model"
CACHE = Path(os.environ.get("TOKENTRAIL_CACHE") or Path.home() / ".cache" / "tokentrail")
SERVER = CACHE / "llama.cpp-0.3.36" / "build" / "bin" / "llama-server"
PROMPTS = ["Once upon a time", "The cat sat", "In a hole in the ground", "Long ago"]
EOS_IDS = (0, 2)  # the demo model's end-of-text tokens
TOP = 5
TICK = os.sysconf("SC_CLK_TCK")


#: Cores for the proxy and for everything else, with --pin (None: no pinning).
PROXY_CORES: set[int] | None = None
LOAD_CORES: set[int] | None = None


@contextlib.contextmanager
def cores(which: set[int] | None) -> Iterator[None]:
    """Run this process on `which` cores inside (a process started there inherits them);
    nothing when `which` is None. The clients' cores (`LOAD_CORES`, if any) afterwards."""
    if which is None:
        yield
        return
    os.sched_setaffinity(0, which)
    try:
        yield
    finally:
        os.sched_setaffinity(0, LOAD_CORES or which)


def split_cores(workers: int) -> tuple[set[int], set[int]]:
    """The first `workers` usable cores for the proxy, the rest for the load; SystemExit
    on a machine with no core left for the load."""
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) <= workers:
        raise SystemExit(f"--pin needs more usable cores than --workers ({workers}): "
                         f"this machine has {len(usable)}")
    return set(usable[:workers]), set(usable[workers:])


def cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid` and its live children, plus its reaped children's (/proc)."""
    total = 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += sum(int(f) for f in fields[11:15]) / TICK  # utime stime cutime cstime
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return total
    return total + sum(cpu_seconds(int(k)) for k in kids)


def start_proxy(
    upstream: str, workers: int, logs: Path, repo: Path = REPO
) -> tuple[subprocess.Popen[bytes], str]:
    """The proxy with `workers` workers (from `repo`'s src/), once all serve and their
    startup checks of the upstream are over (their requests would share the upstream
    with measured ones)."""
    port = free_port()
    cmd = [sys.executable, "-m", "tokentrail", "serve", "--upstream", upstream]
    cmd += ["--tokenizer", str(DEMO), "--port", str(port), "--log-level", "info"]
    cmd += ["--workers", str(workers)]
    log = logs / f"proxy-{workers}.log"
    with cores(PROXY_CORES):
        proc = spawn(cmd, log, {"PYTHONPATH": str(repo / "src")})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    serving = re.compile(rf"serving \S+ on {re.escape(url)}")
    while not serving.search(log.read_text(errors="replace")):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the proxy did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)
    wait(url, proc)
    time.sleep(3)  # each worker's quick check of the upstream runs once it serves
    return proc, url


async def one(
    client: aiohttp.ClientSession, url: str, prompt: str, n: int, gaps: list[float] | None = None
) -> int:
    """Completion tokens of one streamed request (from its usage chunk); `gaps` gets the
    seconds between successive reads of its stream (a stall shows as a long one)."""
    body = {
        "prompt": prompt, "max_tokens": n, "temperature": 0,
        "stream": True, "logprobs": TOP, "stream_options": {"include_usage": True},
        "logit_bias": {str(i): -100 for i in EOS_IDS},
    }  # fmt: skip
    tail = b""
    last = None
    async with client.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            await r.read()
            return 0
        async for part in r.content.iter_any():
            tail = (tail + part)[-8192:]
            if gaps is not None:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            usage = json.loads(line[6:]).get("usage") or {}
            return int(usage.get("completion_tokens") or 0)
    return 0


async def load(
    url: str, args: argparse.Namespace, gaps: list[float] | None = None
) -> tuple[int, float]:
    """(tokens, seconds) of `--clients` clients each making `--requests` requests."""
    conn = aiohttp.TCPConnector(limit=args.clients)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as client:

        async def user(i: int) -> int:
            return sum([await one(client, url, PROMPTS[(i + k) % len(PROMPTS)], args.max_tokens,
                                  gaps) for k in range(args.requests)])  # fmt: skip

        start = time.perf_counter()
        counts = await asyncio.gather(*(user(i) for i in range(args.clients)))
        return sum(counts), time.perf_counter() - start


def start_vllm(args: argparse.Namespace, logs: Path) -> tuple[subprocess.Popen[bytes], str]:
    """vLLM's OpenAI server on the demo model (float32, eager, a context of 512), once
    it answers."""
    port = free_port()
    cmd = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model",
           str(DEMO), "--served-model-name", "demo", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "512", "--enforce-eager"]  # fmt: skip
    proc = spawn(cmd, logs / "vllm.log", {"VLLM_CPU_KVCACHE_SPACE": "1"})
    url = f"http://127.0.0.1:{port}"
    return answering(proc, url, "/v1/models", logs / "vllm.log", 900), url


def answering(proc: subprocess.Popen[bytes], url: str, path: str, log: Path,
              seconds: float) -> subprocess.Popen[bytes]:  # fmt: skip
    """`proc` once `url` + `path` answers (or exit naming its log, within `seconds`)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            httpx.get(url + path, timeout=5).raise_for_status()
            return proc
        except httpx.HTTPError as e:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-3000:]
                raise SystemExit(f"{log.stem} did not start:\n{tail}") from e
            time.sleep(0.2)


def start_replay(target: str, logs: Path, pace: float = 0.0) -> tuple[subprocess.Popen[bytes], str]:
    """`replay_upstream.py` in front of `target` (events `pace` ms apart), once it answers."""
    port = free_port()
    cmd = [sys.executable, str(Path(__file__).with_name("replay_upstream.py")),
           "--target", target, "--port", str(port), "--pace", str(pace)]  # fmt: skip
    proc = spawn(cmd, logs / "replay.log")
    url = f"http://127.0.0.1:{port}"
    return answering(proc, url, "/_replay/stats", logs / "replay.log", 60), url


def replay_stats(url: str) -> dict[str, int] | None:
    try:
        return httpx.get(url + "/_replay/stats", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return None


def run_once(upstream: tuple[list[subprocess.Popen[bytes]], str], workers: int,
             args: argparse.Namespace, logs: Path,
             repo: Path | None = None) -> dict[str, float]:  # fmt: skip
    procs, upstream_url = upstream
    proxy, url = start_proxy(upstream_url, workers, logs, repo or args.proxy_repo or REPO)
    try:
        asyncio.run(load(url, argparse.Namespace(**{**vars(args), "requests": 1})))  # warm-up
        before = replay_stats(upstream_url) if args.replay else None
        cpu_proxy = cpu_seconds(proxy.pid)
        cpu_up = sum(cpu_seconds(p.pid) for p in procs)
        cpu_clients = time.process_time()
        gaps: list[float] = []
        tokens, seconds = asyncio.run(load(url, args, gaps))
        cpu_clients = time.process_time() - cpu_clients
        cpu_proxy = cpu_seconds(proxy.pid) - cpu_proxy
        cpu_up = sum(cpu_seconds(p.pid) for p in procs) - cpu_up
        after = replay_stats(upstream_url) if args.replay else None
    finally:
        proxy.terminate()
        proxy.wait(60)
    return {"workers": workers, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "proxy_us_per_token": 1e6 * cpu_proxy / tokens,
            "upstream_us_per_token": 1e6 * cpu_up / tokens,
            "clients_us_per_token": 1e6 * cpu_clients / tokens,
            "cores_busy": (cpu_proxy + cpu_up + cpu_clients) / seconds,
            "gap_p99_ms": 1e3 * percentile(gaps, 0.99), "gap_max_ms": 1e3 * max(gaps, default=0.0),
            **({"replay_misses": after["misses"] - before["misses"],
                "replay_hits": after["hits"] - before["hits"]}
               if before and after else {})}  # fmt: skip


def report_before_after(runs: list[dict[str, float]], args: argparse.Namespace) -> str:
    """The table of a `--before` run: each side's medians, and after / before."""
    def med(side: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["side"] == side)

    lines = [
        "# The proxy before and after a change, 1 worker each",
        "",
        f"Command: `flock /tmp/tt-bench.lock python {' '.join(sys.argv)}`",
        f"Load: {args.clients} clients x {args.requests} streamed completions of "
        f"{args.max_tokens} tokens, logprobs {TOP}"
        + (f", each stream's events {args.pace:g} ms apart" if args.pace else "")
        + f"; medians of {args.rounds} rounds, the sides taking turns to go first.",
        "",
        "| proxy | tokens/s | proxy CPU µs/token | every round's proxy CPU µs/token |",
        "|---|---:|---:|---|",
    ]
    for side in ("before", "after"):
        each = ", ".join(f"{r['proxy_us_per_token']:.0f}" for r in runs if r["side"] == side)
        lines.append(f"| {side} | {med(side, 'tokens_per_s'):,.0f} | "
                     f"{med(side, 'proxy_us_per_token'):,.0f} | {each} |")  # fmt: skip
    cpu = med("after", "proxy_us_per_token") / med("before", "proxy_us_per_token")
    paired = [a["proxy_us_per_token"] / b["proxy_us_per_token"]
              for a in runs if a["side"] == "after"
              for b in runs if b["side"] == "before" and b["round"] == a["round"]]  # fmt: skip
    lower = sum(r < 1 for r in paired)
    return "\n".join([
        *lines, "", f"Proxy CPU per token, after / before: **{cpu:.2f}** (medians); "
        f"each round's after / before: median {statistics.median(paired):.3f}, "
        f"after lower in {lower} of {len(paired)} rounds.", "",
    ])


def report(runs: list[dict[str, float]], args: argparse.Namespace) -> str:
    def med(w: int, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["workers"] == w)

    one_w, many = med(1, "tokens_per_s"), med(args.workers, "tokens_per_s")
    lines = [
        "# `serve --upstream --workers N`: throughput with N workers vs 1",
        "",
        f"Command: `flock /tmp/tt-bench.lock python {' '.join(sys.argv)}`",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs (usable: "
        f"{len(os.sched_getaffinity(0))}), Python {platform.python_version()}",
        (
            "Upstream: vLLM's OpenAI server on the demo model (CPU build, float32, eager)"
            if args.vllm_python
            else f"Upstream: llama-server on `{Path(args.gguf).name}`, {args.slots} slots, "
            f"{args.threads} thread(s)"
        )
        + (
            ", behind `replay_upstream.py` (measured requests answered from its recording "
            "of the upstream's own responses; upstream CPU is the replay's and "
            "the upstream's together)"
            if args.replay
            else ""
        )
        + (f", each stream's events {args.pace:g} ms apart" if args.replay and args.pace else "")
        + f". Load: {args.clients} clients x {args.requests} "
        f"streamed completions of {args.max_tokens} tokens, logprobs {TOP}; "
        f"medians of {args.rounds} rounds, 1 and N workers taking turns to go first."
        + (f" Pinned: the proxy on cores {sorted(PROXY_CORES)}, everything else on "
           f"{sorted(LOAD_CORES or ())}." if PROXY_CORES else "")
        + (f" Proxy from `{args.proxy_repo}`." if args.proxy_repo else ""),
        "",
        "| workers | tokens/s | ratio to 1 worker | proxy CPU µs/token | upstream CPU µs/token "
        "| clients' CPU µs/token | machine's cores busy | gap between reads p99 / max ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in (1, args.workers):
        lines.append(
            f"| {w} | {med(w, 'tokens_per_s'):,.0f} | {med(w, 'tokens_per_s') / one_w:.2f}x | "
            f"{med(w, 'proxy_us_per_token'):,.0f} | {med(w, 'upstream_us_per_token'):,.0f} | "
            f"{med(w, 'clients_us_per_token'):,.0f} | {med(w, 'cores_busy'):.2f} | "
            f"{med(w, 'gap_p99_ms'):.0f} / {med(w, 'gap_max_ms'):.0f} |"
        )
    lines += ["", f"Ratio {args.workers} workers / 1: **{many / one_w:.2f}x**.", "",
              "Every round:", "", "```", *(json.dumps(r) for r in runs), "```", ""]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gguf = next(iter(sorted((CACHE / "gguf").glob("tokentrail-demo-*-f32.gguf"))), None)
    parser.add_argument("--gguf", default=gguf, help="the demo model's GGUF")
    parser.add_argument("--server", default=SERVER, help="llama-server binary")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=4, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="llama-server's threads")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--replay",
        action="store_true",
        help="put replay_upstream.py between the proxy and llama-server: "
        "measured requests are answered from its recording, so the proxy "
        "is the limit (a GPU upstream spends its own hardware)",
    )
    parser.add_argument(
        "--pace", type=float, default=0.0, help="with --replay: ms between a stream's events"
    )
    parser.add_argument("--output", type=Path)
    parser.add_argument(
        "--proxy-repo", type=Path, help="run the proxy from this checkout's src/ (before/after)"
    )
    parser.add_argument(
        "--before", type=Path,
        help="A/B instead: each round runs 1 worker from this checkout's src/ (before a "
        "change), then 1 from --proxy-repo or this file's own checkout (after)",
    )
    parser.add_argument("--logs", type=Path, help="keep the servers' logs here")
    parser.add_argument(
        "--vllm-python", type=Path, help="upstream: vLLM's server (this python's) on the demo model"
    )
    parser.add_argument(
        "--pin", action="store_true",
        help="the proxy on the first --workers cores, the upstream, replay and clients on "
        "the rest (needs more cores than --workers)",
    )
    args = parser.parse_args()
    global PROXY_CORES, LOAD_CORES
    if args.pin:
        PROXY_CORES, LOAD_CORES = split_cores(args.workers)
        os.sched_setaffinity(0, LOAD_CORES)  # the clients, and what starts from here
    if args.gguf is None and args.vllm_python is None:
        raise SystemExit("no demo GGUF: run scripts/demo_model_to_gguf.py (or give --gguf)")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        logs = args.logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        first = start_vllm(args, logs) if args.vllm_python else start_llama(args, logs)
        procs, url = [first[0]], first[1]
        try:
            if args.replay:
                replay = start_replay(url, logs, args.pace)
                procs, url = [first[0], replay[0]], replay[1]
            for k in range(args.rounds):
                # The two sides take turns to go first (ABBA): the second of two runs
                # back to back costs more here (the A/A check in the module's text).
                if args.before is not None:
                    sides = [("before", args.before), ("after", None)]
                    for side, repo in sides if k % 2 == 0 else sides[::-1]:
                        run = run_once((procs, url), 1, args, logs, repo)
                        runs.append({**run, "side": side, "round": k})
                        print(json.dumps(runs[-1]), flush=True)
                    continue
                for workers in (1, args.workers) if k % 2 == 0 else (args.workers, 1):
                    runs.append({**run_once((procs, url), workers, args, logs), "round": k})
                    print(json.dumps(runs[-1]), flush=True)
        finally:
            for proc in procs:
                stop(proc)
    text = report_before_after(runs, args) if args.before else report(runs, args)
    print(text)
    if args.output is not None:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
