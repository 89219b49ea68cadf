"""The API reference builds from the docstrings with pdoc, and broken references fail it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.env import REPO, require

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


def test_a_broken_reference_fails_the_build(tmp_path: Path) -> None:
    pkg = tmp_path / "tokentrail_fake"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        '"""See `tokentrail_fake.gone` and `tokentrail_fake.here`."""\n\n\n'
        'def here() -> None:\n    """Exists."""\n'
    )
    path = [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--package", "tokentrail_fake", str(tmp_path / "api")],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=env,
    )
    assert r.returncode == 1, r.stderr
    problems = r.stderr.splitlines()
    assert problems == ["tokentrail_fake.html: `tokentrail_fake.gone` does not resolve"]
