"""A labelled question set, read and checked line by line.

One JSON object per line: ``{"id", "messages" | "prompt", "answer": str or [str, ...],
"choices": [str, ...] (optional)}`` (a JSON number in `answer` or `choices` stands for its
text: 42 is "42"). A line that is not such an object is a
`CalibrationError` naming its line number, so the CLI can answer it in one line.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import CalibrationError

__all__ = ["Item", "half", "parse_item", "read_items"]


@dataclass(frozen=True, slots=True)
class Item:
    """One labelled question: `prompt` is text or chat messages; `answers` the accepted
    answers; `choices` the options a constrained answer is picked from (None: free
    text). `line` is where it stood in its file (1-based)."""

    id: str
    prompt: str | tuple[Mapping[str, Any], ...]
    answers: tuple[str, ...]
    choices: tuple[str, ...] | None = None
    line: int = 0


def _number_text(v: Any) -> Any:
    """A JSON number as the text a reply would spell it with (42, 42.0 -> "42"; 2.5 ->
    "2.5"); anything else as it is. Arithmetic answers are naturally numbers."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return v
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return str(v) if isinstance(v, int) else repr(v)


def _strings(value: Any, what: str, line: int) -> tuple[str, ...]:
    """A non-empty list of non-empty strings (a lone string is a list of one; a JSON
    number stands for its text, `_number_text`)."""
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list) or not value:
        raise CalibrationError(f"line {line}: {what} must be a string, a number or a "
                               f"non-empty list of them, got {type(value).__name__}", line)
    value = [_number_text(v) for v in value]
    for v in value:
        if not isinstance(v, str) or not v.strip():
            raise CalibrationError(f"line {line}: {what} must hold non-empty strings or "
                                   f"numbers, got {v!r}", line)
    return tuple(value)


def _messages(value: Any, line: int) -> tuple[Mapping[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise CalibrationError(f"line {line}: messages must be a non-empty list", line)
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise CalibrationError(
                f"line {line}: each message must be {{\"role\": str, \"content\": str}}", line
            )
    return tuple(value)


def parse_item(obj: Any, line: int) -> Item:
    """Check one decoded line and make it an `Item` (errors name `line`)."""
    if not isinstance(obj, dict):
        raise CalibrationError(f"line {line}: expected a JSON object, got "
                               f"{type(obj).__name__}", line)
    qid = obj.get("id")
    if isinstance(qid, bool) or not isinstance(qid, (str, int)) or qid == "":
        raise CalibrationError(f"line {line}: id must be a non-empty string or an integer", line)
    has_messages, has_prompt = "messages" in obj, "prompt" in obj
    if has_messages == has_prompt:
        raise CalibrationError(f"line {line}: give exactly one of messages and prompt", line)
    if has_prompt:
        prompt: str | tuple[Mapping[str, Any], ...] = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise CalibrationError(f"line {line}: prompt must be a non-empty string", line)
    else:
        prompt = _messages(obj["messages"], line)
    if "answer" not in obj:
        raise CalibrationError(f"line {line}: answer is missing", line)
    answers = _strings(obj["answer"], "answer", line)
    choices = None
    if obj.get("choices") is not None:
        choices = _strings(obj["choices"], "choices", line)
        if len(set(choices)) != len(choices) or len(choices) < 2:
            raise CalibrationError(f"line {line}: choices must be at least two distinct "
                                   "strings", line)
        if not set(answers) & set(choices):
            raise CalibrationError(f"line {line}: no accepted answer is among the choices", line)
    return Item(str(qid), prompt, answers, choices, line)


def read_items(path: str | os.PathLike[str], limit: int | None = None) -> list[Item]:
    """The items of JSON Lines file `path` (blank lines skipped), at most `limit`.

    Every line is checked, even past `limit`, so that a bad file fails before a model
    runs; a repeated id is an error too (items.jsonl and `--resume` key on it). A UTF-8
    byte order mark at the start (what Windows editors and spreadsheet exports write) is
    read past; CRLF line ends are whitespace to JSON.
    """
    items: list[Item] = []
    seen: dict[str, int] = {}
    try:
        with open(path, encoding="utf-8-sig") as f:
            for n, text in enumerate(f, 1):
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    raise CalibrationError(f"line {n}: not JSON: {e.msg}", n) from None
                item = parse_item(obj, n)
                if item.id in seen:
                    raise CalibrationError(
                        f"line {n}: id {item.id!r} repeats line {seen[item.id]}", n
                    )
                seen[item.id] = n
                items.append(item)
    except OSError as e:
        raise CalibrationError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise CalibrationError(f"{path} is not UTF-8 text: {e.reason}") from None
    if not items:
        raise CalibrationError(f"{path} holds no questions")
    return items if limit is None else items[:limit]


def half(items: Sequence[Item], which: int) -> list[Item]:
    """Half `which` (1 or 2) of `items`: the 1st, 3rd, 5th... or the 2nd, 4th... item.
    Alternate items, so that a file grouped by topic splits into two alike halves."""
    if which not in (1, 2):
        raise CalibrationError(f"half must be 1 or 2, got {which}")
    return list(items[which - 1 :: 2])
