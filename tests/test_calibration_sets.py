"""The calibration sets in benchmarks/data/calibration: rebuilt byte for byte by their
script, readable by `tokentrail calibrate`, and the generated questions' answers right
and not matchable by a reply that only echoes the question."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tokentrail.calibrate.data import read_items
from tokentrail.calibrate.match import is_correct

SETS = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "calibration"
FILES = ("facts.jsonl", "arithmetic.jsonl", "generated.jsonl", "knowledge.jsonl",
         "atlas.jsonl")


def test_make_sets_rebuilds_every_file_byte_for_byte(tmp_path: Path) -> None:
    script = tmp_path / "make_sets.py"
    script.write_bytes((SETS / "make_sets.py").read_bytes())
    subprocess.run([sys.executable, str(script)], check=True, timeout=60)
    for name in FILES[:3]:
        assert (tmp_path / name).read_bytes() == (SETS / name).read_bytes(), name


def test_make_knowledge_rebuilds_its_file_byte_for_byte(tmp_path: Path) -> None:
    for script in ("make_sets.py", "make_knowledge.py"):  # it takes CAPITALS from make_sets
        (tmp_path / script).write_bytes((SETS / script).read_bytes())
    subprocess.run([sys.executable, str(tmp_path / "make_knowledge.py")], check=True,
                   timeout=60, capture_output=True)
    name = "knowledge.jsonl"
    assert (tmp_path / name).read_bytes() == (SETS / name).read_bytes()


def test_knowledge_free_text_is_not_matched_by_its_question() -> None:
    """An accepted answer never sits in its question: a reply that echoes it is wrong."""
    for it in read_items(SETS / "knowledge.jsonl"):
        if it.choices is None:
            assert not is_correct(_question(it), it.answers), it
            assert is_correct(f"It is {it.answers[0]}.", it.answers), it


def test_make_atlas_rebuilds_its_file_byte_for_byte(tmp_path: Path) -> None:
    # (it imports make_sets, make_knowledge and its two tables of facts)
    for script in ("make_sets.py", "make_knowledge.py", "make_atlas.py", "atlas_facts.py",
                   "atlas_places.py"):
        (tmp_path / script).write_bytes((SETS / script).read_bytes())
    subprocess.run([sys.executable, str(tmp_path / "make_atlas.py")], check=True,
                   timeout=60, capture_output=True)
    name = "atlas.jsonl"
    assert (tmp_path / name).read_bytes() == (SETS / name).read_bytes()


def test_atlas_free_text_is_not_matched_by_its_question() -> None:
    """An accepted answer never sits in its question: a reply that echoes it is wrong."""
    for it in read_items(SETS / "atlas.jsonl"):
        if it.choices is None:
            assert not is_correct(_question(it), it.answers), it
            assert is_correct(f"It is {it.answers[0]}.", it.answers), it


def test_atlas_questions_are_new_and_its_halves_mix_the_families() -> None:
    """No question repeats within atlas.jsonl or one of facts.jsonl or knowledge.jsonl, and
    the halves (`--half 1|2`, alternate lines) split every family evenly (to one item)."""
    atlas = read_items(SETS / "atlas.jsonl")
    questions = [_question(it) for it in atlas]
    assert len(set(questions)) == len(questions)
    for name in ("facts.jsonl", "knowledge.jsonl"):
        assert not set(questions) & {_question(it) for it in read_items(SETS / name)}, name
    one, two = (Counter(it.id.rsplit("-", 1)[0] for it in half)
                for half in (atlas[0::2], atlas[1::2]))
    assert len(one) >= 40 and set(one) == set(two)
    assert all(abs(one[f] - two[f]) <= 1 for f in one)


@pytest.mark.parametrize("name", FILES)
def test_every_set_reads_as_calibrate_reads_it(name: str) -> None:
    items = read_items(SETS / name)
    assert len({it.id for it in items}) == len(items)
    for it in items:
        if it.choices is not None:
            assert set(it.answers) <= set(it.choices)


def _question(item: object) -> str:
    return item.prompt[-1]["content"]  # type: ignore[attr-defined]


def _kind(item_id: str) -> str:
    return item_id.split("-")[0].rstrip("0123456789")


def _worked_out(kind: str, nums: list[int]) -> str:
    """The answer to a generated question, from its numbers."""
    a = nums[0]
    if kind == "add":
        return str(a + nums[1])
    if kind == "sub":
        return str(a - nums[1])
    if kind == "mul":
        return str(a * nums[1])
    if kind == "larger":
        return str(max(nums))
    if kind == "parity":
        return "even" if a % 2 == 0 else "odd"
    return str({"next": a + 1, "prev": a - 1, "double": 2 * a}[kind])


def test_generated_answers_are_right_and_an_echo_never_matches() -> None:
    items = read_items(SETS / "generated.jsonl")
    families = Counter(_kind(it.id) for it in items)
    assert families == {k: 200 for k in
                        ("add", "sub", "mul", "next", "prev", "double", "larger", "parity")}
    for it in items:
        q, (answer,) = _question(it), it.answers
        nums = [int(n) for n in re.findall(r"\d+", q)]
        assert answer == _worked_out(_kind(it.id), nums), it
        if it.choices is None:
            assert not is_correct(q, it.answers), it  # the question echoed is not right
            assert is_correct(f"The answer is {answer}.", it.answers)


def test_generated_halves_mix_the_families() -> None:
    """`--half 1|2` takes alternate lines: each half holds every family."""
    lines = (SETS / "generated.jsonl").read_text(encoding="utf-8").splitlines()
    for half in (lines[0::2], lines[1::2]):
        kinds = Counter(_kind(json.loads(x)["id"]) for x in half)
        assert len(kinds) == 8 and min(kinds.values()) >= 60
