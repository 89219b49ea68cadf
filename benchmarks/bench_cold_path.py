"""What the proxy's per-request steps cost when they run back to back and when they run
after the process sat idle, as they do for a lone client (issue #32, time to first token).

Each step is timed on the real objects the proxy uses for SmolLM2 (its GGUF's tokenizer,
a chat request as `bench_proxy.py` sends it): warm, called back to back; and after the
process slept `--idle` ms (as between one client's requests) or spun that long in a loop
that touches little memory. Medians of `--repeat` calls each. No server is started.

    python benchmarks/bench_cold_path.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_proxy import PROMPTS

from tokentrail.fastjson import dumps, loads
from tokentrail.prompting import aligner_for, chat_ids, vocab_for
from tokentrail.realign.feeding import new_aligner
from tokentrail.server.protocol import parse_chat
from tokentrail.server.proxy import load_tokenizer

#: One frame of llama-server's streamed `/completion` as a plain request gets it through
#: the proxy (a real frame's fields: tests/data/realign/llamacpp, without logprobs).
CHUNK = (
    b'{"index": 0, "content": " sets", "tokens": [5208], "stop": false, "id_slot": -1, '
    b'"tokens_predicted": 3, "tokens_evaluated": 50}'
)


def steps(tokenizer: Any) -> dict[str, Callable[[], Any]]:
    body = {"model": "m", "messages": [{"role": "user", "content": PROMPTS[0]}],
            "max_tokens": 32, "temperature": 0, "stream": True}  # fmt: skip
    messages = body["messages"]
    ids = chat_ids(tokenizer, messages, None)
    vocab = vocab_for(tokenizer)
    size = len(vocab.pieces)

    def loop() -> int:
        s = 0
        for i in range(2000):
            s += i
        return s

    return {
        "a Python loop (2,000 additions; control)": loop,
        "JSON chunk decoded and encoded again": lambda: dumps(loads(CHUNK)),
        "the request validated (parse_chat)": lambda: parse_chat(body, "m", size),
        "the chat template rendered and tokenized": lambda: chat_ids(tokenizer, messages, None),
        "the output stage's aligner over the prompt": lambda: aligner_for(tokenizer, ids, True),
        "the realigner's aligner over the prompt": lambda: new_aligner(vocab, True, ids),
    }


def timed(f: Callable[[], Any], repeat: int, before: Callable[[], None] | None) -> float:
    out = []
    for _ in range(repeat):
        if before is not None:
            before()
        t0 = time.perf_counter()
        f()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, required=True, help="the model's GGUF (its tokenizer)")
    ap.add_argument("--idle", type=float, default=50.0, help="ms idle before a cold call")
    ap.add_argument("--repeat", type=int, default=40)
    args = ap.parse_args()
    tokenizer = load_tokenizer(args.gguf)
    idle = args.idle / 1000

    def sleep() -> None:
        time.sleep(idle)

    def spin() -> None:
        end = time.perf_counter() + idle
        while time.perf_counter() < end:
            pass

    print(f"| step | warm µs | after {args.idle:g} ms asleep | after {args.idle:g} ms spinning |")
    print("|---|---:|---:|---:|")
    named = steps(tokenizer)
    parts = list(named.values())[1:]

    def together() -> None:
        for f in parts:
            f()

    named["all but the control, one after another (a request's share)"] = together
    for name, f in named.items():
        f()
        warm = timed(f, args.repeat * 5, None)
        cold = timed(f, args.repeat, sleep)
        spun = timed(f, args.repeat, spin)
        print(f"| {name} | {warm:,.0f} | {cold:,.0f} ({cold / warm:.0f}×) | {spun:,.0f} |")


if __name__ == "__main__":
    main()
