"""The proxy's reader in process: µs per token from an upstream's bytes to its steps.

`tokentrail.engines.upstream.wire.StepReader` is what `serve --upstream` runs on every
byte an upstream streams: the server-sent events split, each frame's JSON decoded, the
realigner fed, one `Step` per token out. Here it reads real llama-server recordings of
the demo model (`tests/data/realign/llamacpp_demo`: llama.cpp's own ``/completion``, as
the proxy asks llama-server, and ``/v1/completions``; temperatures 0 and 1.5; top-5
alternatives on every token) and real vLLM recordings of it
(`tests/data/realign/vllm_demo`: ``/v1/completions`` as the proxy asks vLLM, ``token_id:N``
alternatives), each frame written back as the SSE event it came in, fed one event per
`feed` (as a proxy reads one event per token at low load). No sockets, no
event loop: the Python per token, repeatable on a shared machine (medians of repeated
runs, CPU time).

    python benchmarks/bench_reader.py                               # this checkout
    PYTHONPATH=/path/to/old/src python benchmarks/bench_reader.py   # another checkout
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types
from pathlib import Path

import tokentrail
from tokentrail import load_vocab
from tokentrail.engines.upstream.wire import StepReader

REPO = Path(__file__).resolve().parents[1]
RECORDINGS = REPO / "tests" / "data" / "realign"
#: Each workload's recordings: (folder, the upstream's dialect, their manifest endpoint).
SOURCES = {
    "completion": ("llamacpp_demo", "llama.cpp", "completion"),
    "v1_completions": ("llamacpp_demo", "llama.cpp", "v1_completions"),
    "vllm": ("vllm_demo", "vllm", "v1_completions"),
}
DEMO = REPO / "src" / "tokentrail" / "demo_model"


def _events(folder: Path, name: str) -> list[bytes]:
    lines = (folder / f"{name}.jsonl").read_text("utf-8").splitlines()
    frames = [json.dumps(json.loads(line), separators=(",", ":")) for line in lines if line]
    return [f"data: {f}\n\n".encode() for f in frames] + [b"data: [DONE]\n\n"]


def _read(engine: object, stream: tuple[list[bytes], int]) -> int:
    events, limit = stream
    reader = StepReader(engine, {"stream": True}, [1], limit)  # type: ignore[arg-type]
    n = 0
    for event in events:
        n += len(reader.feed(event))
    return n + len(reader.finish())


def workload(endpoint: str) -> tuple[object, list[tuple[list[bytes], int]]]:
    """(engine stand-in, streams) for the recordings of one endpoint: what `_read` reads."""
    name, dialect, kind = SOURCES[endpoint]
    folder = RECORDINGS / name
    vocab = load_vocab(str(DEMO))
    engine = types.SimpleNamespace(
        url="http://upstream", dialect=dialect, vocab=vocab, eos_ids=(0, 2), filler=lambda: 1
    )
    manifest = json.loads((folder / "MANIFEST.json").read_text("utf-8"))["recordings"]
    streams = [(_events(folder, r["name"]), len(r["ids"])) for r in manifest
               if r["endpoint"] == kind]  # fmt: skip
    return engine, streams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--passes", type=int, default=50, help="passes over the recordings per run")
    args = ap.parse_args()
    where = Path(tokentrail.__file__).resolve().parent
    print(f"StepReader ({where}), medians of {args.repeats} runs of {args.passes} passes:")
    for endpoint in SOURCES:
        engine, streams = workload(endpoint)
        tokens = sum(_read(engine, s) for s in streams)  # and a warm-up
        runs = []
        for _ in range(args.repeats):
            tic = time.process_time()
            for _ in range(args.passes):
                for s in streams:
                    _read(engine, s)
            runs.append((time.process_time() - tic) / (args.passes * tokens) * 1e6)
        print(
            f"  {endpoint}: {len(streams)} streams, {tokens} tokens, "
            f"median {statistics.median(runs):.1f} us/token, min {min(runs):.1f}"
        )


if __name__ == "__main__":
    main()
