"""`tokentrail serve --engine vllm` against vLLM's own OpenAI server, one server up at a time.

Both run vLLM in the vLLM venv (`--vllm-python`, default $TOKENTRAIL_VLLM_PYTHON) on the
same Hugging Face folder (SmolLM2-135M-Instruct, float32, made from the GGUF as
tests/test_vllm_server.py makes it) with the same engine settings (`--dtype float32
--max-model-len 2048 --enforce-eager`, VLLM_CPU_KVCACHE_SPACE=1): vLLM's
`python -m vllm.entrypoints.openai.api_server`, and ours `python -m tokentrail.server
--engine vllm` from this tree. Only one server is up at a time (vLLM on a small CPU box
takes all of it); `--cycles N` starts each N times, alternating, and every start runs a
warm-up, then `--rounds` rounds of C = 1, 4, 8 concurrent streaming chat clients
(`--requests` each, greedy, max_tokens `--max-tokens`, the special tokens suppressed with
logit_bias so every request makes exactly that many tokens). Ours always asks
`logprobs: true, top_logprobs: 5` and adds its attribution, as our users get it; vLLM is
asked, level by level, both for nothing more than a plain user asks and for the same
logprobs (`--theirs none|top5` for one of them only). The report gives medians over
all rounds of each server: throughput (completion tokens from `usage` over wall time),
TTFT p50 and ITL p50, and the ratios ours / vLLM's.

    flock /tmp/tt-bench.lock .venv/bin/python benchmarks/bench_vllm_server.py \\
        --output benchmarks/results/vllm-server.md

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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_proxy import stop, wait
from bench_server import free_port, run_level, special_ids, summarize

REPO = Path(__file__).resolve().parents[1]
KINDS = ("vllm", "tokentrail")
#: The engine settings both servers run (as tests/test_vllm_server.py's).
ENGINE = {"dtype": "float32", "max_model_len": 2048}
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
FOLDER = (
    "from tokentrail.engines.gguf_models import mlx_folder_from_gguf\n"
    "from tokentrail.models import resolve\n"
    "print(mlx_folder_from_gguf(resolve('smollm2')))\n"
)


def model_folder(python: Path) -> Path:
    """The SmolLM2 HF folder (cached; made from the GGUF in the vLLM venv)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run(
        [str(python), "-c", FOLDER], capture_output=True, text=True, env=env, check=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


def start(kind: str, args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    """One server on loopback, answering; its process and URL."""
    port = free_port()
    common = ["--host", "127.0.0.1", "--port", str(port), "--dtype", ENGINE["dtype"]]
    common += ["--max-model-len", str(ENGINE["max_model_len"])]
    env = {**os.environ, **VLLM_ENV, "PYTHONPATH": str(REPO / "src")}
    if kind == "vllm":
        cmd = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server"]
        cmd += ["--model", str(args.model), "--served-model-name", "smollm2", "--enforce-eager"]
        path = "/v1/models"
    else:
        cmd = [str(args.vllm_python), "-m", "tokentrail.server", "--engine", "vllm"]
        cmd += ["--model", str(args.model), "--model-name", "smollm2", "--log-level", "warning"]
        env["TOKENTRAIL_VLLM_ARGS"] = json.dumps({"enforce_eager": True})
        path = "/health"
    proc = subprocess.Popen(cmd + common, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # `stop` ends the whole group
    url = f"http://127.0.0.1:{port}"
    wait(url, proc, path)
    return proc, url


def run_server(
    kind: str, args: argparse.Namespace, bias: dict[str, int], log: Path, cycle: int
) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """Start `kind`, warm it up, run the rounds; its summaries by label (the server, and
    for vLLM the logprobs asked: "vllm" none, "vllm-top5") and client count. With
    `--theirs both`, vLLM runs each level both ways, one after the other."""
    levels = [int(c) for c in args.clients.split(",")]
    if kind == "tokentrail":
        labels = {"tokentrail": False}
    else:
        modes = ("none", "top5") if args.theirs == "both" else (args.theirs,)
        labels = {("vllm" if m == "none" else "vllm-top5"): m == "none" for m in modes}
    proc, url = start(kind, args, log)
    out = {label: {c: [] for c in levels} for label in labels}
    try:
        asyncio.run(level(url, 2, 1, 8, bias, False))  # warm-up
        for r in range(args.rounds):
            for c in levels:
                for label, strip in labels.items():
                    results, wall = asyncio.run(
                        level(url, c, args.requests, args.max_tokens, bias, strip)
                    )
                    s = summarize(results, wall)
                    out[label][c].append(s)
                    row = {k: v for k, v in s.items() if k != "error_kinds"}
                    line = {"cycle": cycle, "round": r, "server": label, "clients": c, **row}
                    print(json.dumps(line), flush=True)
    finally:
        stop(proc)
    return out


async def level(
    url: str, clients: int, requests: int, max_tokens: int, bias: dict[str, int], strip: bool
) -> tuple[list[Any], float]:
    """`bench_server.run_level`, with the logprobs request taken out where `strip`."""
    if not strip:
        return await run_level(url, "smollm2", clients, requests, max_tokens, bias)
    import bench_server

    original = bench_server.body_for

    def plain(*a: Any, **k: Any) -> dict[str, Any]:
        body = original(*a, **k)
        body.pop("logprobs", None)
        body.pop("top_logprobs", None)
        return body

    bench_server.body_for = plain
    try:
        return await run_level(url, "smollm2", clients, requests, max_tokens, bias)
    finally:
        bench_server.body_for = original


def med(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def report(args: argparse.Namespace, runs: dict[str, dict[int, list]], load: tuple) -> str:
    version = subprocess.run(
        [str(args.vllm_python), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    cmd = " ".join(["python benchmarks/bench_vllm_server.py", *sys.argv[1:]])
    theirs = {
        "none": "no logprobs (as a plain vLLM user): rows `vllm`",
        "top5": "`logprobs: true, top_logprobs: 5`: rows `vllm-top5`",
        "both": "each level twice, one after the other: no logprobs (as a plain vLLM user), "
        "rows `vllm`, and `logprobs: true, top_logprobs: 5`, rows `vllm-top5`",
    }[args.theirs]
    lines = [
        "# `tokentrail serve --engine vllm` vs vLLM's own OpenAI server",
        "",
        f"Command: `flock /tmp/tt-bench.lock {cmd}`",
        "",
        f"- machine: {platform.machine()} {platform.system()} {platform.release()}, "
        f"{os.cpu_count()} CPUs (shared with the clients and other work; load average "
        f"{' '.join(f'{x:.2f}' for x in load)} at the end); vLLM {version} (CPU build)",
        f"- model `{args.model.name}` (SmolLM2-135M-Instruct, float32 HF folder); both: "
        "`--dtype float32 --max-model-len 2048 --enforce-eager`, VLLM_CPU_KVCACHE_SPACE=1, "
        "vLLM's default max_num_seqs (ours: `--max-batch` left at vLLM's figure)",
        f"- one server up at a time; {args.cycles} start(s) each, alternating (vLLM first), "
        f"each a warm-up then {args.rounds} round(s) of {args.clients} clients, "
        f"{args.requests} streaming chat request(s) per client, greedy, {args.max_tokens} "
        "tokens each (special tokens suppressed with logit_bias); medians over all rounds",
        f"- ours: `logprobs: true, top_logprobs: 5` and tokentrail's attribution; vLLM: {theirs}",
        "- TTFT and ITL: the first and following content-bearing chunks; ratios: ours / vLLM's",
        "",
        "| vs | clients | tok/s vLLM | tok/s tokentrail | ratio | TTFT p50 vLLM (ms) "
        "| TTFT p50 tokentrail (ms) | TTFT ratio | ITL p50 vLLM / tokentrail (ms) | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    pairs = [(lab, c) for lab in runs if lab != "tokentrail" for c in sorted(runs[lab])]
    for label, c in pairs:
        a, b = runs[label][c], runs["tokentrail"][c]
        errors = (sum(s["errors"] for s in a), sum(s["errors"] for s in b))
        lines.append(
            f"| {label} | {c} | {med(a, 'tok_s'):.1f} | {med(b, 'tok_s'):.1f} | "
            f"{med(b, 'tok_s') / med(a, 'tok_s'):.2f} | {med(a, 'ttft_p50') * 1e3:.0f} | "
            f"{med(b, 'ttft_p50') * 1e3:.0f} | {med(b, 'ttft_p50') / med(a, 'ttft_p50'):.2f} | "
            f"{med(a, 'itl_p50') * 1e3:.1f} / {med(b, 'itl_p50') * 1e3:.1f} | "
            f"{errors[0]} / {errors[1]} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--vllm-python", type=Path, default=os.environ.get("TOKENTRAIL_VLLM_PYTHON"),
        help="the vLLM venv's python (default: $TOKENTRAIL_VLLM_PYTHON)",
    )  # fmt: skip
    ap.add_argument("--model", type=Path, default=None, help="HF folder (default: SmolLM2's)")
    ap.add_argument("--clients", default="1,4,8", help="concurrency levels (comma list)")
    ap.add_argument("--requests", type=int, default=2, help="requests per client per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="rounds per server start")
    ap.add_argument("--cycles", type=int, default=1, help="starts of each server, alternating")
    ap.add_argument("--theirs", choices=("none", "top5", "both"), default="both",
                    help="logprobs asked of vLLM (both: each level twice)")  # fmt: skip
    ap.add_argument("--output", type=Path, default=None, help="write the markdown report here")
    args = ap.parse_args()
    if args.vllm_python is None:
        ap.error("--vllm-python or TOKENTRAIL_VLLM_PYTHON is needed")
    args.model = args.model or model_folder(args.vllm_python)
    bias = {str(i): -100 for i in special_ids(args.model)}
    logs = Path(tempfile.mkdtemp(prefix="bench-vllm-server-"))
    runs: dict[str, dict[int, list]] = {}
    for cycle in range(args.cycles):
        for kind in KINDS:
            got = run_server(kind, args, bias, logs / f"{kind}-{cycle}.log", cycle)
            for label, by_level in got.items():
                for c, rows in by_level.items():
                    runs.setdefault(label, {}).setdefault(c, []).extend(rows)
            time.sleep(1)
    text = report(args, runs, os.getloadavg())
    print(text)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text, encoding="utf-8")
        args.output.with_suffix(".json").write_text(json.dumps(runs, indent=1), "utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
