"""mlx-lm as is, with tokentrail's detokenizer: exact text, and the tokens behind it.

    python examples/mlx_lm_dropin.py [MODEL] [PROMPT]

`tokentrail.detokenizer.install(tokenizer)` makes an mlx-lm `TokenizerWrapper` hand out
tokentrail's streaming detokenizer, so every mlx-lm loop that reads
`tokenizer.detokenizer` (`mlx_lm.stream_generate`, `mlx_lm.generate`, the server) gets
exact text for every tokenizer family. Part 1 runs `mlx_lm.stream_generate` unchanged.
Part 2 drives mlx-lm's own token loop (`generate_step`) with a detokenizer from the
wrapper and reads `last_segment_tokens` right after `last_segment`: the tokens (with
byte ranges) behind exactly that text. MODEL defaults to tokentrail's demo model.
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.generate import generate_step

import tokentrail.detokenizer
from tokentrail.generate import DEMO_MODEL


def main() -> int:
    path = sys.argv[1] if len(sys.argv) > 1 else str(DEMO_MODEL)
    prompt = sys.argv[2] if len(sys.argv) > 2 else 'The word for "water" is'
    model, tokenizer = load(path)
    tokentrail.detokenizer.install(tokenizer)

    print("1. mlx_lm.stream_generate, unchanged:")
    text = "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=32))
    print(repr(text))

    print("2. mlx-lm's token loop, with the tokens behind each piece:")
    detokenizer = tokenizer.detokenizer  # a fresh copy, as mlx-lm's own loops take it
    prompt_ids = mx.array(tokenizer.encode(prompt))
    for token, _logprobs in generate_step(prompt_ids, model, max_tokens=32):
        token = int(token)
        if token in tokenizer.eos_token_ids:
            break
        detokenizer.add_token(token)
        piece = detokenizer.last_segment
        if piece:
            spans = [(t.index, t.id, t.start, t.end) for t in detokenizer.last_segment_tokens]
            print(f"{piece!r:12} {spans}")
    detokenizer.finalize()
    if detokenizer.last_segment:
        print(repr(detokenizer.last_segment), detokenizer.last_segment_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
