"""Shared fixtures: the tokenizer corpus lives outside the repository, in ../shared/corpus."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORPUS = Path(os.environ.get("TOKENTRAIL_CORPUS", REPO.parent / "shared" / "corpus"))
CORPUS_REASON = (
    f"tokenizer corpus not found at {CORPUS} (it ships with CI, not with a fresh clone; "
    "set TOKENTRAIL_CORPUS to its path to run these tests)"
)


def corpus_path(*parts: str) -> Path:
    """Path inside the corpus, skipping the calling test when the corpus is absent."""
    path = CORPUS.joinpath(*parts)
    if not path.exists():
        pytest.skip(CORPUS_REASON if not CORPUS.exists() else f"{path} missing from corpus")
    return path


@pytest.fixture(scope="session")
def corpus() -> Path:
    """The corpus root (../shared/corpus), or skip with a clear reason."""
    if not CORPUS.exists():
        pytest.skip(CORPUS_REASON)
    return CORPUS
