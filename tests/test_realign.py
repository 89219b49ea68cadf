"""tokentrail.realign: exact segments rebuilt from other servers' streams.

Recorded chunk sequences (tests/data/realign, built by tests.helpers.recordings from each
project's documented wire format) are realigned and checked against the tokenizer
library's own decode and the ids that were generated; lossy ones must be reported as
lossy, with exactly the tokens the server sent no usable data for refused. The command
line is checked for its output and exit codes. (Our own server, realigned on loopback:
tests/test_realign_server.py.)
"""

from __future__ import annotations

import copy
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.realigned import attributed, span_key
from tokentrail import Aligner, Vocab, load_vocab
from tokentrail.realign import (
    Realigner,
    RealignError,
    read_chunks,
    realign,
    token_string_bytes,
)

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "realign"
MANIFEST: list[dict[str, Any]] = json.loads((DATA / "MANIFEST.json").read_text("utf-8"))
BY_NAME = {e["name"]: e for e in MANIFEST}
#: Recordings whose alternatives carry exact identities (ids, raw bytes, token_id:N).
EXACT_ALTERNATIVES = {
    "openai_chat_logprobs",
    "openai_completions_logprobs",
    "vllm_chat_tokens_as_token_ids",
    "vllm_completions_tokens_as_token_ids",
    "llamacpp_completion_stream_spm",
}


@pytest.fixture(scope="module")
def mr(corpus: Path) -> ModuleType:
    """tests.helpers.recordings: the recordings' own builder, for their ground truth."""
    from tests.helpers import recordings

    return recordings


class _Cache:
    def __init__(self, corpus: Path, mr: ModuleType) -> None:
        self.corpus = corpus
        self.mr = mr
        self.vocabs: dict[str, Vocab] = {}
        self.toks: dict[str, Any] = {}

    def vocab(self, rel: str) -> Vocab:
        if rel not in self.vocabs:
            self.vocabs[rel] = load_vocab(self.corpus / "tokenizers" / rel)
        return self.vocabs[rel]

    def tok(self, rel: str) -> Any:
        if rel not in self.toks:
            self.toks[rel] = self.mr.Tok(rel)
        return self.toks[rel]


@pytest.fixture(scope="module")
def cache(corpus: Path, mr: ModuleType) -> _Cache:
    return _Cache(corpus, mr)


def chunks_of(name: str) -> list[dict[str, Any]]:
    lines = (DATA / f"{name}.jsonl").read_text("utf-8").splitlines()
    return [json.loads(line) for line in lines]


# -- recordings --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_recording_realigns_to_the_reference_decode(name: str, cache: _Cache) -> None:
    entry = BY_NAME[name]
    ids: list[int] = entry["ids"]
    tok = cache.tok(entry["tokenizer"])
    result = realign(chunks_of(name), cache.vocab(entry["tokenizer"]))

    # Text: the streamed content, which is the tokenizer library's decode of the ids.
    reference = tok.decode(ids)
    assert result.content == entry["content"]
    assert result.text == result.content
    if name == "llamacpp_completion_stream_spm":
        # llama.cpp streams a continuation: the first piece keeps its leading space,
        # which sentencepiece's decode of the generated ids alone drops.
        assert result.content == " " + reference
    else:
        assert result.content == reference

    # Attribution: every token is attributed with its true id, or refused, never both.
    got = attributed(result)
    refused = [r.index for r in result.refused]
    assert sorted(i for i in refused if i is not None) == entry["refused"]
    assert None not in refused
    assert set(got) | set(refused) == set(range(len(ids)))
    assert not set(got) & set(refused)
    assert all(ids[i] == tid for i, tid in got.items())
    assert result.lossy == entry["lossy"]
    assert result.exact == (not entry["lossy"])
    assert result.tokens == len(ids)

    # Logprobs and alternatives travel with the tokens.
    spans = [t for s in result.segments for t in s.tokens]
    for t in spans:
        assert t.logprob == pytest.approx(cache.mr.logprob(t.index))
        if name in EXACT_ALTERNATIVES and t.top_logprobs is not None:
            expected = cache.mr.Tok.plain_alternatives(tok, t.id, t.index)
            assert [a.id for a in t.top_logprobs] == expected
            assert [a.logprob for a in t.top_logprobs] == pytest.approx(
                [cache.mr.logprob(t.index, r) for r in range(len(expected))]
            )
            assert all(a.bytes == tok.piece(a.id) for a in t.top_logprobs)


@pytest.mark.parametrize("name", sorted(n for n, e in BY_NAME.items() if not e["lossy"]))
def test_exact_recording_equals_aligning_the_true_ids(name: str, cache: _Cache) -> None:
    """Realigning a faithful stream gives the very segments aligning its ids gives."""
    entry = BY_NAME[name]
    vocab = cache.vocab(entry["tokenizer"])
    result = realign(chunks_of(name), vocab)
    direct = Aligner(vocab, skip_special_tokens=True).align(entry["ids"])
    assert span_key(result.segments) == span_key(direct)


@pytest.mark.parametrize(
    "name",
    ["openai_chat_logprobs", "vllm_completions_return_token_ids", "llamacpp_completion_stream_spm"],
)
def test_feeding_releases_only_what_the_content_confirms(name: str, cache: _Cache) -> None:
    entry = BY_NAME[name]
    r = Realigner(cache.vocab(entry["tokenizer"]))
    content = ""
    released: list[Any] = []
    for chunk in chunks_of(name):
        frame_text = _content_of(chunk)
        content += frame_text
        released.extend(r.feed(chunk))
        text = "".join(s.text for s in released)
        assert content.startswith(text)
    released.extend(r.finish())
    assert span_key(released) == span_key(realign(chunks_of(name), r.vocab).segments)
    assert r.result().segments == released


def _content_of(chunk: dict[str, Any]) -> str:
    if "choices" in chunk:
        if not chunk["choices"]:
            return ""
        ch = chunk["choices"][0]
        return (ch.get("delta") or ch.get("message") or {}).get("content") or ch.get("text") or ""
    return chunk.get("content") or ""


def test_recordings_are_reproducible(mr: ModuleType, tmp_path: Path) -> None:
    mr.build(tmp_path)
    for path in [*sorted(DATA.glob("*.jsonl")), DATA / "MANIFEST.json"]:
        assert (tmp_path / path.name).read_bytes() == path.read_bytes(), path.name


# -- lossy and inconsistent streams ------------------------------------------------------------


def _openai_entries(chunks: list[dict[str, Any]]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(stream index, logprobs entry) of an OpenAI chat recording."""
    k = 0
    for chunk in chunks:
        for ch in chunk["choices"]:
            for e in (ch.get("logprobs") or {}).get("content") or []:
                yield k, e
                k += 1


def test_a_stand_in_for_raw_bytes_refuses_exactly_that_token(cache: _Cache) -> None:
    entry = BY_NAME["openai_chat_logprobs"]
    vocab = cache.vocab(entry["tokenizer"])
    chunks = chunks_of("openai_chat_logprobs")
    partial = [k for k, e in _openai_entries(chunks) if e["token"].startswith("bytes:")]
    target = partial[0]
    for k, e in _openai_entries(chunks):
        if k == target:
            e["token"], e["bytes"] = "\ufffd", list("\ufffd".encode())
    result = realign(chunks, vocab)
    assert [r.index for r in result.refused] == [target]
    assert result.text == result.content == entry["content"]
    assert result.lossy and not result.exact
    got = attributed(result)
    assert set(got) == set(range(len(entry["ids"]))) - {target}
    assert all(entry["ids"][i] == tid for i, tid in got.items())
    # The segment holding that token's text says which token it cannot attribute.
    holder = [s for s in result.segments if getattr(s, "refused", ())]
    assert holder and all(r.index == target for s in holder for r in s.refused)


def test_a_real_replacement_character_from_a_raw_byte_server_is_kept(cache: _Cache) -> None:
    """U+FFFD bytes are believed when the server sends raw bytes and the content agrees."""
    vocab = cache.vocab("gpt2/tokenizer.json")
    tok = cache.tok("gpt2/tokenizer.json")
    ids = tok.encode("a\ufffd b 你")  # '你' splits into tokens that are not UTF-8 alone
    assert any("\ufffd".encode() == tok.piece(i) for i in ids)
    result = realign(_bytes_chunks(tok, ids), vocab)
    assert result.exact, result.summary()
    assert attributed(result) == dict(enumerate(ids))


def _deltas(tok: Any, ids: list[int]) -> list[str]:
    """Per token, the text final with it: a decode ending in U+FFFD waits (vLLM's rule),
    and the last token flushes."""
    out = []
    prev = ""
    for k in range(len(ids)):
        full = tok.decode(ids[: k + 1])
        if full.endswith("\ufffd") and k < len(ids) - 1:
            out.append("")
            continue
        out.append(full[len(prev) :])
        prev = full
    return out


def _bytes_chunks(tok: Any, ids: list[int]) -> list[dict[str, Any]]:
    """An OpenAI chat stream of `ids` whose logprobs carry each token's raw bytes."""
    chunks = []
    for tid, text in zip(ids, _deltas(tok, ids), strict=True):
        piece = tok.piece(tid)
        entry = {"token": "?", "logprob": -0.5, "bytes": list(piece), "top_logprobs": []}
        choice = {"index": 0, "delta": {"content": text}, "logprobs": {"content": [entry]}}
        chunks.append({"object": "chat.completion.chunk", "choices": [choice]})
    return chunks


def test_bytes_that_contradict_the_content_are_reported(cache: _Cache) -> None:
    entry = BY_NAME["openai_chat_logprobs"]
    chunks = chunks_of("openai_chat_logprobs")
    for k, e in _openai_entries(chunks):
        if k == 1:  # ' 🙂' claimed as ' ok'
            e["bytes"] = list(b" ok")
    result = realign(chunks, cache.vocab(entry["tokenizer"]))
    assert not result.content_matches and not result.exact
    assert "character 3" in result.summary()  # "Hi " is common to both
    assert any("differs from the streamed content" in w for w in result.warnings)


@pytest.mark.parametrize("name", ["llamacpp_completion_stream_spm", "vllm_chat_return_token_ids"])
def test_realigning_in_the_prompts_context(name: str, cache: _Cache) -> None:
    """With the prompt's ids known, the stream is realigned as its continuation: the same
    segments `Aligner(prompt_ids=...)` makes of the true ids, and the streamed text."""
    entry = BY_NAME[name]
    vocab = cache.vocab(entry["tokenizer"])
    prompt = cache.tok(entry["tokenizer"]).encode(cache.mr.PROMPT)
    result = realign(chunks_of(name), vocab, prompt_ids=prompt)
    assert result.text == result.content == entry["content"]
    direct = Aligner(vocab, skip_special_tokens=True, prompt_ids=prompt)
    expected = direct.align(entry["ids"])
    got = attributed(result)
    refused = {r.index for r in result.refused}
    assert all(entry["ids"][i] == t for i, t in got.items())
    assert set(got) | refused == set(range(len(entry["ids"])))
    if not entry["lossy"]:
        assert span_key(result.segments) == span_key(expected)


def test_a_tampered_extension_is_caught(cache: _Cache) -> None:
    entry = BY_NAME["tokentrail_extension_chat"]
    vocab = cache.vocab(entry["tokenizer"])
    chunks = chunks_of("tokentrail_extension_chat")
    assert realign(chunks, vocab).extension_agrees is True
    bad = copy.deepcopy(chunks)
    segs = [s for c in bad[5:] for s in c["tokentrail"]["segments"] if s["tokens"]]
    segs[0]["tokens"][0]["id"] += 1
    result = realign(bad, vocab)
    assert result.extension_agrees is False
    assert not result.exact
    assert any("extension disagrees" in w for w in result.warnings)


def test_text_a_server_cut_off_becomes_trailing_tokens(cache: _Cache) -> None:
    """A stop string removed from the content: the tokens that carried it are trailing."""
    entry = BY_NAME["vllm_chat_return_token_ids"]
    vocab = cache.vocab(entry["tokenizer"])
    full = entry["content"]
    cut = full.index("brûlée") + 1  # inside the token " br": it is split exactly
    chunks = chunks_of("vllm_chat_return_token_ids")
    seen = 0
    for chunk in chunks:
        for ch in chunk["choices"]:
            text = ch["delta"].get("content") or ""
            keep = max(0, min(len(text), cut - seen))
            ch["delta"]["content"] = text[:keep]
            seen += len(text)
    result = realign(chunks, vocab)
    assert result.text == result.content == full[:cut]
    assert result.exact
    direct = Aligner(vocab, skip_special_tokens=True).align(entry["ids"])
    # Kept spans + trailing spans cover every token's bytes, in order, exactly once.
    kept = [t for s in result.segments for t in s.tokens]
    merged = _merge(kept + result.trailing)
    assert merged == _merge([t for s in direct for t in s.tokens])
    br = entry["ids"].index(vocab.encode(" brûlée")[0])
    assert (result.trailing[0].index, result.trailing[0].start) == (br, 2)
    assert any("stop string" in w for w in result.warnings)


def _merge(spans: list[Any]) -> list[tuple[int, int, int, int]]:
    out: list[list[int]] = []
    for t in spans:
        if out and out[-1][0] == t.index and out[-1][3] == t.start:
            out[-1][3] = t.end
        else:
            out.append([t.index, t.id, t.start, t.end])
    return [tuple(x) for x in out]  # type: ignore[misc]


def test_special_tokens_follow_the_stream_unless_told(cache: _Cache) -> None:
    entry = BY_NAME["vllm_chat_return_token_ids"]
    vocab = cache.vocab(entry["tokenizer"])
    chunks = chunks_of("vllm_chat_return_token_ids")
    eos_chunk = next(c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason"))
    eos_chunk["choices"][0]["delta"]["content"] = "<|endoftext|>"
    result = realign(chunks, vocab)
    assert result.exact and result.text == entry["content"] + "<|endoftext|>"
    assert result.segments[-1].tokens[-1].id == entry["ids"][-1]
    # Told to skip it, the special token's text in the content is text no token made.
    forced = realign(chunks, vocab, skip_special_tokens=True)
    assert not forced.exact and forced.lossy
    assert forced.segments[-1].text == "<|endoftext|>" and not forced.segments[-1].tokens
    assert "no token data accounts for" in forced.refused[-1].reason


def test_bad_chunks_raise_errors_naming_the_field(cache: _Cache) -> None:
    vocab = cache.vocab("gpt2/tokenizer.json")
    with pytest.raises(RealignError, match="chunk 1: expected a JSON object, got list"):
        Realigner(vocab).feed([1, 2])  # type: ignore[arg-type]
    bad = {"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": ["x"]}]}
    with pytest.raises(RealignError, match=r"choices\[0\]\.token_ids must be a list of integers"):
        Realigner(vocab).feed(bad)
    with pytest.raises(RealignError, match="not a chunk of a known format"):
        Realigner(vocab).feed({"hello": 1})
    bare = {"choices": [{"index": 0, "delta": {"content": "no logprobs here"}}]}
    with pytest.raises(RealignError, match="no per-token data"):
        realign([bare], vocab)


def test_token_strings_in_openai_byte_form() -> None:
    assert token_string_bytes("bytes:\\xe4\\xbd") == b"\xe4\xbd"
    assert token_string_bytes("bytes: \\xe2\\x80") == b" \xe2\x80"
    assert token_string_bytes("bytes") == b"bytes"
    assert token_string_bytes("héllo") == "héllo".encode()


def test_sse_capture_is_read_like_json_lines() -> None:
    lines = [": keep-alive", "event: message", 'data: {"a": 1}', "", '{"b": 2}', "data: [DONE]"]
    assert list(read_chunks(lines)) == [{"a": 1}, {"b": 2}]
    with pytest.raises(RealignError, match="line 2: not JSON"):
        list(read_chunks(['{"a": 1}', "data: {nope"]))


# -- properties ----------------------------------------------------------------------------

ALPHABET = st.sampled_from([*list("ab xyz.,!\n"), "é", "你", "好", "🙂", "🦙", "🇫🇷", "…", "ß"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.lists(ALPHABET, min_size=1, max_size=30).map("".join), data=st.data())
def test_lossy_stand_ins_are_refused_exactly(cache: _Cache, text: str, data: Any) -> None:
    """A vLLM-style stream (tokens decoded alone, U+FFFD for partial bytes), chunked at
    random with lagging content: text stays exact, the stand-ins are refused."""
    tok = cache.tok("gpt2/tokenizer.json")
    vocab = cache.vocab("gpt2/tokenizer.json")
    ids = tok.encode(text)
    entries = []
    for tid in ids:
        s = tok.decode_one(tid)
        entries.append({"token": s, "logprob": -1.0, "bytes": list(s.encode())})
    # Content lags by up to a few tokens, as a server holding back text would.
    texts = [tok.decode(ids[: k + 1]).rstrip("\ufffd") for k in range(len(ids))]
    chunks = []
    shown = ""
    k = 0
    while k < len(ids):
        n = data.draw(st.integers(1, 3))
        part = entries[k : k + n]
        k += len(part)
        upto = texts[k - 1] if data.draw(st.booleans()) or k == len(ids) else shown
        if k == len(ids):
            upto = tok.decode(ids)
        delta, shown = upto[len(shown) :], upto
        choice = {"index": 0, "delta": {"content": delta}, "logprobs": {"content": part}}
        chunks.append({"object": "chat.completion.chunk", "choices": [choice]})
    result = realign(chunks, vocab)
    assert result.text == result.content == tok.decode(ids)
    stand_ins = {k for k, e in enumerate(entries) if "\ufffd" in e["token"]}
    refused = {r.index for r in result.refused}
    # Stand-ins are refused; so, rarely, is an identified token whose place between
    # unidentified ones the content cannot pin down (it is never guessed).
    assert refused >= stand_ins
    assert all("cannot be told" in r.reason for r in result.refused if r.index not in stand_ins)
    got = attributed(result)
    assert set(got) == set(range(len(ids))) - refused
    assert all(ids[i] == t for i, t in got.items())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_ids_with_raw_bytes_realign_exactly(cache: _Cache, data: Any) -> None:
    """Any ids (partial UTF-8, invalid bytes) from a server sending raw bytes: exact,
    except tokens whose own bytes are U+FFFD before the server is seen to send raw bytes."""
    tok = cache.tok("gpt2/tokenizer.json")
    vocab = cache.vocab("gpt2/tokenizer.json")
    ids = data.draw(st.lists(st.integers(0, 50255), min_size=1, max_size=25))
    result = realign(_bytes_chunks(tok, ids), vocab)
    assert result.text == result.content == tok.decode(ids)
    for r in result.refused:
        assert r.index is not None and "\ufffd".encode() in tok.piece(ids[r.index])
    got = attributed(result)
    assert set(got) | {r.index for r in result.refused} == set(range(len(ids)))
    assert all(ids[i] == t for i, t in got.items())


# -- command line ----------------------------------------------------------------------------


def _cli(args: list[str], stdin: str, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> Any:
    from tokentrail.cli import main

    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = main(["realign", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def _sse(chunks: list[dict[str, Any]]) -> str:
    return "".join(f"data: {json.dumps(c, ensure_ascii=False)}\n\n" for c in chunks) + (
        "data: [DONE]\n\n"
    )


def test_cli_realigns_a_raw_sse_capture(corpus: Path, tmp_path: Path) -> None:
    entry = BY_NAME["vllm_chat_return_token_ids"]
    capture = tmp_path / "capture.sse"
    capture.write_text(_sse(chunks_of(entry["name"])), encoding="utf-8")
    tokenizer = corpus / "tokenizers" / entry["tokenizer"]
    with capture.open("rb") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "tokentrail", "realign", "--tokenizer", str(tokenizer)],
            stdin=f,
            capture_output=True,
            timeout=300,
            cwd=REPO,
        )
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stderr == b""
    segs = [json.loads(line) for line in proc.stdout.decode("utf-8").splitlines()]
    assert "".join(s["text"] for s in segs) == entry["content"]
    ids = {t["index"]: t["id"] for s in segs for t in s["tokens"]}
    assert ids == dict(enumerate(entry["ids"]))
    assert all(
        set(t) >= {"index", "id", "start", "end", "logprob"} for s in segs for t in s["tokens"]
    )
    assert all("confidence" in s for s in segs if s["tokens"])


def test_cli_bad_input_exits_2_with_one_line(
    corpus: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, tmp_path: Path
) -> None:
    tokenizer = str(corpus / "tokenizers" / "gpt2" / "tokenizer.json")
    good = json.dumps(chunks_of("openai_chat_logprobs")[1])
    rc, _, err = _cli(["--tokenizer", tokenizer], good + "\n{oops\n", monkeypatch, capsys)
    assert rc == 2 and err.count("\n") == 1 and "line 2: not JSON" in err
    rc, out, err = _cli(["--tokenizer", str(tmp_path / "nope")], good, monkeypatch, capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and "cannot load tokenizer" in err
    rc, out, err = _cli(["--tokenizer", tokenizer], '{"x": 1}\n', monkeypatch, capsys)
    assert rc == 2 and err.count("\n") == 1 and "not a chunk of a known format" in err


@pytest.mark.parametrize(
    ("stdin", "args", "says"),
    [
        # An error body instead of a stream (issue #13): named, not an empty success.
        (
            '{"error": {"message": "model not found", "type": "invalid_request_error"}}\n',
            [],
            "the server answered an error: model not found",
        ),
        ('data: {"error": "upstream overloaded"}\n\n', [], "upstream overloaded"),
        ("", [], "is empty: no chunks"),
        ("\n\n  \n", [], "is empty: no chunks"),
        ("data: [DONE]\n", [], "is empty: no chunks"),
    ],
)
def test_cli_error_body_and_empty_input_exit_2(
    corpus: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
    stdin: str,
    args: list[str],
    says: str,
) -> None:
    tokenizer = str(corpus / "tokenizers" / "gpt2" / "tokenizer.json")
    rc, out, err = _cli(["--tokenizer", tokenizer, *args], stdin, monkeypatch, capsys)
    assert (rc, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("tokentrail: error: ") and says in err


def test_cli_choice_the_stream_lacks_exits_2(
    corpus: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    entry = BY_NAME["openai_chat_logprobs"]
    text = (DATA / entry["file"]).read_text("utf-8")
    tokenizer = str(corpus / "tokenizers" / entry["tokenizer"])
    rc, out, err = _cli(["--tokenizer", tokenizer, "--choice", "3"], text, monkeypatch, capsys)
    assert (rc, out) == (2, "")
    assert err.count("\n") == 1 and "no choice 3 (its choices: 0)" in err
    rc, out, err = _cli(["--tokenizer", tokenizer, "--choice", "0"], text, monkeypatch, capsys)
    assert (rc, err) == (0, "")
