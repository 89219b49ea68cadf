"""Skips tell a newcomer what is missing and how to get it (tests/helpers/env.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.helpers.env import EXTRA_OF, REPO, install_hint


def test_every_install_hint_names_a_real_extra() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for module, extra in EXTRA_OF.items():
        assert extra in extras, f"{module}: no [{extra}] extra in pyproject.toml"
        assert install_hint(module) == f"pip install -e '.[{extra}]'"


def test_missing_corpus_skip_says_what_it_is_and_how_to_run_everything(tmp_path: Path) -> None:
    env = {**os.environ, "TOKENTRAIL_CORPUS": str(tmp_path / "no-corpus")}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         str(REPO / "tests" / "test_cli_align.py")],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    skips = [line for line in r.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skips, r.stdout
    for line in skips:
        assert "tokenizer corpus" in line and "a clone works without it" in line
        assert re.search(r"TOKENTRAIL_CORPUS=\S+ bash scripts/test\.sh", line), line
