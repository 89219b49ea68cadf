"""The API reference builds from the docstrings with pdoc, and broken references fail it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, require

require("pdoc")
SCRIPT = REPO / "scripts" / "build_api_docs.py"


def test_api_reference_builds_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "api"
    r = subprocess.run([sys.executable, str(SCRIPT), str(out)], capture_output=True,
                       text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr
    for page in ("index.html", "tokentrail.html", "tokentrail/align.html",
                 "tokentrail/generate.html", "tokentrail/engines/batch.html"):
        assert (out / page).is_file(), page
    # The public entry points are documented with their docstrings.
    generate = (out / "tokentrail" / "generate.html").read_text(encoding="utf-8")
    assert 'id="stream_generate"' in generate and "GenerationResponse" in generate


def test_a_broken_reference_fails_the_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "tokentrail_fake"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        '"""See `tokentrail_fake.gone` and `tokentrail_fake.here`."""\n\n\n'
        'def here() -> None:\n    """Exists."""\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    problems = _load_script().build(tmp_path / "api", "tokentrail_fake")
    assert problems == ["tokentrail_fake.html: `tokentrail_fake.gone` does not resolve"]


def _load_script() -> Any:
    """scripts/build_api_docs.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("build_api_docs", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
