"""Per-token cost of the server's output stage, before and after the one output pipeline.

What one token costs between the engine's `Step` and the chunk's JSON bytes on the
server path: the sequence state (aligner, stops, EOS), the record that crosses to the
event loop, and the OpenAI chunk with the tokentrail extension, serialised as SSE. No
model runs: the steps are a real reply's token ids (the demo model's tokenizer) with
logprobs and 5 alternatives each, so the figure is the Python per token, repeatable on
a shared machine (medians of repeated runs, microseconds per token).

    python benchmarks/bench_output.py [--kind completion]  # this checkout
    PYTHONPATH=/path/to/old/src python benchmarks/bench_output.py   # another checkout

It runs either code base: the record is `output.record.TokenOutput` made by
`output.processor.OutputProcessor` where that package exists, else the older
`GenerationResponse` + `formatting.step_of` (`StepRecord`).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path
from typing import Any

import tokentrail
from tokentrail.engines.base import Step
from tokentrail.prompting import aligner_for, eos_ids, stop_matcher, vocab_for
from tokentrail.sequence import SequenceState
from tokentrail.server.formatting import Formatter, sse
from tokentrail.server.protocol import GenRequest

TEXT = (
    "Paris is the capital of France, a city of light, art and science. It stands on the "
    "Seine, and its museums hold works from every age: the Louvre, Orsay, the Pompidou. "
    "Café, naïve, déjà vu — 東京, 北京 and Москва are capitals too. "
) * 4


def _steps(tokenizer: Any) -> list[Step]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    out = []
    for n, i in enumerate(ids):
        lp = -((n * 13) % 40) / 10.0
        top = [(i, lp)] + [((i + k * 7) % 400 + 3, lp - k * 0.3) for k in range(1, 5)]
        out.append(Step(i, lp, top, None))
    return out


def _run_once(
    tokenizer: Any, vocab: Any, steps: list[Step], new: bool, kind: str = "chat"
) -> float:
    req = GenRequest(kind=kind, prompt=[], model="m", logprobs=True, top_logprobs=5)
    state = SequenceState(
        aligner_for(tokenizer, None, True), stop_matcher(None), eos_ids(tokenizer), 0,
        len(steps), None, lambda: 0.0,
    )  # fmt: skip
    fmt = Formatter("chatcmpl-x", req, vocab)
    if new:
        from tokentrail.output.processor import OutputProcessor

        proc = OutputProcessor(state)
        tic = time.perf_counter()
        for s in steps:
            sse(fmt.chunk(proc.feed(s, 0)))
        return time.perf_counter() - tic
    from tokentrail.server.formatting import step_of  # the older code base

    tic = time.perf_counter()
    for n, s in enumerate(steps):
        sse(fmt.chunk(step_of(state.feed(s), n, 0, (), s)))
    return time.perf_counter() - tic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--kind", choices=("chat", "completion"), default="chat",
                    help="the chunk's API: chat completions or completions (the proxy "
                    "benchmarks' requests)")
    args = ap.parse_args()
    _, tokenizer = tokentrail.load()
    vocab = vocab_for(tokenizer)
    steps = _steps(tokenizer)
    new = importlib.util.find_spec("tokentrail.output") is not None
    for _ in range(3):  # warm up
        _run_once(tokenizer, vocab, steps, new, args.kind)
    runs = [_run_once(tokenizer, vocab, steps, new, args.kind) / len(steps) * 1e6
            for _ in range(args.repeats)]
    where = Path(tokentrail.__file__).resolve().parent
    print(
        f"{'TokenOutput' if new else 'StepRecord'} path ({where}), {args.kind} chunks: "
        f"{len(steps)} tokens, "
        f"median {statistics.median(runs):.1f} us/token, min {min(runs):.1f}, "
        f"over {args.repeats} runs"
    )


if __name__ == "__main__":
    main()
