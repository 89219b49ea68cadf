"""Re-align a recorded vLLM stream: exact segments, the tokens behind each, confidence.

    python examples/realign_vllm_stream.py [CAPTURE] [TOKENIZER]

CAPTURE is a stream another server sent (one JSON chunk per line or a raw SSE capture);
the default is vLLM's `/v1/chat/completions` stream recorded in
tests/data/realign/vllm_chat_return_token_ids.jsonl (pythia-1b, `return_token_ids`).
TOKENIZER is the tokenizer that server used; the default is the GPT-NeoX tokenizer from
the test corpus ($TOKENTRAIL_CORPUS/tokenizers/gpt-neox/20B_tokenizer.json). Prints one
JSON object per segment (its text; its tokens as [index, id, start, end], the byte
range of each token's bytes that went into it; its probability), then one line saying
whether the result is exact.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tokentrail.realign import Realigner, read_chunks

REPO = Path(__file__).resolve().parents[1]
CAPTURE = REPO / "tests" / "data" / "realign" / "vllm_chat_return_token_ids.jsonl"
CORPUS = Path(os.environ.get("TOKENTRAIL_CORPUS", REPO.parent / "shared" / "corpus"))
TOKENIZER = CORPUS / "tokenizers" / "gpt-neox" / "20B_tokenizer.json"


def main() -> int:
    capture = Path(sys.argv[1]) if len(sys.argv) > 1 else CAPTURE
    tokenizer = Path(sys.argv[2]) if len(sys.argv) > 2 else TOKENIZER
    if not tokenizer.exists():
        print(f"tokenizer not found: {tokenizer} (pass the server's tokenizer)", file=sys.stderr)
        return 2
    realigner = Realigner(str(tokenizer))
    with capture.open(encoding="utf-8") as f:
        for chunk in read_chunks(f, where=str(capture)):
            for segment in realigner.feed(chunk):  # segments as soon as they are final
                print(json.dumps({
                    "text": segment.text,
                    "tokens": [[t.index, t.id, t.start, t.end] for t in segment.tokens],
                    "p": None if segment.confidence is None
                    else round(segment.confidence.probability, 3),
                }, ensure_ascii=False))
    for segment in realigner.finish():
        print(json.dumps({
            "text": segment.text,
            "tokens": [[t.index, t.id, t.start, t.end] for t in segment.tokens],
        }, ensure_ascii=False))
    result = realigner.result()
    print(result.summary())
    return 0 if result.exact else 3


if __name__ == "__main__":
    raise SystemExit(main())
