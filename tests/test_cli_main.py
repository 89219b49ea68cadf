"""The `tokentrail` entry point: --version, `bench` options and its errors, packaging."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO_TOKENIZER = REPO / "src" / "tokentrail" / "demo_model" / "tokenizer.json"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokentrail", *args], capture_output=True, text=True, timeout=120
    )


def test_version_from_module_and_script_match_the_installed_metadata() -> None:
    expected = f"tokentrail {metadata.version('tokentrail')}\n"
    r = run("--version")
    assert (r.returncode, r.stdout) == (0, expected)
    script = Path(sys.executable).with_name("tokentrail")
    if not script.exists():
        pytest.skip(f"no tokentrail script next to {sys.executable}: pip install -e .")
    r = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (0, expected)


@pytest.mark.parametrize(("args", "needle"), [
    (["--repeat", "0"], "--repeat must be at least 1, not 0"),
    (["--repeat", "-3"], "--repeat must be at least 1, not -3"),
    (["--tokens", "0"], "--tokens must be at least 1, not 0"),
    (["--repeat", "x"], "argument --repeat: invalid int value: 'x'"),
    (["--text-file", "/nonexistent/text.txt"], "cannot read --text-file"),
])
def test_bench_bad_input_exits_2_with_one_line(args: list[str], needle: str) -> None:
    r = run("bench", "--tokenizer", str(DEMO_TOKENIZER), *args)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and needle in r.stderr, r.stderr


def test_bench_unreadable_tokenizer_exits_2(tmp_path: Path) -> None:
    r = run("bench", "--tokenizer", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "cannot load tokenizer" in r.stderr


def test_bench_measures_both_modes(tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text("Grüße, 世界! " * 50, encoding="utf-8")
    r = run("bench", "--tokenizer", str(DEMO_TOKENIZER), "--tokens", "3000", "--repeat", "1",
            "--text-file", str(text))
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["tokens"] == 3000
    assert result["us_per_token_median_text"] > 0
    assert result["us_per_token_median_text_and_tokens"] > 0


def test_bench_help_explains_every_option() -> None:
    r = run("bench", "--help")
    assert r.returncode == 0
    # Each option's help text starts on its own line or after the option on the same line.
    for option in ("--tokenizer", "--tokens", "--repeat", "--text-file", "--verbose"):
        m = re.search(rf"^\s+(?:-\w, )?{option}(?: [A-Z]+)?(.*)$", r.stdout, re.MULTILINE)
        assert m is not None, f"{option} missing from bench --help"
        after = m.group(1).strip() or r.stdout[m.end():].lstrip("\n").splitlines()[0].strip()
        assert len(after.split()) >= 3, f"{option} has no explanation: {after!r}"


def test_unknown_command_exits_2_with_one_line() -> None:
    r = run("frobnicate")
    assert r.returncode == 2 and "invalid choice: 'frobnicate'" in r.stderr
    assert r.stderr.count("\n") == 1


def test_all_extra_covers_every_optional_part() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    named: set[str] = set()
    for requirement in extras["all"]:
        m = re.fullmatch(r"tokentrail\[([\w,-]+)\](;.*)?", requirement)
        assert m is not None, f"'all' should only name tokentrail's extras: {requirement}"
        named |= set(m.group(1).split(","))
    # lmstudio holds LM Studio's mlx-engine's own dependencies, for the tests that run
    # that peer with tokentrail swapped in; tokentrail itself never imports them.
    assert named == set(extras) - {"all", "dev", "lmstudio"}
    assert project["license"] == "MIT"  # SPDX string, not the deprecated table


def test_package_is_typed_and_exports_its_public_names() -> None:
    import tokentrail

    assert (Path(tokentrail.__file__).parent / "py.typed").is_file()
    for name in ("load", "stream_generate", "GenerationResponse", "Aligner", "load_vocab",
                 "StreamingDetokenizer", "Realigner"):
        assert name in tokentrail.__all__ and name in dir(tokentrail)
    code = "import tokentrail; [getattr(tokentrail, n) for n in tokentrail.__all__]"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
