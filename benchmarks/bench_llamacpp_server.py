"""`tokentrail serve --engine llamacpp` against llama.cpp's own `llama-server`, side by side.

Both servers run at once on loopback, on the same GGUF (SmolLM2-135M-Instruct Q4_1 by
default), with the same sequence slots (`-np S` / `--max-batch S`), the same context
(`-c N --kv-unified` / `--n-ctx N`: one KV cache shared by the slots) and the same CPU
threads (`-t T` / `--n-threads T`). For C = 1, 4, 16 concurrent streaming chat clients
(greedy, the end-of-generation tokens suppressed with logit_bias so every request makes
exactly --max-tokens tokens, logprobs with 5 alternatives asked of both; tokentrail's
attribution is always on), each level runs on llama-server, then on tokentrail, --rounds
times, and the report gives medians over rounds: throughput (completion tokens from
`usage` over wall time), time to first token (TTFT) and inter-token latency, and the
ratios ours / llama-server's. Two prompt modes (`--prompts`): *cycled*, 4 fixed prompts
in turn, which a prompt cache serves after the first few (so it measures each server's
cache policy too), and *distinct*, each request's message led by a tag of its own, so
only the chat template's opening can come from a cache (the servers' own cost).

Then the repeated-prompt case: one client per server sends the same chat prompt
--repeats times, the servers taking turns; TTFT p50 of each server and the prompt tokens
it reports as cached (`usage.prompt_tokens_details.cached_tokens`).

    python benchmarks/bench_llamacpp_server.py --rounds 3 \\
        --output benchmarks/results/llamacpp-server.md

`--setup defaults` is the comparison a user makes instead: each server at its own
defaults with only the slots, context and threads given (`-np S -c N -t T`: llama-server
with its default flash attention `auto`, its own KV cache layout and batch sizes;
tokentrail with `--max-batch S --n-ctx N --n-threads T` and nothing else), and the
clients ask what each server's user asks: plain streaming chat of llama-server (no
logprobs), tokentrail with `logprobs` and 5 alternatives (its attribution is always on);
`--ours-asks plain` sends tokentrail the same plain request.

    python benchmarks/bench_llamacpp_server.py --setup defaults --ctx 8192 --rounds 3 \\
        --output /tmp/defaults.md

The client code (requests, timing, summaries) is `bench_server.py`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_proxy import stop, wait
from bench_server import (
    body_for,
    free_port,
    one_request,
    percentile,
    run_level,
    summarize,
)

REPO = Path(__file__).resolve().parents[1]
GGUF = Path.home() / ".cache/tokentrail/models/SmolLM2-135M-Instruct.Q4_1.gguf"
SERVER = Path.home() / ".cache/tokentrail/llama.cpp-0.3.36/build/bin/llama-server"
KINDS = ("llama-server", "tokentrail")


def eog_bias(gguf: Path) -> dict[str, int]:
    """logit_bias -100 for every end-of-generation id, as llama.cpp's vocabulary says."""
    import llama_cpp

    from tokentrail.engines.llamacpp.engine import LlamaCppTokenizer

    llama = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    return {str(i): -100 for i in sorted(LlamaCppTokenizer(llama).eos_token_ids)}


def start(kind: str, args: argparse.Namespace, logs: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if kind == "llama-server":
        cmd = [
            str(args.server),
            "-m",
            str(args.gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-c",
            str(args.ctx),
            "-np",
            str(args.slots),
            "-t",
            str(args.threads),
            "--no-webui",
        ]
        if args.setup == "like":  # one unified KV cache, flash attention off on both
            cmd += ["--kv-unified", "-fa", "off"]
        cmd += args.llama_flag
        env = None
    else:
        cmd = [
            sys.executable,
            "-m",
            "tokentrail",
            "serve",
            "--engine",
            "llamacpp",
            "--model",
            str(args.gguf),
            "--port",
            str(port),
            "--n-ctx",
            str(args.ctx),
            "--max-batch",
            str(args.slots),
            "--n-threads",
            str(args.threads),
            "--max-queue",
            str(4 * args.slots),
            "--log-level",
            "warning",
        ]
        if args.setup == "like":
            cmd += ["--flash-attn", "off"]
        cmd += args.ours_flag
        env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
        if args.ggml_libs:  # the same ggml/llama libraries as llama-server's
            env["LLAMA_CPP_LIB_PATH"] = str(args.ggml_libs)
    out = (logs / f"{kind}.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait(url, proc)
    return proc, url


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def plain_for(args: argparse.Namespace, kind: str) -> bool:
    """Whether `kind`'s clients ask no logprobs: llama-server's at `--setup defaults`, and
    tokentrail's too with `--ours-asks plain` (the same request to both)."""
    if args.setup != "defaults":
        return False
    return kind == "llama-server" or args.ours_asks == "plain"


def plain(body: dict[str, Any]) -> dict[str, Any]:
    """`body` as a plain llama-server user sends it: no logprobs asked."""
    return {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}


async def plain_level(
    url: str,
    model_name: str,
    clients: int,
    requests_each: int,
    max_tokens: int,
    bias: dict[str, int],
    tag: str | None = None,
) -> tuple[list[Any], float]:
    """`bench_server.run_level` with plain bodies (no logprobs), for `--setup defaults`'s
    llama-server clients."""
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker(c: int) -> list[Any]:
            out = []
            for r in range(requests_each):
                body = body_for(c * requests_each + r, model_name, max_tokens, bias, tag)
                out.append(await one_request(client, url, plain(body)))
            return out

        t0 = time.perf_counter()
        per_client = await asyncio.gather(*(worker(c) for c in range(clients)))
        wall = time.perf_counter() - t0
    return [r for rs in per_client for r in rs], wall


def repeated(
    urls: dict[str, str], bodies: dict[str, dict[str, Any]], n: int
) -> dict[str, dict[str, float]]:
    """One client per server, the same request `n` times on each, the servers taking turns
    request by request (so both see the same machine): per server, TTFT p50 and cached
    prompt tokens (median)."""

    async def go() -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {k: [] for k in KINDS}
        async with httpx.AsyncClient(timeout=600) as a, httpx.AsyncClient(timeout=600) as b:
            clients = dict(zip(KINDS, (a, b), strict=True))
            for i in range(n):
                for kind in KINDS if i % 2 == 0 else KINDS[::-1]:
                    out[kind].append(await one_request(clients[kind], urls[kind], bodies[kind]))
        return out

    got = asyncio.run(go())
    summary = {}
    for kind in KINDS:
        res = [r for r in got[kind] if r.ok]
        summary[kind] = {
            "ttft_p50": percentile([r.ttft for r in res], 0.5),
            "cached": statistics.median(r.cached for r in res) if res else float("nan"),
            "prompt": statistics.median(r.prompt_tokens for r in res) if res else float("nan"),
        }
    return summary


def measure(
    args: argparse.Namespace,
    urls: dict[str, str],
    names: dict[str, str],
    bias: dict[str, int],
    pids: dict[str, int],
) -> dict[str, Any]:
    """Every prompt mode x round x level x server (the server order alternating by
    round), then the repeated prompt. `runs[mode][server][clients]` lists each round's
    summary."""
    levels = [int(c) for c in args.clients.split(",")]
    modes = args.prompts.split(",")
    runs = {m: {k: {c: [] for c in levels} for k in KINDS} for m in modes}
    for kind in KINDS:  # warm up both
        asyncio.run(run_level(urls[kind], names[kind], 2, 1, 8, bias))
    for mode in modes:
        for r in range(args.rounds):
            for c in levels:
                order = KINDS if r % 2 == 0 else KINDS[::-1]
                for kind in order:
                    # distinct: a tag no earlier request had, on both servers alike
                    tag = f"r{r}c{c}" if mode == "distinct" else None
                    cpu = cpu_seconds(pids[kind])
                    plain_user = plain_for(args, kind)
                    results, wall = asyncio.run(
                        (plain_level if plain_user else run_level)(
                            urls[kind],
                            names[kind],
                            c,
                            args.requests,
                            args.max_tokens,
                            bias,
                            tag=tag,
                        )
                    )
                    s = summarize(results, wall)
                    s["tok_cpu_s"] = s["tokens"] / max(cpu_seconds(pids[kind]) - cpu, 1e-9)
                    runs[mode][kind][c].append(s)
                    row = dict(s)  # error_kinds too: what failed, if anything
                    print(
                        json.dumps({"mode": mode, "round": r, "server": kind, "clients": c, **row}),
                        flush=True,
                    )
    bodies = {k: body_for(0, names[k], args.max_tokens, bias) for k in KINDS}
    bodies = {k: plain(b) if plain_for(args, k) else b for k, b in bodies.items()}
    rep = repeated(urls, bodies, args.repeats)
    return {"levels": levels, "modes": modes, "runs": runs, "repeated": rep}


def med(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def row(c: int, a: list[dict[str, Any]], b: list[dict[str, Any]]) -> str:
    """One table row: level `c`, llama-server's rounds `a`, tokentrail's `b`."""
    errors = (sum(s["errors"] for s in a), sum(s["errors"] for s in b))
    return (
        f"| {c} | {med(a, 'tok_s'):.1f} | {med(b, 'tok_s'):.1f} | "
        f"{med(b, 'tok_s') / med(a, 'tok_s'):.2f} | {med(a, 'ttft_p50') * 1e3:.1f} | "
        f"{med(b, 'ttft_p50') * 1e3:.1f} | {med(b, 'ttft_p50') / med(a, 'ttft_p50'):.2f} | "
        f"{med(a, 'itl_p50') * 1e3:.2f} / {med(b, 'itl_p50') * 1e3:.2f} | "
        f"{med(a, 'tok_cpu_s'):.0f} / {med(b, 'tok_cpu_s'):.0f} | "
        f"{med(b, 'tok_cpu_s') / med(a, 'tok_cpu_s'):.2f} | {errors[0]} / {errors[1]} |"
    )


def setup_lines(args: argparse.Namespace) -> list[str]:
    """The report's lines saying how the two servers were started."""
    if args.setup == "defaults":
        return [
            f"- model `{args.gguf.name}`; each server at its own defaults with {args.slots} "
            f"slots, a context of {args.ctx} tokens and {args.threads} threads "
            f"(`-np {args.slots} -c {args.ctx} -t {args.threads}` / `--max-batch "
            f"{args.slots} --n-ctx {args.ctx} --n-threads {args.threads}`): flash attention "
            "`auto` on both (on, on this CPU)",
        ]
    return [
        f"- model `{args.gguf.name}`; both servers: {args.slots} slots, one unified KV cache of "
        f"{args.ctx} tokens, {args.threads} threads (`-np {args.slots} -c {args.ctx} "
        f"--kv-unified -t {args.threads}` / `--max-batch {args.slots} --n-ctx {args.ctx} "
        f"--n-threads {args.threads}`)",
        "- flash attention off on both (`-fa off` / `--flash-attn off`: llama-cpp-python's "
        "own decode, exactly)",
    ]


def report(args: argparse.Namespace, data: dict[str, Any], load: tuple[float, ...]) -> str:
    import llama_cpp

    runs = data["runs"]
    cmd = " ".join(["python benchmarks/bench_llamacpp_server.py", *sys.argv[1:]])
    lines = [
        "# `tokentrail serve --engine llamacpp` vs llama-server",
        "",
        f"Command: `{cmd}`",
        "",
        f"- machine: {platform.machine()} {platform.system()} {platform.release()}, "
        f"{os.cpu_count()} CPUs (shared with the clients and other work; load average "
        f"{' '.join(f'{x:.2f}' for x in load)} at the end); Python {platform.python_version()}, "
        f"llama-cpp-python {llama_cpp.__version__}; llama-server from the same llama.cpp tree",
        *setup_lines(args),
        "- ggml: "
        + (
            f"both sides load the same libllama/libggml (tokentrail with "
            f"`LLAMA_CPP_LIB_PATH={args.ggml_libs}`, llama-server's build folder)"
            if args.ggml_libs
            else "tokentrail loads llama-cpp-python's bundled libllama/libggml, llama-server "
            "its own build"
        ),
        f"- streaming chat requests, {args.requests} per client per level, max_tokens "
        f"{args.max_tokens}, temperature 0, end-of-generation suppressed, "
        + (
            "`logprobs: true, top_logprobs: 5` asked of both"
            if args.setup == "like"
            else "the same plain request to both, no logprobs (what a llama-server user "
            "sends; tokentrail still attributes every token, with null logprobs and "
            "confidence as the request asked none)"
            if args.ours_asks == "plain"
            else "no logprobs asked of llama-server (a plain user), `logprobs: true, "
            "top_logprobs: 5` of tokentrail"
        )
        + " (tokentrail's attribution always on); "
        f"{args.rounds} round(s), the server order alternating; medians over rounds",
        "- prompts: *cycled*, 4 fixed chat prompts in turn (after the first few, each "
        "server may have any of them cached: this measures its prompt cache too); "
        "*distinct*, each request's message led by a tag no earlier request had (only the "
        "chat template's opening, the same on both, can come from a cache)",
        "- TTFT and ITL: the first and following content-bearing chunks; tok/CPU-s: "
        "completion tokens per CPU second of the server process (all its threads; less "
        "disturbed than wall time by other load on a shared machine); ratios: ours / "
        "llama-server's; errors: requests that failed (llama-server / tokentrail)",
    ]
    for mode in data["modes"]:
        lines += [
            "",
            f"Prompts {mode}:",
            "",
            "| clients | tok/s llama-server | tok/s tokentrail | ratio "
            "| TTFT p50 llama-server (ms) | TTFT p50 tokentrail (ms) | TTFT ratio "
            "| ITL p50 llama-server / tokentrail (ms) | tok/CPU-s llama-server / tokentrail "
            "| CPU ratio | errors |",
            "|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|",
        ]
        for c in data["levels"]:
            a, b = runs[mode]["llama-server"][c], runs[mode]["tokentrail"][c]
            lines.append(row(c, a, b))
    lines += [
        "",
        f"Repeated prompt (one client per server, the same request {args.repeats} times "
        "on each, the servers taking turns request by request):",
        "",
        "| server | TTFT p50 (ms) | cached prompt tokens (median, of prompt) |",
        "|---|---:|---|",
    ]
    for kind in KINDS:
        r = data["repeated"][kind]
        lines.append(
            f"| {kind} | {r['ttft_p50'] * 1e3:.1f} | {r['cached']:.0f} of {r['prompt']:.0f} |"
        )
    seen = {
        f"{kind}: {e}"
        for m in runs.values()
        for kind, levels in m.items()
        for rounds in levels.values()
        for s in rounds
        for e in s.get("error_kinds") or []
    }
    if seen:  # a failed request's tokens count as none in its round's tokens/s
        lines += ["", "Errors seen: " + "; ".join(sorted(seen))]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, default=GGUF)
    ap.add_argument(
        "--server", type=Path, default=Path(os.environ.get("TOKENTRAIL_LLAMA_SERVER") or SERVER)
    )
    ap.add_argument("--clients", default="1,4,16", help="concurrency levels (comma list)")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=4096, help="KV cache tokens, all slots")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=2, help="requests per client per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--repeats", type=int, default=8, help="requests per server in the repeated case"
    )
    ap.add_argument(
        "--prompts",
        default="cycled,distinct",
        help="prompt modes, a comma list of cycled (4 fixed prompts in turn) and distinct "
        "(each request's message led by its own tag)",
    )
    ap.add_argument(
        "--setup",
        choices=("like", "defaults"),
        default="like",
        help="like: the same KV cache layout and flash attention off on both, logprobs asked "
        "of both; defaults: each server at its defaults (slots, context, threads given), "
        "llama-server's clients asking no logprobs",
    )
    ap.add_argument(
        "--ours-asks",
        choices=("top5", "plain"),
        default="top5",
        help="with --setup defaults, what tokentrail's clients ask: top5 (`logprobs` and 5 "
        "alternatives, the issue's comparison) or plain (the same request llama-server's "
        "user sends)",
    )
    ap.add_argument(
        "--llama-flag",
        action="append",
        default=[],
        help="one more llama-server argument (repeat it for several; e.g. "
        "--llama-flag=--kv-unified)",
    )
    ap.add_argument(
        "--ours-flag",
        action="append",
        default=[],
        help="one more `tokentrail serve` argument (repeat it for several; e.g. "
        "--ours-flag=--kv-unified --ours-flag=off)",
    )
    ap.add_argument("--output", type=Path, default=None, help="write the markdown report here")
    ap.add_argument(
        "--ggml-libs",
        type=Path,
        default=None,
        help="folder of the libllama/libggml that tokentrail's llama-cpp-python loads "
        "(LLAMA_CPP_LIB_PATH); default: llama-server's own folder when it has them, so both "
        "sides run one ggml build; '' for llama-cpp-python's bundled libraries",
    )
    args = ap.parse_args()
    bad = set(args.prompts.split(",")) - {"cycled", "distinct"}
    if bad:
        ap.error(f"--prompts: unknown mode(s) {', '.join(sorted(bad))} (cycled, distinct)")
    if args.ggml_libs is None:
        here = args.server.resolve().parent
        args.ggml_libs = here if (here / "libllama.so").exists() else None
    elif not str(args.ggml_libs) or str(args.ggml_libs) == ".":
        args.ggml_libs = None
    bias = eog_bias(args.gguf)
    logs = Path(tempfile.mkdtemp(prefix="bench-llamacpp-server-"))
    procs: list[subprocess.Popen] = []
    urls, names, pids = {}, {}, {}
    try:
        for kind in KINDS:
            proc, urls[kind] = start(kind, args, logs)
            procs.append(proc)
            pids[kind] = proc.pid
            names[kind] = httpx.get(urls[kind] + "/v1/models").json()["data"][0]["id"]
        data = measure(args, urls, names, bias, pids)
    finally:
        for proc in procs:
            stop(proc)
        time.sleep(0.1)
    text = report(args, data, os.getloadavg())
    print(text)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text, encoding="utf-8")
        args.output.with_suffix(".json").write_text(json.dumps(data, indent=1), "utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
