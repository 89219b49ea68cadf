"""How long a GGUF vocabulary takes to load: tokentrail against the `gguf` package's
reader and llama.cpp's own loader, side by side in one run.

For each GGUF file (the corpus's, llama.cpp's tokenizer-test vocabularies in the tree
scripts/build_llama_server.sh unpacks, SmolLM2's model file), the median of `--repeat`
runs, in seconds, of:

- ``gguf reader``: `gguf.GGUFReader` and every tokenizer key's value (how tokentrail read
  the metadata before `tokentrail.vocab.gguf_meta`);
- ``metadata``: `gguf_meta.read_metadata` of the same keys (the values are equal:
  tests/test_gguf_meta.py);
- ``load_vocab``: `tokentrail.load_vocab(path)`, the whole vocabulary compiled (the
  metadata read included), as `Aligner(path)` and `tokentrail align` pay it;
- ``llama.cpp``: `llama_cpp.Llama(path, vocab_only=True)` (llama-cpp-python), the
  runtime's own load of the same vocabulary.

    python benchmarks/bench_gguf_load.py [--repeat 3] [FILE.gguf ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokentrail import load_vocab
from tokentrail.vocab.gguf_meta import read_metadata

CACHE = Path(os.environ.get("TOKENTRAIL_CACHE", Path.home() / ".cache" / "tokentrail"))
CORPUS = Path(os.environ.get("TOKENTRAIL_CORPUS", Path(__file__).resolve().parents[2]
                             / "shared" / "corpus"))  # fmt: skip


def tokenizer_key(key: str) -> bool:
    return key.startswith("tokenizer.ggml.") or key == "general.architecture"


def files() -> list[Path]:
    found = sorted(CORPUS.glob("tokenizers/*/*.gguf"))
    found += sorted((CACHE / "llama.cpp-0.3.36" / "src" / "models").glob("ggml-vocab-*.gguf"))
    found += sorted((CACHE / "models").glob("*.gguf"))
    return found


def gguf_reader(path: Path) -> Any:
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if tokenizer_key(k)}


def llama_cpp_vocab(path: Path) -> Any:
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


def median_time(fn: Callable[[], Any], repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        tic = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - tic)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    try:
        import llama_cpp  # noqa: F401

        has_llama = True
    except ImportError:
        has_llama = False
    print("| file | tokens | gguf reader | metadata | load_vocab | llama.cpp "
          "| gguf reader / metadata |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for path in args.files or files():
        meta = read_metadata(path, tokenizer_key)
        n = len(meta.get("tokenizer.ggml.tokens", []))
        old = median_time(lambda p=path: gguf_reader(p), args.repeat)
        new = median_time(lambda p=path: read_metadata(p, tokenizer_key), args.repeat)
        whole = median_time(lambda p=path: load_vocab(p), args.repeat)
        ref = median_time(lambda p=path: llama_cpp_vocab(p), args.repeat) if has_llama else None
        shown = "–" if ref is None else f"{ref:.2f}"
        print(f"| {path.name} | {n:,} | {old:.2f} | {new:.3f} | {whole:.2f} | {shown} "
              f"| {old / new:.0f}x |")


if __name__ == "__main__":
    main()
