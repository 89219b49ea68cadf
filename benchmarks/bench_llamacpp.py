"""Tokens/s of tokentrail's llamacpp engine against llama-cpp-python's own streaming,
side by side in one run, on SmolLM2-135M-Instruct Q4_1.

Variants, all on one `llama_cpp.Llama` object (same weights, threads and KV cache), the
same chat prompt, greedy decoding and max_tokens:

* ``llama-cpp-python create_completion(stream=True)``: plain streaming of text chunks,
  no logprobs (the baseline);
* ``tokentrail (attribution + logprob)``: `stream_generate` on the llamacpp engine:
  per-token logprob, segment attribution and confidence;
* ``tokentrail + top-5 alternatives``: the same plus 5 alternatives per token.

Tokens/s = generated tokens / wall time from the call to the last chunk, prompt included
(the KV cache holds the prompt from the warm-up round, so both sides re-evaluate only its
last token). tokens/CPU-s = generated tokens / CPU time of the process meanwhile, which
other processes on a shared machine disturb less. Rounds are interleaved (every variant
once per round) after one warm-up round; medians are reported with the ratio of medians.

    python benchmarks/bench_llamacpp.py --rounds 5 --max-tokens 128 \\
        --output benchmarks/results/llamacpp.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import llama_cpp

import tokentrail
from tokentrail.engines.llamacpp.engine import LlamaCppEngine
from tokentrail.models import resolve

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


class Run(NamedTuple):
    wall_tps: float
    cpu_tps: float
    ids: tuple[int, ...]


def timed(fn: Callable[[], list[int]], n_tokens: int | None = None) -> Run:
    """Time `fn`; `n_tokens` overrides the count when `fn` does not return token ids."""
    cpu0, t0 = time.process_time(), time.perf_counter()
    ids = fn()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    n = len(ids) if n_tokens is None else n_tokens
    return Run(n / wall, n / max(cpu, 1e-9), tuple(ids))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="a .gguf file or a named model")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None,
                    help="llama.cpp threads (default: llama-cpp-python's, half the CPUs)")
    ap.add_argument("--output", type=Path, default=None, help="write a markdown report here")
    args = ap.parse_args()

    path = Path(args.model) if args.model.endswith(".gguf") else resolve(args.model)
    kw: dict[str, Any] = {"n_threads": args.threads} if args.threads else {}
    llama = llama_cpp.Llama(model_path=str(path), n_ctx=2048, verbose=False, **kw)
    engine = LlamaCppEngine(llama)
    tok = engine.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}])
    n = args.max_tokens

    def plain() -> list[int]:
        # Chunks are text (bytes of a split character wait for the next token), so the
        # token count is that of the same greedy sequence on tokentrail's side.
        stream = llama.create_completion(ids, max_tokens=n, temperature=0.0, stream=True)
        return [len(chunk["choices"][0]["text"]) for chunk in stream]

    def ours(top: int) -> Callable[[], list[int]]:
        def run() -> list[int]:
            return [r.token for r in tokentrail.stream_generate(
                engine, tok, ids, max_tokens=n, top_logprobs=top)]
        return run

    variants: dict[str, Callable[[], list[int]]] = {
        "llama-cpp-python create_completion(stream=True)": plain,
        "tokentrail (attribution + logprob)": ours(0),
        "tokentrail + top-5 alternatives": ours(5),
    }
    base = "llama-cpp-python create_completion(stream=True)"
    for fn in variants.values():
        fn()  # warm-up
    n_generated = len(ours(0)())
    runs: dict[str, list[Run]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            runs[name].append(timed(fn, n_generated if name == base else None))

    ours_ids = runs["tokentrail (attribution + logprob)"][0].ids
    ref = []
    for t in llama.generate(ids, temp=0.0, top_k=40, top_p=0.95, min_p=0.05):
        ref.append(t)
        if len(ref) == len(ours_ids):
            break
    same = tuple(ref) == ours_ids
    med = {k: (statistics.median(r.wall_tps for r in v), statistics.median(r.cpu_tps for r in v))
           for k, v in runs.items()}
    counts = {k: n_generated if k == base else len(v[0].ids) for k, v in runs.items()}
    lines = [
        "# llamacpp engine: tokentrail stream_generate vs llama-cpp-python streaming",
        "",
        f"Command: `python benchmarks/bench_llamacpp.py {' '.join(sys.argv[1:])}`",
        "",
        f"Environment: llama-cpp-python {llama_cpp.__version__} (CPU, "
        f"{llama.context_params.n_threads} thread(s)), Python {platform.python_version()}, "
        f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, load average at "
        f"the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}.",
        "",
        f"Model: {path.name}. Prompt: {PROMPT!r} through the GGUF chat template, greedy, "
        f"max_tokens {n}. Medians of {args.rounds} interleaved rounds after one warm-up. "
        f"tokentrail's greedy ids equal llama-cpp-python's `Llama.generate`: "
        f"{'yes' if same else 'NO'}.",
        "",
        "| variant | tokens | tokens/s (wall) | vs llama-cpp-python | tokens/CPU-s "
        "| vs llama-cpp-python |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for k, (w, c) in med.items():
        lines.append(f"| {k} | {counts[k]} | {w:.1f} | {w / med[base][0]:.3f}x | {c:.1f} | "
                     f"{c / med[base][1]:.3f}x |")
    lines += ["", "All runs (tokens/s):", ""]
    for k, v in runs.items():
        lines.append(f"- {k}: wall {', '.join(f'{r.wall_tps:.1f}' for r in v)}; "
                     f"CPU {', '.join(f'{r.cpu_tps:.1f}' for r in v)}")
    report = "\n".join(lines) + "\n"
    sys.stdout.write(report)
    if args.output is not None:
        args.output.write_text(report, encoding="utf-8")
        data = {k: {"median_wall_tps": w, "median_cpu_tps": c, "tokens": counts[k],
                    "runs": [r._asdict() | {"ids": None} for r in runs[k]]}
                for k, (w, c) in med.items()}
        args.output.with_suffix(".json").write_text(json.dumps(data, indent=1), "utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
