"""Every script in examples/ runs, and what it prints is checked against a reference.

The references are the tokenizer's own library (`tokenizers` decoding the ids an
example reports), tokentrail's library API for the same request, or the recording's
manifest (tests/data/realign/MANIFEST.json).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.env import REPO, corpus_path, require

EXAMPLES = REPO / "examples"
DEMO = REPO / "src" / "tokentrail" / "demo_model"


def run(script: str, *args: str, stdin: str | None = None, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True,
                       text=True, timeout=300, input=stdin, env=env)
    assert r.returncode == 0, r.stderr
    return r


def demo_decode(ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(DEMO / "tokenizer.json")).decode(ids, skip_special_tokens=False)


def test_every_example_is_tested() -> None:
    tested = {"chat_confidence.py", "mlx_lm_dropin.py", "realign_vllm_stream.py",
              "openai_client.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_chat_confidence_keeps_the_conversation() -> None:
    require("mlx_lm")
    import tokentrail

    questions = ["What is a list?", "Translate water into French."]
    r = run("chat_confidence.py", "--max-tokens", "60", stdin="\n".join(questions) + "\n\n")
    replies = [line.removeprefix("model> ") for line in r.stdout.splitlines()
               if line.startswith("model> ")]
    assert len(replies) == 2
    # The reference: the library, given the same conversation (history included).
    model, tokenizer = tokentrail.load()
    messages: list[dict[str, str]] = []
    for question, shown in zip(questions, replies, strict=True):
        messages.append({"role": "user", "content": question})
        text = "".join(r.text for r in tokentrail.stream_generate(
            model, tokenizer, messages, max_tokens=60, top_logprobs=3))
        # Unsure pieces are shown as «text|p»; without the marks it is the reply itself.
        plain = re.sub(r"«(.*?)\|\d\.\d\d»", r"\1", shown, flags=re.DOTALL)
        assert plain == text.split("\n")[0]
        assert "«" in shown  # the demo model is unsure of something in each reply
        messages.append({"role": "assistant", "content": text})
    assert r.stdout.count("least sure:") == 2


def token_ids(spans: list[list[int]] | list[tuple[int, ...]]) -> list[int]:
    """The ids of (index, id, ...) spans in index order, each token once, checking that
    the indices count 0, 1, 2, ... (a token split over two pieces is listed in both)."""
    by_index: dict[int, int] = {}
    for index, token_id, *_ in spans:
        assert by_index.setdefault(index, token_id) == token_id
    assert sorted(by_index) == list(range(len(by_index)))
    return [by_index[i] for i in range(len(by_index))]


def test_mlx_lm_dropin_pieces_are_exact_and_carry_their_tokens() -> None:
    require("mlx_lm")
    r = run("mlx_lm_dropin.py")
    lines = r.stdout.splitlines()
    assert lines[0].startswith("1.") and lines[2].startswith("2.")
    whole = ast.literal_eval(lines[1])  # mlx_lm.stream_generate's text, printed as a repr
    pieces, spans = [], []
    for line in lines[3:]:
        text_repr, _, span_list = line.partition(" [(")
        pieces.append(ast.literal_eval(text_repr.strip()))
        spans += ast.literal_eval("[(" + span_list)
    assert len(pieces) >= 10
    assert "".join(pieces) == whole == demo_decode(token_ids(spans))


def test_realign_vllm_stream_matches_the_recording() -> None:
    tokenizer = corpus_path("tokenizers", "gpt-neox", "20B_tokenizer.json")
    manifest = json.loads((REPO / "tests" / "data" / "realign" / "MANIFEST.json").read_text())
    entry = next(e for e in manifest if e["name"] == "vllm_chat_return_token_ids")
    r = run("realign_vllm_stream.py",
            str(REPO / "tests" / "data" / "realign" / entry["file"]), str(tokenizer))
    *segment_lines, summary = r.stdout.splitlines()
    segments = [json.loads(line) for line in segment_lines]
    assert "".join(s["text"] for s in segments) == entry["content"]
    ids = token_ids([t for s in segments for t in s["tokens"]])
    assert ids[: len(entry["ids"])] == entry["ids"]  # then the end-of-sequence token
    from tokenizers import Tokenizer

    decoded = Tokenizer.from_file(str(tokenizer)).decode(ids, skip_special_tokens=True)
    assert decoded == entry["content"]
    assert summary == f"exact: {len(ids)} tokens from vllm-token-ids"


def test_openai_client_against_serve() -> None:
    require("mlx_lm")
    require("uvicorn")
    require("openai")
    r = run("openai_client.py")
    *segment_lines, content_line = r.stdout.splitlines()
    content = json.loads(content_line.removeprefix("content: "))
    segments = [json.loads(line) for line in segment_lines]
    assert content and "".join(s["text"] for s in segments) == content
    ids = token_ids([t for s in segments for t in s["tokens"]])
    # The ids behind the text decode, by the tokenizer's own library, to that text; the
    # last is the end-of-sequence token (<|endoftext|> 0 or <|im_end|> 2), without text.
    assert ids[-1] in (0, 2)
    assert demo_decode(ids[:-1]) == content


@pytest.mark.parametrize("script", ["realign_vllm_stream.py"])
def test_missing_tokenizer_is_one_clear_line(script: str, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(EXAMPLES / script), "x.jsonl",
                        str(tmp_path / "none.json")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "tokenizer not found" in r.stderr
