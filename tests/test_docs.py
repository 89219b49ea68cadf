"""README.md and docs/*.md run as written: every fenced code block is collected here.

The blocks are found with markdown-it-py (the CommonMark parser rich already depends
on), so fences inside lists, tildes and longer fences are read as any Markdown viewer
reads them. pytest-examples was considered: it runs only Python blocks (checking
`#>` comments and formatting them with black), while these docs also need shell
sessions checked and skip markers with reasons, so the rules below are kept here.

- ```python: executed, per file, in order, in one namespace per file, in a fresh
  temporary working directory that holds links to the repository's `src/`, `tests/`
  and `examples/` (so `src/tokentrail/demo_model` works as it does from a clone). A
  block that needs an optional extra which is not installed skips with its install hint.
- ```console: every line starting with `$ ` is run through bash in that directory with
  this interpreter's `bin/` (the `tokentrail` entry point) first on PATH; the lines up to
  the next `$ ` line are compared with what the command printed (stdout and stderr
  together, trailing spaces and blank lines ignored). In expected lines `...` matches
  any text within a line, and a line that is only `...` matches any number of lines.
  The command must exit 0, unless the expected output ends with a line `[N]`: then it
  must exit N.
- ```text and ```json: illustrative (shapes, sample output), not run. A ```text block
  right after the line `<!-- docs-test: output -->` is checked instead: it must be what
  the python block before it printed (same matching rules).
- A block right after the line `<!-- docs-test: skip (REASON) -->` is reported as
  skipped with REASON.
- Any other fence (```bash, ```sh, a bare ```) fails: say what it is (console, text)
  or why it cannot run.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.env import EXTRA_OF, install_hint

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: Repository folders linked into each file's temporary working directory.
LINKED = ("src", "tests", "examples", "benchmarks", "scripts", "docs")
SKIP = re.compile(r"^\s*<!--\s*docs-test:\s*skip\s*\((?P<reason>.+)\)\s*-->\s*$")
OUTPUT = re.compile(r"^\s*<!--\s*docs-test:\s*output\s*-->\s*$")
RUN = {"python", "console"}
ILLUSTRATIVE = {"text", "json"}
COMMAND_TIMEOUT_S = 600


@dataclass
class Block:
    """One fenced code block of a Markdown file."""

    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    source: str
    skip: str | None  # the reason of a skip marker right before the fence
    checks_output: bool  # a ```text block after `<!-- docs-test: output -->`

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}:{self.lang or 'bare'}"


def blocks_of(path: Path) -> list[Block]:
    """The fenced code blocks of `path`, with the marker (if any) right before each."""
    from markdown_it import MarkdownIt

    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    out = []
    for token in MarkdownIt("commonmark").parse(text):
        if token.type != "fence" or token.map is None:
            continue
        start = token.map[0]
        before = lines[start - 1] if start > 0 else ""
        skip = SKIP.match(before)
        out.append(
            Block(
                path=path,
                line=start + 1,
                lang=token.info.strip().split(" ")[0].lower() if token.info else "",
                source=token.content,
                skip=skip.group("reason") if skip else None,
                checks_output=bool(OUTPUT.match(before)),
            )
        )
    return out


ALL_BLOCKS = [b for p in DOC_FILES for b in blocks_of(p)]
CHECKED = [b for b in ALL_BLOCKS if b.skip or b.lang not in ILLUSTRATIVE or b.checks_output]


# -- matching shown output against real output ------------------------------------------


def _pattern(expected: list[str]) -> re.Pattern[str]:
    """Regex for the expected lines: `...` within a line, or as a whole line."""
    parts = []
    for line in expected:
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(re.escape(p) for p in line.split("...")) + r"\n")
    return re.compile("".join(parts), re.DOTALL)


def _normal(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def output_matches(expected: list[str], actual: str) -> bool:
    """Whether `actual` (a command's output) is what `expected` shows."""
    want = _normal("\n".join(expected))
    got = "".join(line + "\n" for line in _normal(actual))
    if not want:
        return got == ""
    return _pattern(want).fullmatch(got) is not None


def test_output_matching_rules() -> None:
    assert output_matches(["a ... c", "...", "z"], "a b c\nx\ny\nz\n")
    assert output_matches(["a", "...", "b"], "a\nb\n")
    assert output_matches(["a  "], "a\n\n")
    assert not output_matches(["a", "b"], "a\nb\nc\n")
    assert not output_matches(["a ... c"], "a b d\n")
    assert not output_matches([], "noise\n")


# -- running blocks ---------------------------------------------------------------------


class _Workspace:
    """One temporary working directory and Python namespace per Markdown file."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for name in LINKED:
            if (REPO / name).exists():
                (root / name).symlink_to(REPO / name, target_is_directory=True)
        self.namespace: dict[str, Any] = {"__name__": "__docs__"}
        self.last_output = ""


@pytest.fixture(scope="module")
def workspaces() -> dict[Path, _Workspace]:
    """Each Markdown file's workspace, created by its first block that runs."""
    return {}


def _workspace(spaces: dict[Path, _Workspace], path: Path, factory: Any) -> _Workspace:
    if path not in spaces:
        spaces[path] = _Workspace(factory.mktemp(path.stem))
    return spaces[path]


def _env(workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    bin_dir = Path(sys.executable).parent
    paths = [str(bin_dir)]
    if not (bin_dir / "tokentrail").exists():  # no entry point here: a shim for this Python
        shim = workdir / ".bin"
        shim.mkdir(exist_ok=True)
        (shim / "tokentrail").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tokentrail "$@"\n')
        (shim / "tokentrail").chmod(0o755)
        paths.insert(0, str(shim))
    env["PATH"] = os.pathsep.join([*paths, env.get("PATH", "")])
    if env.get("PYTHONPATH"):  # relative entries (PYTHONPATH=src) mean the repository's
        env["PYTHONPATH"] = os.pathsep.join(
            str((REPO / p).resolve()) if not os.path.isabs(p) else p
            for p in env["PYTHONPATH"].split(os.pathsep)
        )
    # Plain, stable output: no colour, rich's default width.
    env.update({"NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "80", "PYTHONIOENCODING": "utf-8"})
    env.pop("FORCE_COLOR", None)
    return env


def _sessions(source: str) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) pairs of a console block."""
    out: list[tuple[str, list[str]]] = []
    for line in source.splitlines():
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif out:
            out[-1][1].append(line)
        elif line.strip():
            raise AssertionError(f"console block line before any '$ ' command: {line!r}")
    if not out:
        raise AssertionError("console block without a '$ ' command")
    return out


def _run_console(block: Block, space: _Workspace) -> None:
    env = _env(space.root)
    for command, expected in _sessions(block.source):
        status = 0
        if expected and re.fullmatch(r"\[\d+\]", expected[-1].strip()):
            status = int(expected.pop().strip()[1:-1])
        r = subprocess.run(
            ["bash", "-c", command], cwd=space.root, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, timeout=COMMAND_TIMEOUT_S,
        )
        assert r.returncode == status, (
            f"{block.id}: `{command}` exited {r.returncode}, not {status}:\n{r.stdout}"
        )
        assert output_matches(expected, r.stdout), (
            f"{block.id}: `{command}` printed:\n{r.stdout}\nbut the docs show:\n"
            + "\n".join(expected)
        )


def _run_python(block: Block, space: _Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(space.root)
    printed = io.StringIO()
    code = compile(block.source, f"{block.id}", "exec")
    try:
        with contextlib.redirect_stdout(printed):
            exec(code, space.namespace)
    except ModuleNotFoundError as e:  # an optional extra that is not installed here
        top = (e.name or "").split(".")[0]
        if top not in EXTRA_OF and top != "vllm":
            raise
        pytest.skip(f"{top} is not installed: {install_hint(top)}")
    space.last_output = printed.getvalue()
    sys.stdout.write(space.last_output)  # shown by pytest on failure


@pytest.mark.parametrize("block", CHECKED, ids=[b.id for b in CHECKED])
def test_doc_block(
    block: Block,
    workspaces: dict[Path, _Workspace],
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if block.skip:
        pytest.skip(block.skip)
    space = _workspace(workspaces, block.path, tmp_path_factory)
    if block.checks_output:
        assert block.lang == "text", f"{block.id}: an output check must be a ```text block"
        assert output_matches(block.source.splitlines(), space.last_output), (
            f"{block.id}: the python block above printed:\n{space.last_output}\n"
            f"but the docs show:\n{block.source}"
        )
    elif block.lang == "python":
        _run_python(block, space, monkeypatch)
    elif block.lang == "console":
        _run_console(block, space)
    else:
        pytest.fail(
            f"{block.id}: a ```{block.lang} block is neither run nor marked; use ```console "
            "(with '$ ' lines), ```python, ```text for illustrative output, or put "
            "'<!-- docs-test: skip (REASON) -->' on the line before it"
        )


def test_every_doc_file_is_collected() -> None:
    assert REPO / "README.md" in DOC_FILES
    for path in DOC_FILES:
        fences = sum(1 for line in path.read_text().splitlines() if line.startswith("```"))
        assert fences == 2 * len(blocks_of(path)), f"{path}: unbalanced or unparsed fences"
