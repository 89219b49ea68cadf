"""Tokens/s of tokentrail's stream_generate on the PyTorch engine against transformers'
own streaming (`model.generate` with a `TextIteratorStreamer`), side by side in one run.

Variants, all with the same model object, prompt, greedy decoding and max_tokens:

* ``transformers generate + TextIteratorStreamer``: `model.generate` in a thread (as the
  transformers docs show), the caller reading text chunks from the streamer;
* ``tokentrail (attribution + logprobs)``: `tokentrail.stream_generate` with the torch
  engine: per-token logprob, segment attribution and confidence;
* ``tokentrail + top-5 alternatives``: the same plus 5 alternatives per token.

Tokens/s is generated tokens / wall time from the call to the last text, prompt
included, the same definition for every variant (the prompt is short). Runs are
interleaved (every variant once per round) after one warm-up round, and the median of
the rounds is reported. torch runs on `--threads` CPU threads (default 1: on a shared
machine torch's spinning thread pool makes multi-thread timings swing wildly).

Models: the built-in demo model (when installed) and a random-weight 2-layer Llama with
GPT-2's 50,257-id vocabulary (from the corpus), where per-step work over the vocabulary
weighs the most.

    python benchmarks/bench_torch.py --rounds 7 --max-tokens 200 \\
        --output benchmarks/results/torch.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import transformers
from transformers import TextIteratorStreamer

import tokentrail
from tokentrail.engines.torch_engine import TorchEngine
from tokentrail.engines.torch_engine import load as load_torch
from tokentrail.generate import DEMO_MODEL

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO.parent / "shared" / "corpus"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


class Run(NamedTuple):
    """One timed generation: tokens per wall-clock second and per CPU second, the ids."""

    tps: float
    cpu_tps: float
    tokens: list[int]


def build_gpt2_vocab_model(out: Path) -> Path:
    """A random-weight 2-layer Llama over GPT-2's tokenizer.json (cached in `out`)."""
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = CORPUS / "tokenizers" / "gpt2" / "tokenizer.json"
    if not tok.is_file():
        raise SystemExit(f"GPT-2 tokenizer not found at {tok}; is ../shared/corpus there?")
    config = LlamaConfig(
        vocab_size=50257,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=50256,
        eos_token_id=50256,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            model.model.embed_tokens.weight.normal_(0.0, 1.0)
            model.lm_head.weight.normal_(0.0, 0.5)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    shutil.copy(tok, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|endoftext|>",
                "eos_token": "<|endoftext|>",
                "clean_up_tokenization_spaces": False,
            }
        ),
        encoding="utf-8",
    )
    return out


def run_transformers(model: Any, tok: Any, ids: list[int], max_tokens: int) -> Run:
    """transformers' documented streaming: generate() in a thread, text from the streamer."""
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    inputs = torch.tensor([ids])
    result: dict[str, Any] = {}

    def work() -> None:
        with torch.inference_mode():
            result["out"] = model.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),
                max_new_tokens=max_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                streamer=streamer,
                pad_token_id=tok.eos_token_id,
            )

    start, cpu = time.perf_counter(), time.process_time()
    thread = threading.Thread(target=work)
    thread.start()
    for _ in streamer:  # the caller's loop: one text chunk at a time
        pass
    end, cpu_end = time.perf_counter(), time.process_time()
    thread.join()
    tokens = result["out"][0, len(ids) :].tolist()
    return Run(len(tokens) / (end - start), len(tokens) / (cpu_end - cpu), tokens)


def run_tokentrail(engine: TorchEngine, tok: Any, ids: list[int], max_tokens: int, top: int) -> Run:
    start, cpu = time.perf_counter(), time.process_time()
    tokens = []
    for r in tokentrail.stream_generate(
        engine, tok, ids, max_tokens=max_tokens, temp=0.0, top_logprobs=top
    ):
        tokens.append(r.token)
    end, cpu_end = time.perf_counter(), time.process_time()
    return Run(len(tokens) / (end - start), len(tokens) / (cpu_end - cpu), tokens)


def bench_model(path: Path, rounds: int, max_tokens: int) -> list[dict]:
    model, tok = load_torch(path, device="cpu")
    engine = TorchEngine(model)
    ids = list(tok.encode(PROMPT))
    variants: dict[str, Callable[[], Run]] = {
        "transformers generate + TextIteratorStreamer": lambda: run_transformers(
            model, tok, ids, max_tokens
        ),
        "tokentrail (attribution + logprobs)": lambda: run_tokentrail(
            engine, tok, ids, max_tokens, 0
        ),
        "tokentrail + top-5 alternatives": lambda: run_tokentrail(engine, tok, ids, max_tokens, 5),
    }
    for fn in variants.values():  # warm-up: allocator, caches, lazy imports
        fn()
    runs: dict[str, list[Run]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            runs[name].append(fn())
    base_name = next(iter(variants))
    base = statistics.median(r.tps for r in runs[base_name])
    base_cpu = statistics.median(r.cpu_tps for r in runs[base_name])
    rows = []
    for name in variants:
        med = statistics.median(r.tps for r in runs[name])
        med_cpu = statistics.median(r.cpu_tps for r in runs[name])
        rows.append(
            {
                "model": path.name,
                "variant": name,
                "tokens": len(runs[name][-1].tokens),
                "same_tokens": all(r.tokens == runs[base_name][-1].tokens for r in runs[name]),
                "median_tps": med,
                "ratio": med / base,
                "median_cpu_tps": med_cpu,
                "cpu_ratio": med_cpu / base_cpu,
                "runs": [r.tps for r in runs[name]],
                "cpu_runs": [r.cpu_tps for r in runs[name]],
            }
        )
    return rows


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "| model | variant | tokens | same tokens as transformers | tokens/s (wall) | "
        "vs transformers | tokens/CPU-s | vs transformers |",
        "|---|---|---:|:---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['tokens']} | "
            f"{'yes' if r['same_tokens'] else 'NO'} | {r['median_tps']:.1f} | {r['ratio']:.3f}x | "
            f"{r['median_cpu_tps']:.1f} | {r['cpu_ratio']:.3f}x |"
        )
    runs = "\n".join(
        f"- {r['model']} / {r['variant']}: wall "
        + ", ".join(f"{x:.1f}" for x in r["runs"])
        + "; CPU "
        + ", ".join(f"{x:.1f}" for x in r["cpu_runs"])
        for r in rows
    )
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    env = (
        f"torch {torch.__version__} (CPU, {args.threads} thread(s)), transformers "
        f"{transformers.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, "
        f"load average at the end {load}"
    )
    return (
        "# PyTorch engine: tokentrail stream_generate vs transformers streaming\n\n"
        f"Command: `python benchmarks/bench_torch.py --rounds {args.rounds} "
        f"--max-tokens {args.max_tokens} --threads {args.threads}`\n\n"
        f"Environment: {env}.\n\n"
        f"Prompt: {PROMPT!r}, greedy. Tokens/s = generated tokens / wall time from the call "
        "to the last text (prompt included); tokens/CPU-s = generated tokens / CPU time the "
        "process used meanwhile (all threads), which other processes on a shared machine "
        f"disturb less. Medians of {args.rounds} interleaved rounds after one warm-up round."
        "\n\n" + "\n".join(lines) + "\n\nAll runs (tokens/s):\n\n" + runs + "\n"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/tokentrail-bench"))
    p.add_argument("--skip-demo", action="store_true")
    p.add_argument("--skip-random", action="store_true")
    p.add_argument("--output", type=Path, help="also write the markdown report here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows: list[dict] = []
    if not args.skip_demo:
        if (DEMO_MODEL / "model.safetensors").is_file():
            rows += bench_model(DEMO_MODEL, args.rounds, args.max_tokens)
        else:
            print(f"demo model not installed at {DEMO_MODEL}; skipping it", file=sys.stderr)
    if not args.skip_random:
        path = build_gpt2_vocab_model(args.workdir / "gpt2-vocab-random-torch")
        rows += bench_model(path, args.rounds, args.max_tokens)
    report = markdown(rows, args)
    print(report)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(report, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
