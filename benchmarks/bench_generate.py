"""Tokens/s of tokentrail's stream_generate against mlx-lm's, side by side in one run.

Section (a) is below; (b) speculative decoding, (c) second-turn time to first token
with a reused prompt cache and (d) batch_generate throughput are in parity_sections.py
(`--sections a,b,c,d`, all by default).

Variants, all with the same model, prompt, seed, sampler and max_tokens:

* ``mlx-lm``: ``mlx_lm.stream_generate`` as is (text only);
* ``mlx-lm + user logprob/top-5``: the same, with the caller pulling the token's
  logprob and a top-5 out of ``response.logprobs`` each step, as users do today;
* ``tokentrail``: segment attribution, token logprobs and confidence;
* ``tokentrail top-5``: the same plus 5 alternatives per token.

Runs are interleaved (every variant once per round) and the median of the rounds is
reported. Tokens/s counts decode steps only: (tokens - 1) / (time of the last
response - time of the first), so prompt processing is excluded for every variant.

Models: the built-in demo model (when installed), a random-weight 2-layer Llama
with the Llama 3 vocabulary (128,256 ids, from the corpus's tiktoken ranks), where
per-step work over the vocabulary weighs the most, and the real SmolLM2-135M-Instruct
(converted once from its GGUF, see parity_sections.build_smollm2).

    python benchmarks/bench_generate.py --rounds 5 --max-tokens 256 \\
        --output benchmarks/results/generate.md
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm import stream_generate as mlx_stream_generate
from mlx_lm.sample_utils import make_sampler

import tokentrail
from tokentrail.generate import DEMO_MODEL

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO.parent / "shared" / "corpus"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def build_llama3_vocab_model(out: Path, hidden: int = 128) -> Path:
    """A random-weight 2-layer Llama with Llama 3's 128,256-id tokenizer (cached in `out`)."""
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from tokentrail.vocab.tiktoken_ranks import tiktoken_specials

    ranks = CORPUS / "tokenizers" / "llama3" / "tokenizer.model"
    if not ranks.is_file():
        raise SystemExit(f"Llama 3 ranks not found at {ranks}; is ../shared/corpus present?")
    specials = tiktoken_specials(128000)
    names = sorted(specials, key=specials.__getitem__)
    tok = TikTokenConverter(
        vocab_file=str(ranks), pattern=LLAMA3_SPLIT, extra_special_tokens=names
    ).converted()
    assert tok.token_to_id("<|end_of_text|>") == 128001, "special tokens not at 128000+"
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|end_of_text|>",
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": 2,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 128256,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    }
    (out / "config.json").write_text(json.dumps(config))
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    weights["lm_head.weight"] = weights["lm_head.weight"] * 4  # peaked, varied output
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


Timing = tuple[float, float, list[int]]


def timed(responses: Any, per_step: Callable[[Any], None] | None = None) -> Timing:
    """Decode tokens per wall second and per CPU second, and the tokens produced.

    CPU time is the process's (all threads, so MLX's CPU work too); on a machine
    shared with other jobs it varies far less than wall time.
    """
    tokens: list[int] = []
    first = last = first_cpu = last_cpu = 0.0
    for r in responses:
        if per_step is not None:
            per_step(r)
        last, last_cpu = time.perf_counter(), time.process_time()
        if not tokens:
            first, first_cpu = last, last_cpu
        tokens.append(r.token)
    if len(tokens) < 2:
        return float("nan"), float("nan"), tokens
    n = len(tokens) - 1
    return n / (last - first), n / max(last_cpu - first_cpu, 1e-9), tokens


def user_logprobs(r: Any) -> None:
    """What mlx-lm users write today to get a token's logprob and a top-5."""
    lp = r.logprobs
    r.user_logprob = lp[r.token].item()
    idx = mx.argpartition(-lp, kth=4)[:5]
    r.user_top = list(zip(idx.tolist(), lp[idx].tolist(), strict=True))


def bench_model(path: Path, rounds: int, max_tokens: int, temp: float, seed: int) -> list[dict]:
    model, tok = tokentrail.load(path)
    sampler = make_sampler(temp)
    prompt: Any = PROMPT
    if path.name.startswith("SmolLM2"):  # an instruct model: ask it, or it ends at once
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True
        )

    def run_mlx(per_step: Callable[[Any], None] | None) -> Timing:
        mx.random.seed(seed)
        return timed(
            mlx_stream_generate(model, tok, prompt, max_tokens=max_tokens, sampler=sampler),
            per_step,
        )

    def run_tt(top: int) -> Timing:
        return timed(
            tokentrail.stream_generate(
                model, tok, prompt, max_tokens=max_tokens, temp=temp, seed=seed,
                top_logprobs=top,
            )
        )

    variants: dict[str, Callable[[], Timing]] = {
        "mlx-lm stream_generate": lambda: run_mlx(None),
        "mlx-lm + user logprob & top-5": lambda: run_mlx(user_logprobs),
        "tokentrail (attribution + logprobs)": lambda: run_tt(0),
        "tokentrail + top-5 alternatives": lambda: run_tt(5),
    }
    for fn in variants.values():  # warm-up: compile, caches, allocator
        fn()
    names = list(variants)
    tps: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    toks: dict[str, list[int]] = {}
    for i in range(rounds):
        # Rotate the order so that no variant always runs first (or after the same one).
        for name in names[i % len(names) :] + names[: i % len(names)]:
            rate, cpu_rate, tokens = variants[name]()
            tps[name].append(rate)
            cpu[name].append(cpu_rate)
            toks[name] = tokens
    base_name = names[0]
    base, base_cpu = statistics.median(tps[base_name]), statistics.median(cpu[base_name])
    rows = []
    for name in names:
        med, med_cpu = statistics.median(tps[name]), statistics.median(cpu[name])
        rows.append(
            {
                "model": path.name,
                "variant": name,
                "tokens": len(toks[name]),
                "same_tokens": toks[name] == toks[base_name],
                "median_tps": med,
                "ratio": med / base,
                "median_cpu_tps": med_cpu,
                "cpu_ratio": med_cpu / base_cpu,
                "runs": tps[name],
            }
        )
    return rows


class Replay:
    """An Engine that replays recorded steps: the host work of tokentrail, no device."""

    name = "replay"
    context_length = None

    def __init__(self, steps: list[Any], vocab_size: int) -> None:
        self.steps = steps
        self.vocab_size = vocab_size

    def generate(self, prompt_ids: Any, params: Any, max_tokens: int | None) -> Any:
        k = params.top_logprobs
        for s in self.steps:
            yield s if k else type(s)(s.token, s.logprob, [], s.logprobs)

    def peak_memory(self) -> float:
        return mx.get_peak_memory() / 1e9


def host_overhead(path: Path, rounds: int, max_tokens: int, seed: int) -> dict[str, float]:
    """Host time per token (µs) with the device taken out: recorded steps replayed.

    mlx-lm's own `stream_generate` runs with its `generate_step` swapped for a replay
    of the same tokens, so both sides do exactly their per-token Python work:
    detokenizing (or aligning), building the response, reading timers and memory.
    """
    import importlib

    # `mlx_lm.generate` the attribute is a function; the module is what we patch.
    mlx_generate = importlib.import_module("mlx_lm.generate")

    from tokentrail.engines import Step, engine_for
    from tokentrail.sampling import make_params

    model, tok = tokentrail.load(path)
    engine = engine_for(model)
    ids = tok.encode(PROMPT)
    eos = set(tok.eos_token_ids)
    params = make_params(temp=0.7, seed=seed, top_logprobs=5, logit_bias={e: -1e4 for e in eos})
    steps: list[Step] = list(engine.generate(ids, params, max_tokens)) * 4
    n = len(steps)
    record = [(s.token, s.logprobs) for s in steps]

    def fake_generate_step(*args: Any, **kwargs: Any) -> Any:
        yield from record

    def run_mlx() -> float:
        real = mlx_generate.generate_step
        mlx_generate.generate_step = fake_generate_step
        try:
            t = time.perf_counter()
            for _ in mlx_stream_generate(model, tok, ids, max_tokens=n):
                pass
            return (time.perf_counter() - t) / n * 1e6
        finally:
            mlx_generate.generate_step = real

    def run_tt(top: int) -> float:
        replay = Replay(steps, engine.vocab_size or 0)
        t = time.perf_counter()
        for _ in tokentrail.stream_generate(replay, tok, ids, max_tokens=n, top_logprobs=top):
            pass
        return (time.perf_counter() - t) / n * 1e6

    runs: dict[str, Callable[[], float]] = {
        "mlx-lm stream_generate": run_mlx,
        "tokentrail (attribution + logprobs)": lambda: run_tt(0),
        "tokentrail + top-5 alternatives": lambda: run_tt(5),
    }
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(max(rounds, 5)):
        for name, fn in runs.items():
            times[name].append(fn())
    return {name: min(v) for name, v in times.items()}  # noise only ever adds time


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "| model | variant | tokens | same tokens | tokens/s (wall) | vs mlx-lm "
        "| tokens per CPU-s | vs mlx-lm |",
        "|---|---|---:|:---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['tokens']} | "
            f"{'yes' if r['same_tokens'] else 'NO'} | {r['median_tps']:.1f} | {r['ratio']:.3f}x | "
            f"{r['median_cpu_tps']:.1f} | {r['cpu_ratio']:.3f}x |"
        )
    runs = "\n".join(
        f"- {r['model']} / {r['variant']}: " + ", ".join(f"{x:.1f}" for x in r["runs"])
        for r in rows
    )
    import mlx_lm

    env = (
        f"mlx {mx.__version__} ({mx.default_device()}), mlx-lm {mlx_lm.__version__}, "
        f"Python {platform.python_version()}, {platform.machine()} {platform.system()}"
    )
    host = ""
    for model, costs in args.host.items():
        host += (
            f"\nHost work per token with the device taken out ({model}; recorded steps "
            "replayed, best of the rounds, µs):\n\n"
        )
        host += "| variant | µs/token |\n|---|---:|\n"
        host += "".join(f"| {k} | {v:.1f} |\n" for k, v in costs.items())
    notes = (
        "\nHow to read this: the 'tokentrail' rows do strictly more than plain mlx-lm (exact "
        "segment attribution, per-token logprob, confidence; top-5 alternatives with their "
        "bytes and text), and 'same tokens' checks they generate the identical sequence. "
        "The logprob and the top-k are computed on the device inside the step graph and "
        "read with the token, so the per-step cost is a gather (logprob) and one extra "
        "pass over the vocabulary (top-k: block maxima, then a partition of the best "
        "blocks). The host table replays recorded steps through both loops, so it shows "
        "the Python work per token alone; in a real run it overlaps the next device step. "
        "On MLX's CPU backend the 'device' shares the CPU with the host loop, so host work "
        "is not fully hidden there as it is on a GPU.\n"
    )
    return (
        "# stream_generate: tokentrail vs mlx-lm\n\n"
        f"Command: `python benchmarks/bench_generate.py --rounds {args.rounds} "
        f"--max-tokens {args.max_tokens} --temp {args.temp} --seed {args.seed} "
        f"--hidden {args.hidden}`\n\n"
        f"Environment: {env}.\n\n"
        f"Prompt: {PROMPT!r}. Decode tokens/s, median of {args.rounds} interleaved rounds "
        "(order rotated each round) after one warm-up round. 'tokens per CPU-s' divides by "
        "the process's CPU time instead of wall time.\n\n"
        + "\n".join(lines) + "\n\nAll runs (tokens/s, wall):\n\n"
        + runs + "\n" + host + notes
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/tokentrail-bench"))
    p.add_argument("--hidden", type=int, default=64, help="hidden size of the 128k-vocab model")
    p.add_argument("--skip-demo", action="store_true")
    p.add_argument("--skip-llama3", action="store_true")
    p.add_argument("--skip-smollm2", action="store_true", help="the real SmolLM2-135M-Instruct")
    p.add_argument("--output", type=Path, help="also write the markdown report here")
    p.add_argument("--sections", default="a,b,c,d", help="which of a,b,c,d to run")
    p.add_argument("--spec-tokens", type=int, default=96, help="(b) tokens per run")
    p.add_argument("--batch-tokens", type=int, default=48, help="(d) tokens per sequence")
    args = p.parse_args()
    sections = set(args.sections.split(","))
    rows: list[dict] = []
    paths = []
    if not args.skip_demo:
        if (DEMO_MODEL / "config.json").is_file():
            paths.append(DEMO_MODEL)
        else:
            print(f"demo model not installed at {DEMO_MODEL}; skipping it", file=sys.stderr)
    if not args.skip_llama3:
        folder = args.workdir / f"llama3-vocab-random-h{args.hidden}"
        paths.append(build_llama3_vocab_model(folder, args.hidden))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import parity_sections as ps

    if not args.skip_smollm2 and "a" in sections:
        smol = ps.build_smollm2(args.workdir)
        if smol is None:
            print(f"no SmolLM2 wheel at {ps.SMOLLM2_WHEEL}; skipping it", file=sys.stderr)
        else:
            paths.append(smol)
    args.host = {}
    if "a" in sections:
        for path in paths:
            rows += bench_model(path, args.rounds, args.max_tokens, args.temp, args.seed)
            args.host[path.name] = host_overhead(path, args.rounds, args.max_tokens, args.seed)
    report = markdown(rows, args) if rows else (
        "# stream_generate: tokentrail vs mlx-lm\n\n"
        f"Command: `python benchmarks/bench_generate.py --rounds {args.rounds} "
        f"--hidden {args.hidden}`\n"
    )
    if sections & {"b", "c", "d"}:
        demo = tokentrail.load(DEMO_MODEL)
        more: list[dict] = []
        if "b" in sections:
            more += ps.speculative(demo, args.rounds, args.spec_tokens)
        if "c" in sections:
            more += ps.prompt_cache(demo, args.rounds)
        if "d" in sections:
            more += ps.batches(demo, args.rounds, args.batch_tokens)
        report += ps.markdown(more)
        report = report.replace(
            f"--hidden {args.hidden}`",
            f"--hidden {args.hidden} --sections {args.sections} --spec-tokens "
            f"{args.spec_tokens} --batch-tokens {args.batch_tokens}`", 1,
        )
    print(report)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(report, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
