"""`tokentrail align`: JSON lines per segment, and exit code 2 with one stderr line on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.env import corpus_path


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokentrail", *args], capture_output=True, text=True, timeout=120
    )


def test_align_ids_matches_reference_decode() -> None:
    from tokenizers import Tokenizer

    path = corpus_path("tokenizers", "gpt2", "tokenizer.json")
    tok = Tokenizer.from_file(str(path))
    ids = tok.encode("Grüße 🙂 你好!").ids
    r = run("align", "--tokenizer", str(path), "--ids", ",".join(map(str, ids)))
    assert r.returncode == 0, r.stderr
    objs = [json.loads(line) for line in r.stdout.splitlines()]
    assert "".join(o["text"] for o in objs) == tok.decode(ids, skip_special_tokens=False)
    assert set(objs[0]) == {"text", "tokens"}
    assert set(objs[0]["tokens"][0]) == {"index", "id", "start", "end"}
    indices = [t["index"] for o in objs for t in o["tokens"]]
    assert sorted(set(indices)) == list(range(len(ids))) and indices == sorted(indices)


def test_align_ids_file_marks_each_sequence(tmp_path: Path) -> None:
    import sentencepiece as spm

    path = corpus_path("tokenizers", "llama2", "tokenizer.model")
    sp = spm.SentencePieceProcessor(model_file=str(path))
    lines = [sp.encode("Hello world"), [1, *sp.encode("ไทย ٤٠٠")], sp.encode("x")]
    f = tmp_path / "ids.txt"
    f.write_text("\n".join(" ".join(map(str, ids)) for ids in lines) + "\n")
    r = run("align", "--tokenizer", str(path), "--ids-file", str(f))
    assert r.returncode == 0, r.stderr
    objs = [json.loads(line) for line in r.stdout.splitlines()]
    for n, ids in enumerate(lines):
        assert "".join(o["text"] for o in objs if o["seq"] == n) == sp.decode(ids)


def test_align_text(tmp_path: Path) -> None:
    path = corpus_path("tokenizers", "qwen2")
    r = run("align", "--tokenizer", str(path), "--text", "naïve café")
    assert r.returncode == 0, r.stderr
    assert "".join(json.loads(x)["text"] for x in r.stdout.splitlines()) == "naïve café"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--ids", "1,x,3"], "'x' is not an integer"),
        (["--ids", "1,99999999"], "token id 99999999 is outside the vocabulary"),
        (["--ids-file", "/nonexistent/ids.txt"], "cannot read --ids-file"),
    ],
)
def test_align_bad_input_exits_2_with_one_line(args: list[str], needle: str) -> None:
    path = corpus_path("tokenizers", "gpt2", "tokenizer.json")
    r = run("align", "--tokenizer", str(path), *args)
    assert r.returncode == 2
    assert r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr


def test_align_unknown_tokenizer_exits_2(tmp_path: Path) -> None:
    for bad in (tmp_path / "missing.json", tmp_path):
        r = run("align", "--tokenizer", str(bad), "--ids", "1")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
        assert "cannot load tokenizer" in r.stderr
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"\x00\xff" * 100)
    r = run("align", "--tokenizer", str(junk), "--ids", "1")
    assert r.returncode == 2 and "not a recognised tokenizer file" in r.stderr


# -- prompt context and reference -------------------------------------------------------------


def _texts(r: subprocess.CompletedProcess[str]) -> tuple[str, list[dict]]:
    assert r.returncode == 0, r.stderr
    objs = [json.loads(line) for line in r.stdout.splitlines()]
    return "".join(o["text"] for o in objs), objs


def test_align_prompt_ids_prints_only_the_continuation() -> None:
    import sentencepiece as spm

    path = corpus_path("tokenizers", "llama2", "tokenizer.model")
    sp = spm.SentencePieceProcessor(model_file=str(path))
    prompt = [1, *sp.encode("The capital of France is")]
    ids = sp.encode("The capital of France is Paris, of course")[len(prompt) - 1 :]
    r = run("align", "--tokenizer", str(path), "--prompt-ids", ",".join(map(str, prompt)),
            "--ids", " ".join(map(str, ids)))  # fmt: skip
    text, objs = _texts(r)
    assert text == sp.decode(prompt + ids)[len(sp.decode(prompt)) :] == " Paris, of course"
    indices = [t["index"] for o in objs for t in o["tokens"]]
    assert sorted(set(indices)) == list(range(len(ids)))


def test_align_prompt_text_continues_inside_a_character() -> None:
    from tokenizers import Tokenizer

    from tokentrail.generate import DEMO_MODEL

    path = DEMO_MODEL / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    ids = tok.encode("水は房総").ids
    cut = next(
        k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")
    )  # the prompt ends inside a character
    prompt_text = tok.decode(ids[:cut]).rstrip("\ufffd")
    prompt = tok.encode(prompt_text, add_special_tokens=True).ids
    assert prompt == ids[: len(prompt)]
    rest = ids[len(prompt) :]
    r = run("align", "--tokenizer", str(path), "--prompt-ids", ",".join(map(str, ids[:cut])),
            "--ids", ",".join(map(str, ids[cut:])))  # fmt: skip
    text, objs = _texts(r)
    assert text == tok.decode(ids)[len(prompt_text) :]
    assert any(t["index"] < 0 for t in objs[0]["tokens"]), "the open tail's prompt tokens"
    r = run("align", "--tokenizer", str(path), "--prompt-text", prompt_text,
            "--ids", ",".join(map(str, rest)))  # fmt: skip
    assert _texts(r)[0] == tok.decode(ids)[len(prompt_text) :]


def test_align_reference_llama_cpp_for_gguf() -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the oracle")
    import ctypes

    path = corpus_path("tokenizers", "deepseek", "ggml-vocab-deepseek-coder.gguf")
    model = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    ids = [32013, *model.tokenize(b"def f():", add_bos=False), 32000, 32001, 32014]
    buf = ctypes.create_string_buffer(256)
    pieces = b""
    for i in ids:
        n = llama_cpp.llama_token_to_piece(model._model.vocab, i, buf, 256, 0, True)
        pieces += buf.raw[:n]
    for flags in ([], ["--reference", "auto"], ["--reference", "llama.cpp"]):
        r = run("align", "--tokenizer", str(path), "--ids", ",".join(map(str, ids)), *flags)
        assert _texts(r)[0] == pieces.decode("utf-8", "replace")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--prompt-ids", "1,x", "--ids", "2"], "--prompt-ids: 'x' is not an integer"),
        (["--prompt-ids", "99999999", "--ids", "2"], "token id 99999999 is outside"),
        (["--prompt-ids", "1", "--prompt-text", "a", "--ids", "2"], "not allowed with"),
        (["--reference", "llama.cpp", "--ids", "2"], "reference='llama.cpp' does not apply"),
        (["--reference", "vllm", "--ids", "2"], "invalid choice"),
    ],
)
def test_align_prompt_and_reference_errors_exit_2(args: list[str], needle: str) -> None:
    path = corpus_path("tokenizers", "gpt2", "tokenizer.json")
    r = run("align", "--tokenizer", str(path), *args)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr
