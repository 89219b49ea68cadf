"""What field retry buys on a real question set (issue #31): accuracy and tokens of a
JSON answer ``{"answer": string}`` asked greedily, with and without
``retry={"below": P, "max": K, "temperature": T}``, side by side on each question.

SmolLM2-135M-Instruct (GGUF) on llama.cpp, in process through `stream_generate`; the
questions are the calibration sets' (benchmarks/data/calibration: facts and
arithmetic, half each, spread evenly over each file), graded by
`tokentrail.calibrate.match.is_correct` on the answer leaf. Tokens: those emitted (the
reply) and those computed (the reply plus every attempt taken back), counted at the
engine. Usage (under the shared lock):

    flock /tmp/tt-bench.lock python benchmarks/bench_retry.py --questions 40

`run(...)` returns the rows for a caller (e.g. benchmarks/bench_actions.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from tokentrail import load, stream_generate
from tokentrail.calibrate.data import Item, read_items
from tokentrail.calibrate.match import is_correct

DATA = Path(__file__).resolve().parent / "data" / "calibration"
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 40}},
    "required": ["answer"],
    "additionalProperties": False,
}


def questions(count: int) -> list[Item]:
    """`count` questions, half facts and half arithmetic, spread evenly over each file."""
    picked = []
    for name, share in (("facts.jsonl", count - count // 2), ("arithmetic.jsonl", count // 2)):
        items = read_items(DATA / name)
        step = max(1, len(items) // max(share, 1))
        picked.append(items[::step][:share])
    return [it for pair in zip(*picked, strict=False) for it in pair] + picked[0][len(picked[1]) :]


class _Counting:
    """The engine's rewindable steps, counting every step computed."""

    def __init__(self, steps: Any, counter: list[int]) -> None:
        self._steps, self._counter = steps, counter

    def __iter__(self) -> _Counting:
        return self

    def __next__(self) -> Any:
        step = next(self._steps)
        self._counter[0] += 1
        return step

    def __getattr__(self, name: str) -> Any:
        return getattr(self._steps, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._steps, name, value)


def ask(engine: Any, tok: Any, item: Item, retry: dict[str, Any] | None,
        max_tokens: int) -> dict[str, Any]:  # fmt: skip
    """One question: right or not, tokens emitted and computed, attempts, seconds."""
    counter = [0]
    original = type(engine).generate_rewindable

    def counting(prompt_ids: Any, params: Any, limit: Any, **kw: Any) -> Any:
        return _Counting(original(engine, prompt_ids, params, limit, **kw), counter)

    engine.generate_rewindable = counting  # this run's engine only
    tic = time.perf_counter()
    try:
        out = list(stream_generate(
            engine, tok, list(item.prompt), max_tokens=max_tokens, json_schema=ANSWER_SCHEMA,
            retry=retry or {"below": 0.0},  # below 0: never retried, the same loop
        ))  # fmt: skip
    finally:
        del engine.generate_rewindable
    seconds = time.perf_counter() - tic
    text = "".join(r.text for r in out)
    try:
        answer = str(json.loads(text)["answer"])
    except (ValueError, KeyError, TypeError):
        answer = text
    fields = out[-1].all_fields or []
    return {
        "right": is_correct(answer, item.answers),
        "emitted": len(out),
        "computed": counter[0],
        "attempts": sum(len(f.attempts) for f in fields if f.attempts),
        "retried": sum(1 for f in fields if f.attempts),
        "seconds": seconds,
    }


def run(gguf: str, count: int, retry: dict[str, Any], max_tokens: int = 48) -> dict[str, list]:
    """Both settings on each question in turn: {"plain": rows, "retry": rows}."""
    engine, tok = load(gguf, engine="llamacpp", n_ctx=2048)
    rows: dict[str, list] = {"plain": [], "retry": []}
    for item in questions(count):
        rows["plain"].append(ask(engine, tok, item, None, max_tokens))
        rows["retry"].append(ask(engine, tok, item, retry, max_tokens))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", default="smollm2", help="a .gguf file or a named model")
    p.add_argument("--questions", type=int, default=40)
    p.add_argument("--below", type=float, default=0.5)
    p.add_argument("--max", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=48)
    args = p.parse_args()
    retry = {"below": args.below, "max": args.max, "temperature": args.temperature}
    rows = run(args.gguf, args.questions, retry, args.max_tokens)
    n = len(rows["plain"])
    print(f"{n} questions, SmolLM2-135M-Instruct on llama.cpp, answer as JSON, greedy; "
          f"retry {retry}")  # fmt: skip
    print("| setting | accuracy | emitted tokens | computed tokens | median s/question |")
    print("|---|---|---|---|---|")
    for name, rs in rows.items():
        median = statistics.median(r["seconds"] for r in rs)
        print(
            f"| {name} | {sum(r['right'] for r in rs)}/{n} | {sum(r['emitted'] for r in rs)} "
            f"| {sum(r['computed'] for r in rs)} | {median:.2f} |"
        )
    tried = rows["retry"]
    print(f"retried leaves: {sum(r['retried'] for r in tried)}; attempts listed: "
          f"{sum(r['attempts'] for r in tried)}")  # fmt: skip
    changed = sum(a["right"] != b["right"] for a, b in zip(rows["plain"], tried, strict=True))
    print(f"questions whose grade changed: {changed}")


if __name__ == "__main__":
    main()
