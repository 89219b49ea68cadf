"""Build the recorded chunk sequences in this folder, reproducibly.

    python -m tests.data.realign.make_recordings [--out DIR]     (from the repository root)

The recordings and their ground truth are built by `tests.helpers.recordings` (whose
docstring says how); tests/test_realign.py checks that they are reproduced byte for byte.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tests.helpers.env import CORPUS
from tests.helpers.recordings import build

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="folder to write (default: here)")
    args = parser.parse_args()
    if not CORPUS.exists():
        raise SystemExit(f"tokenizer corpus not found at {CORPUS} (set TOKENTRAIL_CORPUS)")
    for entry in build(args.out):
        print(f"{entry['file']}: {len(entry['ids'])} tokens, refused {entry['refused']}")


if __name__ == "__main__":
    main()
