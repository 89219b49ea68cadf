"""The repository, the tokenizer corpus and the install hints that skips give.

The corpus is a folder of real tokenizer files from many model families (GPT-2, Llama
2/3, Qwen, Mistral, BERT, T5, ...) that the exactness tests use with each tokenizer's
own library as the oracle. It is CI's test data, not part of the package: a user's
clone works without it, and the tests that need it skip with `CORPUS_REASON`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NoReturn

import pytest

REPO = Path(__file__).resolve().parents[2]
CORPUS = Path(os.environ.get("TOKENTRAIL_CORPUS", REPO.parent / "shared" / "corpus"))
CORPUS_REASON = (
    f"the tokenizer corpus (real tokenizer files of many model families, CI's test data "
    f"for the exactness tests) is not at {CORPUS}; a clone works without it. To run the "
    "full suite: TOKENTRAIL_CORPUS=/path/to/corpus bash scripts/test.sh"
)
#: With CI=true, a missing llama.cpp piece fails the test instead of skipping it.
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

#: Which extra of pyproject.toml installs a module the tests may need.
EXTRA_OF = {
    "mlx": "mlx",
    "mlx_lm": "mlx",
    "torch": "torch",
    "safetensors": "torch",
    "transformers": "hf",
    "gguf": "gguf",
    "mistral_common": "mistral",
    "starlette": "server",
    "uvicorn": "server",
    "llama_cpp": "llamacpp",
    "openai": "dev",
    "httpx": "dev",
    "selenium": "dev",
    "numpy": "mlx",
    "prometheus_client": "server",
    "accelerate": "gguf",
    "pdoc": "dev",
}


def install_hint(module: str) -> str:
    """The command that installs `module` for these tests (its extra, or plain pip)."""
    top = module.split(".")[0]
    if top == "vllm":
        return "pip install vllm"
    extra = EXTRA_OF.get(top)
    return f"pip install -e '.[{extra}]'" if extra else f"pip install {top}"


def require(module: str, why: str = "") -> Any:
    """Import `module`, or skip the calling test (or module) saying how to install it."""
    what = f" ({why})" if why else ""
    return pytest.importorskip(
        module, reason=f"{module} is not installed{what}: {install_hint(module)}"
    )


def corpus_path(*parts: str) -> Path:
    """Path inside the corpus, skipping the calling test when the corpus is absent."""
    path = CORPUS.joinpath(*parts)
    if not path.exists():
        pytest.skip(CORPUS_REASON if not CORPUS.exists() else f"{path} missing from corpus")
    return path


def missing(reason: str) -> NoReturn:
    """Skip (locally) or fail (in CI) the calling test."""
    if IN_CI:
        pytest.fail(f"CI=true but {reason}", pytrace=False)
    pytest.skip(reason)


def need_llama_cpp() -> Any:
    """The llama_cpp module, or skip (fail in CI) saying how to install it."""
    try:
        import llama_cpp
    except ImportError:
        missing(
            "llama-cpp-python is not installed (pip install 'tokentrail[llamacpp]'; it "
            "compiles llama.cpp, 10-16 min the first time)"
        )
    return llama_cpp
