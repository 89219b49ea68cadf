"""`tokentrail generate --json-schema FILE | --regex R | --choice A,B` in a subprocess:
the output obeys the constraint (jsonschema and `re` as oracles), a JSON schema lists
its fields, and a spec llguidance cannot compile is exit 2 with one line on stderr."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.env import require

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                    "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", autouse=True)
def _needs() -> None:
    require("mlx_lm", "the demo model runs on MLX")
    require("llguidance", "constrained decoding")


def generate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokentrail", "generate", "--no-chat", "--json", *args],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )


def reply(r: subprocess.CompletedProcess[str]) -> tuple[str, list[dict]]:
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    return "".join(d["text"] for d in lines), lines


@pytest.mark.parametrize("seed", [0, 1])
def test_json_schema_output_validates_and_lists_its_fields(tmp_path: Path, seed: int) -> None:
    jsonschema = require("jsonschema")
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    text, lines = reply(generate("--json-schema", str(path), "--temp", "0.8", "--seed",
                                 str(seed), "--max-tokens", "40", "The answer:"))
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    assert lines[-1]["finish_reason"] == "stop"
    fields = {f["path"]: f for d in lines for f in d.get("fields") or []}
    assert set(fields) == {"/ok", "/n"}
    for pointer, f in fields.items():
        assert f["value"] == value[pointer[1:]]
        # the leaf's text is where the output has it: a JSON decoder started at the
        # leaf's first character reads exactly that value
        start = text.index(f["text"], text.index(f'"{pointer[1:]}"'))
        assert json.JSONDecoder().raw_decode(text, start) == (f["value"], start + len(f["text"]))


def test_regex_and_choice_outputs_obey() -> None:
    text, _ = reply(generate("--regex", "[a-z]{2,5}", "--max-tokens", "10", "Say"))
    assert re.fullmatch("[a-z]{2,5}", text), text
    text, _ = reply(generate("--choice", "yes,no,maybe", "--temp", "1", "--seed", "3",
                             "--max-tokens", "10", "Is it?"))
    assert text in {"yes", "no", "maybe"}


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--regex", "[a-z"], "--regex"),
        (["--choice", ","], "--choice"),
        (["--json-schema", "/nonexistent/schema.json"], "--json-schema"),
    ],
)
def test_bad_constraint_is_exit_2_with_one_line(args: list[str], names: str) -> None:
    r = generate(*args, "Hi")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and names in r.stderr, r.stderr


def test_schema_that_cannot_compile_names_the_flag(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"type": "frob"}')
    r = generate("--json-schema", str(path), "Hi")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "--json-schema" in r.stderr and "frob" in r.stderr


def test_json_schema_after_reasoning_markers(tmp_path: Path) -> None:
    """--json-schema with --reasoning-markers '' END: END is two segments of the model's
    own greedy reply (a string it writes early, ending where a token ends); the
    reasoning is that reply's text before END, the content after it validates."""
    jsonschema = require("jsonschema")
    free, lines = reply(generate("--max-tokens", "16", "The answer:"))
    texts = [d["text"] for d in lines]
    for i in range(1, len(texts) - 2):
        marker = texts[i] + texts[i + 1]
        if marker.strip() and free.index(marker) == len("".join(texts[:i])):
            break
    else:
        pytest.skip(f"no early marker in {free!r}")
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    _, lines = reply(
        generate(
            "--json-schema",
            str(path),
            "--reasoning-markers",
            "",
            marker,
            "--max-tokens",
            "60",
            "The answer:",
        )
    )
    reasoning = "".join(d.get("reasoning_text") or "" for d in lines)
    content = "".join(d.get("content_text") or "" for d in lines)
    assert reasoning == free[: free.index(marker)]
    jsonschema.validate(json.loads(content), SCHEMA)
    assert lines[-1]["finish_reason"] == "stop"
