"""A chat loop that shows how sure the model was of every piece of its reply.

    python examples/chat_confidence.py [--model PATH] [--max-tokens N] [--system TEXT]

Type a message and press Enter; an empty line or end of input quits. Each reply is
printed as it streams; pieces whose tokens the model was unsure of (probability below
--unsure, default 0.3) are shown as «text|p», and a line after the reply names the least
sure piece and the alternatives the model weighed for it. The conversation is kept, so
later questions see earlier answers. Runs on the built-in demo model by default.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import tokentrail


def reply(model: Any, tokenizer: Any, messages: list[dict[str, str]],
          args: argparse.Namespace) -> str:
    """Stream one assistant reply to stdout; return its text."""
    parts: list[str] = []
    weakest = None  # (probability, text, tokens) of the least sure piece
    last = None
    for r in tokentrail.stream_generate(
        model, tokenizer, messages, max_tokens=args.max_tokens, top_logprobs=3
    ):
        last = r
        if not r.text:
            continue
        parts.append(r.text)
        p = r.confidence.probability if r.confidence else 1.0
        shown = f"«{r.text}|{p:.2f}»" if p < args.unsure and r.text.strip() else r.text
        print(shown, end="", flush=True)
        if r.text.strip() and (weakest is None or p < weakest[0]):
            weakest = (p, r.text, r.last_segment_tokens)
    print()
    if last is not None:
        note = f"({last.generation_tokens} tokens, finished: {last.finish_reason}"
        if weakest is not None:
            p, text, tokens = weakest
            unsure = min(tokens, key=lambda t: t.logprob if t.logprob is not None else 0)
            alts = ", ".join(
                f"{a.text!r} {math.exp(a.logprob):.2f}" for a in unsure.top_logprobs or []
            )
            note += f"; least sure: {text!r} {p:.2f}, alternatives: {alts}"
        print(note + ")")
    return "".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder (default: the built-in demo model)")
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--system", help="system message for the whole conversation")
    parser.add_argument("--unsure", type=float, default=0.3,
                        help="mark pieces below this probability (default: 0.3)")
    args = parser.parse_args()
    model, tokenizer = tokentrail.load(args.model)
    messages = [] if args.system is None else [{"role": "system", "content": args.system}]
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line.strip()})
        if not interactive:
            print(f"you> {line.strip()}")
        print("model> ", end="", flush=True)
        messages.append({"role": "assistant", "content": reply(model, tokenizer, messages, args)})


if __name__ == "__main__":
    raise SystemExit(main())
