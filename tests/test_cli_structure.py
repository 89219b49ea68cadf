"""`tokentrail generate --reasoning-parser/--reasoning-markers/--fields` in a subprocess:
exit codes, one line on stderr for bad flags, and the `--json` lines' channel and
fields, checked against `str.find` on the text the same run printed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.env import require

PROMPT = "The capital of France is"


@pytest.fixture(scope="module", autouse=True)
def _mlx() -> None:
    require("mlx_lm", "the demo model runs on MLX")


def generate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokentrail", "generate", "--no-chat", *args],
        capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
    )


def lines(r: subprocess.CompletedProcess[str]) -> list[dict]:
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def test_reasoning_markers_json_lines() -> None:
    plain = lines(generate("--max-tokens", "30", "--json", PROMPT))
    full = "".join(d["text"] for d in plain)
    start, end = full[6:10], full[20:23]
    i = full.find(start)
    j = full.find(end, i + len(start))
    assert 0 <= i < j
    out = lines(generate("--max-tokens", "30", "--json", "--reasoning-markers", start, end, PROMPT))
    assert "".join(d["text"] for d in out) == full
    assert all(d["channel"] in ("reasoning", "content") for d in out)
    assert all("fields" not in d for d in out)
    last = out[-1]
    assert last["reasoning"] == full[i + len(start) : j]
    assert last["content"] == full[:i] + full[j + len(end) :]
    parts = [c for d in out for c in d["channels"]]
    assert "".join(c["text"] for c in parts if c["channel"] == "markup") == start + end
    assert "".join(d["reasoning_text"] for d in out) == last["reasoning"]


def test_fields_flag_adds_fields_to_json_lines() -> None:
    out = lines(generate("--max-tokens", "10", "--json", "--fields", PROMPT))
    assert all(isinstance(d["fields"], list) for d in out)
    assert "all_fields" in out[-1] and "fields_error" in out[-1]
    assert all("channel" not in d for d in out)


def test_terminal_mode_runs_with_reasoning_and_fields() -> None:
    r = generate("--max-tokens", "20", "--reasoning-parser", "deepseek_r1", "--fields", PROMPT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--reasoning-parser", "nope"], "unknown reasoning parser"),
        (["--reasoning-markers", "a", ""], "end marker is empty"),
        (["--reasoning-parser", "qwen3", "--reasoning-markers", "a", "b"], "not allowed with"),
    ],
)
def test_bad_flags_exit_2_with_one_line(args: list[str], needle: str) -> None:
    r = generate(*args, PROMPT)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr
