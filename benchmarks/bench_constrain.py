"""Token rate of constrained generation (llguidance's mask) against unconstrained, on the
demo model (MLX engine) and SmolLM2-135M-Instruct Q4_1 (llama.cpp engine).

Both variants run `Engine.generate` for exactly `--max-tokens` steps from the same chat
prompt at temperature 0.8 with a seed and top-5 alternatives; the constrained one under
a JSON schema (an array of at least 200 small objects, so the grammar never ends
early) with raw logprobs and the allowed mass per step. Rounds are interleaved after one
warm-up round; medians of tokens/s (wall and process CPU) and their ratio are reported.

    python benchmarks/bench_constrain.py --rounds 5 --max-tokens 128 \\
        --output benchmarks/results/constrain.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokentrail
from tokentrail.constrain import constraint_from
from tokentrail.engines import engine_for
from tokentrail.sampling import make_params

SCHEMA = {
    "type": "array", "minItems": 200,
    "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["name", "n"]},
}
PROMPT = "List people with a number each, as JSON."


def _ids(tok: Any) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=True,
                                  add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def _timed(run: Callable[[], int]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    n = run()
    return n / (time.perf_counter() - wall), n / max(time.process_time() - cpu, 1e-9)


def _bench(name: str, engine: Any, tok: Any, rounds: int, n: int) -> list[str]:
    ids = _ids(tok)
    c = constraint_from(json_schema=SCHEMA).bind(tok)
    variants = {
        "unconstrained": make_params(temp=0.8, seed=1, top_logprobs=5),
        "json schema": make_params(temp=0.8, seed=1, top_logprobs=5, constraint=c),
    }

    def runner(params: Any) -> Callable[[], int]:
        return lambda: sum(1 for _ in engine.generate(ids, params, n))

    results: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    for r in range(rounds + 1):
        for v, params in variants.items():
            got = _timed(runner(params))
            if r:  # round 0 warms up
                results[v].append(got)
    base_wall = statistics.median(w for w, _ in results["unconstrained"])
    base_cpu = statistics.median(c for _, c in results["unconstrained"])
    rows = []
    for v, runs in results.items():
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        rows.append(f"| {name} | {v} | {n} | {wall:.1f} | {wall / base_wall:.3f}x | "
                    f"{cpu:.1f} | {cpu / base_cpu:.3f}x |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--output", type=Path)
    ap.add_argument("--models", nargs="+", choices=["demo", "smollm2"], default=["demo", "smollm2"])
    args = ap.parse_args()
    rows: list[str] = []
    if "demo" in args.models:
        model, tok = tokentrail.load()
        rows += _bench("demo model (MLX)", engine_for(model), tok, args.rounds, args.max_tokens)
    if "smollm2" in args.models:
        engine, tok = tokentrail.load("smollm2", engine="llamacpp", n_ctx=1024)
        rows += _bench("SmolLM2 Q4_1 (llama.cpp)", engine, tok, args.rounds, args.max_tokens)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    text = "\n".join([
        "# Constrained decoding: token rate with llguidance's mask vs without", "",
        f"Command: `python benchmarks/bench_constrain.py --rounds {args.rounds} "
        f"--max-tokens {args.max_tokens} --models {' '.join(args.models)} "
        "--output benchmarks/results/constrain.md`", "",
        f"Environment: Python {platform.python_version()}, {platform.machine()} "
        f"{platform.system()}, {os.cpu_count()} CPUs (shared), load average at the end "
        f"{load}.", "",
        f"`Engine.generate`, {args.max_tokens} tokens, temperature 0.8, seed 1, top-5; the "
        "constrained variant under a JSON schema (an array of >= 200 objects). Medians "
        f"of {args.rounds} interleaved rounds after one warm-up.", "",
        "| model | variant | tokens | tokens/s (wall) | vs unconstrained | tokens/CPU-s "
        "| vs unconstrained |",
        "|---|---|---:|---:|---:|---:|---:|",
        *rows, "",
    ])
    print(text)
    if args.output:
        args.output.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
