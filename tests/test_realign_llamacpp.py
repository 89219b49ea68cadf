"""Realign on real llama.cpp `llama-server` recordings (tests/data/realign/llamacpp/).

The recordings and their ground truth (ids, each token's bytes, the indices the stream
sent no id for) come from record_llamacpp.py beside them, run against llama-server on
SmolLM2-135M-Instruct (the tokenizer is the GGUF itself) and, in llamacpp_demo/, on the
built-in demo model converted to GGUF (the tokenizer is the demo model's folder, so those
run wherever the repository is).
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.llamacpp import find_smollm2
from tokentrail import load_vocab
from tokentrail.realign import Realigner, realign

DATA = Path(__file__).resolve().parent / "data" / "realign" / "llamacpp"
DEMO_DATA = DATA.with_name("llamacpp_demo")
DEMO_MODEL = Path(__file__).resolve().parents[1] / "src" / "tokentrail" / "demo_model"
MANIFEST = json.loads((DATA / "MANIFEST.json").read_text("utf-8"))
RECORDINGS = {r["name"]: r for r in MANIFEST["recordings"]}
DEMO = {
    r["name"]: r for r in json.loads((DEMO_DATA / "MANIFEST.json").read_text("utf-8"))["recordings"]
}


@pytest.fixture(scope="module")
def vocab() -> Any:
    return load_vocab(find_smollm2())


def chunks(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text("utf-8").splitlines()]


def test_recordings_cover_the_cases_the_issue_names() -> None:
    recs = MANIFEST["recordings"]
    assert {r["endpoint"] for r in recs} == {"completion", "v1_completions", "v1_chat"}
    assert {r["temperature"] for r in recs} == {0.0, 1.5}
    assert any(r["dropped"] for r in recs if r["endpoint"] == "v1_chat")
    assert any(set(r["dropped"]) - {len(r["ids"]) - 1} for r in recs if r["endpoint"] == "v1_chat")


@pytest.mark.parametrize("name", sorted(RECORDINGS))
def test_real_llamacpp_recording(name: str, vocab: Any) -> None:
    check_recording(RECORDINGS[name], chunks(name), vocab)


@pytest.mark.parametrize("name", sorted(DEMO))
def test_real_llamacpp_recording_of_the_demo_model(name: str) -> None:
    lines = (DEMO_DATA / f"{name}.jsonl").read_text("utf-8").splitlines()
    check_recording(DEMO[name], [json.loads(line) for line in lines], load_vocab(DEMO_MODEL))


def check_recording(rec: dict[str, Any], stream: list[dict[str, Any]], vocab: Any) -> None:
    ids: list[int] = rec["ids"]
    result = realign(stream, vocab)

    # Text: exactly what llama.cpp streamed, which is the ids' own bytes.
    assert result.content == rec["content"]
    assert result.text == rec["content"], result.summary()

    # Each attributed token once, in stream order (a token split between segments
    # continues its byte range in the next one); its index may be None (unknown).
    order: list[tuple[int | None, int, int]] = []
    for seg in result.segments:
        for t in seg.tokens:
            if order and order[-1][1] == t.id and order[-1][2] == t.start > 0:
                order[-1] = (t.index, t.id, t.end)
            else:
                order.append((t.index, t.id, t.end))
    got = {i: tid for i, tid, _ in order if i is not None}
    sent = [i for i in range(len(ids)) if i not in set(rec["dropped"])]
    # Ids, in order: exactly those of the tokens llama.cpp sent, never a guessed one.
    assert [tid for _, tid, _ in order] == [ids[i] for i in sent], result.summary()
    assert result.tokens == len(ids) == rec["completion_tokens"]
    assert result.exact == (not rec["dropped"])
    refused = [r.index for r in result.refused]
    # A stated index is always the true one (a wrong index is worse than none).
    assert {i: ids[i] for i in got} == got, result.summary()
    if any("unknown (index null)" in w for w in result.warnings):
        # llama.cpp's OpenAI endpoints folded frames without saying how many tokens each
        # held, and neither the bytes nor usage tell it: from the first such fold on,
        # positions are unknown (index None), refusals included, and it says so.
        assert rec["endpoint"] != "completion" and rec["dropped"]
        assert None in refused
        first = next(k for k, (i, _, _) in enumerate(order) if i is None)
        assert all(i is None for i, _, _ in order[first:])
        return
    # Indices: every attributed token has its true id at its true index...
    assert {i: ids[i] for i in got} == got, result.summary()
    # ...and exactly the tokens llama.cpp sent no id for are refused, each once.
    assert sorted(i for i in refused if i is not None) == rec["dropped"], result.summary()
    assert None not in refused
    assert set(got) | set(refused) == set(range(len(ids)))
    assert not set(got) & set(refused)


def test_end_of_turn_token_left_out_of_chat_logprobs_is_reported(vocab: Any) -> None:
    """llama.cpp's chat stream has no logprobs entry for the final end-of-turn token:
    refused at its index (usage.completion_tokens counts it), not silently exact."""
    rec = RECORDINGS["llamacpp_v1_chat_cjk_t0"]
    assert rec["stop_type"] == "eos" and rec["dropped"] == [len(rec["ids"]) - 1]
    result = realign(chunks(rec["name"]), vocab)
    assert not result.exact and result.content_matches
    assert [r.index for r in result.refused] == [len(rec["ids"]) - 1]
    assert "usage.completion_tokens" in result.refused[0].reason


def test_folded_chat_frames_keep_text_and_later_indices(vocab: Any) -> None:
    """A frame folding a token that ended inside a character: the character is shown
    (no U+FFFD) and, usage settling the counts, later indices do not shift."""
    rec = RECORDINGS["llamacpp_v1_chat_mixed_t15"]
    result = realign(chunks(rec["name"]), vocab)
    assert "\ufffd" not in result.text and result.text == rec["content"]
    folded = [
        c
        for c in chunks(rec["name"])
        for ch in c.get("choices") or []
        for e in (ch.get("logprobs") or {}).get("content") or []
        if len(e["bytes"]) > len(rec["bytes"][rec["ids"].index(e["id"])])
    ]
    assert folded, "the recording has no folded frame"
    last = max(t.index for s in result.segments for t in s.tokens)
    assert rec["ids"][last] == next(
        t.id for s in result.segments for t in s.tokens if t.index == last
    )


@pytest.fixture(scope="module")
def gguf() -> Path:
    return find_smollm2()


def test_dropped_frames_without_a_count_are_still_refused(vocab: Any) -> None:
    """Without tokens_predicted, llama.cpp's folded bytes are refused with no index."""
    rec = RECORDINGS["llamacpp_completion_emoji_t0"]
    stripped = chunks(rec["name"])
    for chunk in stripped:
        chunk.pop("tokens_predicted", None)
    result = realign(stripped, vocab)
    assert result.text == result.content == rec["content"]
    assert result.lossy and not result.exact
    assert result.refused and all(r.index is None for r in result.refused)
    assert "did not say how many" in result.refused[0].reason


def test_feeding_a_real_stream_releases_only_confirmed_text(vocab: Any) -> None:
    rec = RECORDINGS["llamacpp_completion_mixed_t15"]
    r = Realigner(vocab)
    content = ""
    released = ""
    for chunk in chunks(rec["name"]):
        content += chunk.get("content", "")
        released += "".join(s.text for s in r.feed(chunk))
        assert content.startswith(released)
    released += "".join(s.text for s in r.finish())
    assert released == rec["content"]


def test_cli_on_a_real_lossy_stream_exits_3_with_one_warning(
    gguf: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from tokentrail.cli import main

    rec = RECORDINGS["llamacpp_completion_emoji_t0"]
    monkeypatch.setattr(sys, "stdin", io.StringIO((DATA / rec["file"]).read_text("utf-8")))
    rc = main(["realign", "--tokenizer", str(gguf)])
    out, err = capsys.readouterr()
    assert rc == 3
    assert err.count("\n") == 1 and err.startswith("tokentrail: warning: lossy stream")
    segs = [json.loads(line) for line in out.splitlines()]
    assert "".join(s["text"] for s in segs) == rec["content"]
    refused = sorted({r["index"] for s in segs for r in s.get("refused", [])})
    assert refused == rec["dropped"]


def test_cli_reads_a_real_whole_response(
    gguf: Path, vocab: Any, monkeypatch: pytest.MonkeyPatch, capsys: Any, tmp_path: Path
) -> None:
    """A whole (non-streamed) /completion response, pretty-printed: llama.cpp's `tokens`
    has every id, so the attribution is exact although its probabilities are folded."""
    from tokentrail.cli import main

    rec = RECORDINGS["llamacpp_completion_emoji_t0"]
    whole = {
        "content": rec["content"],
        "tokens": rec["ids"],
        "id_slot": 0,
        "stop": True,
        "tokens_predicted": len(rec["ids"]),
    }
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(whole, indent=2)))
    rc = main(["realign", "--tokenizer", str(gguf)])
    out, err = capsys.readouterr()
    segs = [json.loads(line) for line in out.splitlines()]
    assert "".join(s["text"] for s in segs) == rec["content"]
    got = {t["index"]: t["id"] for s in segs for t in s["tokens"]}
    # The last token starts a character the content (cut at the limit) does not show.
    assert all(rec["ids"][i] == tid for i, tid in got.items())
    assert len(got) >= len(rec["ids"]) - 1
    assert rc in (0, 3) and err.count("\n") <= 1
