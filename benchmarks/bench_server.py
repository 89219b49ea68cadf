"""Load test: `tokentrail serve` against `mlx_lm.server` on loopback (a benchmark, not a test).

Starts each server in turn on the same model folder, both with their default flags, then
runs C concurrent streaming chat clients (C = 1, 4, 16, 32 by default), each sending the
same fixed requests (temperature 0, end-of-sequence suppressed with logit_bias, so every
request generates exactly --max-tokens tokens; logprobs with 5 alternatives asked of
both, and tokentrail's attribution always on). Reports throughput (completion tokens
from `usage` over wall time), time to first token (TTFT) and inter-token latency (ITL)
p50/p99 for each, and the ratios. `--rounds N` repeats the whole comparison N times
(servers one at a time, alternating) and reports the median of each figure.

Then the second-turn case, one client: a new conversation (its first turn), then the
same conversation one message longer (its second turn, which must reuse the prompt
cache: `usage.prompt_tokens_details.cached_tokens`), TTFT of each, medians over
--conversations conversations.

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
    text: str = ""
    cached: int = 0
    prompt_tokens: int = 0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def process_cpu(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) the process `pid` has used so far, from
    /proc (None where there is none)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


def start_server(kind: str, folder: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """Start tokentrail serve or mlx_lm.server (default flags) on a free port; wait until
    it answers."""
    port = free_port()
    if kind == "tokentrail":
        cmd = [
            sys.executable,
            "-m",
            "tokentrail.server",
            "--model",
            str(folder),
            "--port",
            str(port),
            "--log-level",
            "warning",
        ]
        probe = "/health"
    else:
        cmd = [
            sys.executable,
            "-m",
            "mlx_lm.server",
            "--model",
            str(folder),
            "--port",
            str(port),
            "--log-level",
            "WARNING",
        ]
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


def body_for(
    i: int, model_name: str, max_tokens: int, bias: dict[str, int], tag: str | None = None
) -> dict[str, Any]:
    """Request `i`: one of PROMPTS in turn; with `tag`, led by `(tag i)` so that no other
    request's prompt shares more than the chat template's opening with it."""
    content = PROMPTS[i % len(PROMPTS)]
    if tag is not None:
        content = f"({tag} {i}) {content}"
    return {
        "model": model_name,
        "messages": [{"role": "user", "content": content}],
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
    text: list[str] = []
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
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    res.cached = int(details.get("cached_tokens") or 0)
                    res.prompt_tokens = int(chunk["usage"].get("prompt_tokens") or 0)
                choices = chunk.get("choices") or [{}]
                content = (choices[0].get("delta") or {}).get("content")
                if not content:
                    continue  # no text yet (ours: a held-back token; theirs: none sent)
                text.append(content)
                if last is None:
                    res.ttft = now - start
                else:
                    res.gaps.append(now - last)
                last = now
        res.ok = res.tokens > 0
        res.text = "".join(text)
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
    tag: str | None = None,
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
                            first_prompt + c * requests_each + r, model_name, max_tokens, bias, tag
                        ),
                    )
                )
            return out

        t0 = time.perf_counter()
        per_client = await asyncio.gather(*(worker(c) for c in range(clients)))
        wall = time.perf_counter() - t0
    return [r for rs in per_client for r in rs], wall


def summarize(
    results: list[RequestResult], wall: float, cpu: float | None = None
) -> dict[str, Any]:
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
        "itl_mean": statistics.mean(gaps) if gaps else float("nan"),
        "streaming_tok_s": 1 / statistics.mean(gaps) if gaps else float("nan"),
        "wall": wall,
        # the server process's CPU time per completion token (both servers do the same
        # model work; the rest is each one's own overhead)
        "cpu_per_token": cpu / tokens if cpu is not None and tokens else float("nan"),
        "error_kinds": sorted({r.error for r in results if not r.ok}),
    }


def second_turn(
    url: str, model_name: str, conversations: int, max_tokens: int, bias: dict[str, int]
) -> dict[str, list[float]]:
    """One client: each conversation's first turn, then the same conversation one message
    longer (which must reuse the prompt cache). TTFT and cached prompt tokens of each."""

    async def run() -> dict[str, list[float]]:
        out: dict[str, list[float]] = {
            "first": [],
            "second": [],
            "cached_first": [],
            "cached_second": [],
            "prompt_second": [],
        }
        async with httpx.AsyncClient(timeout=600) as client:
            for k in range(conversations):
                body = body_for(k, model_name, max_tokens, bias)
                body["messages"] = [
                    {"role": "user", "content": f"Conversation {k}. {PROMPTS[k % len(PROMPTS)]}"}
                ]
                first = await one_request(client, url, body)
                body["messages"] = [
                    *body["messages"],
                    {"role": "assistant", "content": first.text},
                    {"role": "user", "content": "Tell me more about that."},
                ]
                second = await one_request(client, url, body)
                if first.ok and second.ok:
                    out["first"].append(first.ttft)
                    out["second"].append(second.ttft)
                    out["cached_first"].append(first.cached)
                    out["cached_second"].append(second.cached)
                    out["prompt_second"].append(second.prompt_tokens)
        return out

    return asyncio.run(run())


def server_metrics(url: str) -> dict[str, float]:
    """tokentrail's /metrics samples that attribute TTFT (sums and counts)."""
    wanted = (
        "tokentrail_time_to_first_token_seconds_",
        "tokentrail_queue_wait_seconds_",
        "tokentrail_prefill_seconds_",
        "tokentrail_queued_for_room_total",
    )
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith(wanted) and name.endswith(("_sum", "_count", "_total")):
            out[name] = float(value)
    return out


def bench(
    kind: str,
    folder: Path,
    args: argparse.Namespace,
    levels: list[int],
    bias: dict[str, int],
    notes: dict[str, Any],
) -> dict[str, Any]:
    log = Path(tempfile.mkdtemp(prefix=f"bench-{kind}-")) / "server.log"
    proc, url = start_server(kind, folder, log)
    rows = []
    try:
        # mlx_lm.server serves the model it loaded as "default_model".
        name = (
            "default_model"
            if kind == "mlx_lm"
            else httpx.get(url + "/v1/models").json()["data"][0]["id"]
        )
        asyncio.run(run_level(url, name, 1, 2, args.max_tokens, bias))  # warm-up
        for c in levels:
            cpu_before = process_cpu(proc.pid)
            results, wall = asyncio.run(
                run_level(url, name, c, args.requests, args.max_tokens, bias)
            )
            cpu_after = process_cpu(proc.pid)
            cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
            rows.append((c, summarize(results, wall, cpu)))
            s = rows[-1][1]
            print(
                f"{kind} C={c}: {s['tok_s']:.1f} tok/s, TTFT p50 {s['ttft_p50'] * 1e3:.1f} ms, "
                f"ITL p50 {s['itl_p50'] * 1e3:.2f} ms, server CPU {s['cpu_per_token'] * 1e3:.2f} "
                f"ms/token, errors {s['errors']}",
                flush=True,
            )
        if kind == "tokentrail":
            health = httpx.get(url + "/health").json()
            notes["batch_kind"] = health.get("batch_kind")
            notes["max_batch"] = health.get("max_batch")
            notes.setdefault("metrics", []).append(server_metrics(url))
        turns = second_turn(url, name, args.conversations, args.max_tokens, bias)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {"levels": rows, "turns": turns}


def median_of(runs: list[dict[str, Any]], i: int, key: str) -> float:
    """The median over rounds of level `i`'s figure `key`."""
    return statistics.median(r["levels"][i][1][key] for r in runs)


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def spread(runs: list[dict[str, Any]], i: int, key: str, scale: float = 1.0) -> str:
    """Level `i`'s figure `key`: the median over rounds, and the range when there are
    several rounds."""
    values = [r["levels"][i][1][key] * scale for r in runs]
    med = statistics.median(values)
    if len(values) < 2:
        return f"{med:.1f}"
    return f"{med:.1f} ({min(values):.0f}–{max(values):.0f})"


def level_table(
    levels: list[int], ours: list[dict[str, Any]], theirs: list[dict[str, Any]]
) -> list[str]:
    lines = [
        "| clients | tok/s ours | tok/s mlx_lm | ratio | TTFT p50 ours (ms) "
        "| TTFT p50 mlx_lm (ms) | TTFT ratio | ITL p50 ours / mlx_lm (ms) "
        "| ITL mean ours / mlx_lm (ms) | ITL p99 ours / mlx_lm (ms) "
        "| server CPU per token ours / mlx_lm (ms) | errors |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|---:|",
    ]
    keys = ("tok_s", "ttft_p50", "itl_p50", "itl_mean", "itl_p99", "cpu_per_token")
    for i, c in enumerate(levels):
        a = {k: median_of(ours, i, k) for k in keys}
        b = {k: median_of(theirs, i, k) for k in keys}
        errors = (
            sum(r["levels"][i][1]["errors"] for r in ours),
            sum(r["levels"][i][1]["errors"] for r in theirs),
        )
        lines.append(
            f"| {c} | {spread(ours, i, 'tok_s')} | {spread(theirs, i, 'tok_s')} | "
            f"{a['tok_s'] / b['tok_s']:.2f} | "
            f"{spread(ours, i, 'ttft_p50', 1e3)} | {spread(theirs, i, 'ttft_p50', 1e3)} | "
            f"{a['ttft_p50'] / b['ttft_p50']:.2f} | "
            f"{a['itl_p50'] * 1e3:.2f} / {b['itl_p50'] * 1e3:.2f} | "
            f"{a['itl_mean'] * 1e3:.2f} / {b['itl_mean'] * 1e3:.2f} | "
            f"{a['itl_p99'] * 1e3:.2f} / {b['itl_p99'] * 1e3:.2f} | "
            f"{a['cpu_per_token'] * 1e3:.2f} / {b['cpu_per_token'] * 1e3:.2f} | "
            f"{errors[0]} / {errors[1]} |"
        )
    return lines


def turn_table(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| server | TTFT p50 first turn (ms) | TTFT p50 second turn (ms) "
        "| cached prompt tokens, second turn (median, of prompt) |",
        "|---|---:|---:|---|",
    ]
    for label, runs in (("tokentrail", ours), ("mlx_lm", theirs)):
        t = {k: [x for r in runs for x in r["turns"][k]] for k in runs[0]["turns"]}
        if not t["first"]:
            lines.append(f"| {label} | - | - | - |")
            continue
        lines.append(
            f"| {label} | {_ms(statistics.median(t['first']))} | "
            f"{_ms(statistics.median(t['second']))} | "
            f"{statistics.median(t['cached_second']):.0f} of "
            f"{statistics.median(t['prompt_second']):.0f} |"
        )
    return lines


def attribution(notes: dict[str, Any]) -> str:
    """tokentrail's own split of TTFT, from /metrics, over every run's requests."""
    runs = notes.get("metrics") or []

    def total(key: str) -> float:
        return sum(m.get(key, 0.0) for m in runs)

    def mean(prefix: str) -> str:
        n = total(prefix + "_count")
        return f"{total(prefix + '_sum') / n * 1e3:.1f} ms" if n else "-"

    return (
        f"- tokentrail's /metrics over the load runs: mean TTFT "
        f"{mean('tokentrail_time_to_first_token_seconds')} = queue wait "
        f"{mean('tokentrail_queue_wait_seconds')} + prefill (joining the batch to the first "
        f"token) {mean('tokentrail_prefill_seconds')} + preparing the prompt; "
        f"{total('tokentrail_queued_for_room_total'):.0f} requests waited for room in the batch"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the demo model)")
    ap.add_argument("--clients", default="1,4,16,32", help="concurrency levels (comma list)")
    ap.add_argument("--requests", type=int, default=2, help="requests per client per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="whole comparisons; medians reported")
    ap.add_argument(
        "--conversations",
        type=int,
        default=6,
        help="conversations in the second-turn case, per round",
    )
    ap.add_argument("--output", type=Path, default=None, help="write the markdown report here")
    args = ap.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    folder = model_folder(args.model)
    bias = {str(i): -100 for i in special_ids(folder)}
    notes: dict[str, Any] = {}
    ours: list[dict[str, Any]] = []
    theirs: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    for r in range(args.rounds):  # one server at a time, the order alternating
        for kind in ("tokentrail", "mlx_lm") if r % 2 == 0 else ("mlx_lm", "tokentrail"):
            (ours if kind == "tokentrail" else theirs).append(
                bench(kind, folder, args, levels, bias, notes)
            )

    import mlx.core as mx
    import mlx_lm

    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
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
        f"alternatives (tokentrail's attribution always on); {args.requests} requests per "
        f"client; servers run one at a time; {args.rounds} round(s), medians over rounds",
        f"- both servers with their default flags: tokentrail serve's batch "
        f"`{notes.get('batch_kind')}` at the engine's capacity ({notes.get('max_batch')} "
        "sequences); mlx_lm.server's BatchGenerator (decode concurrency 32)",
        f"- load average before: {' '.join(f'{x:.2f}' for x in load_before)}, when done: "
        f"{load} (the CPUs are shared with the client process and anything else running)",
        "- TTFT and ITL count content-bearing chunks on both sides (mlx_lm.server sends a "
        "chunk only when text is ready, tokentrail one per token); ratio: ours / mlx_lm "
        "of the medians; (a–b): the range over rounds; server CPU per token: the server "
        "process's CPU time (all its threads, from /proc) over a level's run divided by the "
        "completion tokens it served, a figure that other load on the machine moves less "
        "than wall-clock latency",
        attribution(notes),
        "",
        *level_table(levels, ours, theirs),
        "",
        f"Second turn (one client, {args.conversations} conversations per round): the same "
        "conversation, one message longer, reuses the prompt cache.",
        "",
        *turn_table(ours, theirs),
    ]
    errors = sorted(
        {
            e
            for runs in (ours, theirs)
            for run in runs
            for _, s in run["levels"]
            for e in s["error_kinds"]
        }
    )
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
