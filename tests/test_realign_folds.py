"""Realign never states a wrong position: llama.cpp `/v1` streams that fold tokens.

llama.cpp's OpenAI endpoints send no entry for a token that ends inside a character (or
inside a possible stop string) and fold its bytes into the next entry, without saying
how many tokens they were. The realigner settles each fold's count from its bytes and
``usage.completion_tokens`` when only one count fits; otherwise the positions from there
on are unknown (index None), never shifted. Recordings: ``tests/data/realign/llamacpp``
(record_llamacpp.py) and ``tests/data/realign/llamacpp_folds`` (`record_llamacpp.py --folds`), real
llama-server streams on SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tokentrail import load_vocab
from tokentrail.realign import realign
from tokentrail.realign.counts import settle, spellings
from tokentrail.realign.vocabmap import reverse

DATA = Path(__file__).resolve().parent / "data" / "realign"
DEMO = Path(__file__).resolve().parents[1] / "src" / "tokentrail" / "demo_model"


def manifest(sub: str) -> list[dict[str, Any]]:
    return json.loads((DATA / sub / "MANIFEST.json").read_text("utf-8"))["recordings"]


def chunks(sub: str, rec: dict[str, Any]) -> list[Any]:
    return [json.loads(line) for line in (DATA / sub / rec["file"]).read_text("utf-8").splitlines()]


@pytest.fixture(scope="module")
def smol() -> Any:
    path = Path(os.environ.get("TOKENTRAIL_SMOLLM2_GGUF", Path.home() / ".cache" / "tokentrail"
                               / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))  # fmt: skip
    if not path.is_file():
        pytest.skip(f"the SmolLM2 GGUF is not at {path} (set TOKENTRAIL_SMOLLM2_GGUF; "
                    "python -m tokentrail.models fetch smollm2)")  # fmt: skip
    pytest.importorskip("gguf", reason="reading a GGUF vocabulary needs gguf (pip install gguf)")
    return load_vocab(path)


def stated(result: Any) -> list[tuple[int | None, int]]:
    return [(t.index, t.id) for s in result.segments for t in s.tokens]


# -- the counts, on their own -------------------------------------------------------------------


def test_a_count_is_settled_only_when_one_fits() -> None:
    one, some = frozenset({1}), frozenset({1, 2})
    assert settle([one, one], None) == [1, 1]  # one byte each: one token each
    assert settle([some, one], None) == [None, None]  # no total: cannot tell
    assert settle([some, one], 3) == [2, 1]  # usage: 3 missing, so the first held 2
    assert settle([some, some], 3) == [None, None]  # 1+2 or 2+1
    assert settle([one, some], 3) == [1, 2]
    # llama.cpp's chat streams leave out the end token: 0 or 1 more after the last entry.
    assert settle([some], 2, frozenset({0, 1})) == [None]
    assert settle([one], 2, frozenset({0, 1})) == [1]


def test_spellings_count_tokens_of_the_vocabulary() -> None:
    rev = reverse(load_vocab(DEMO))
    assert 1 in spellings(b" the", rev) and 4 in spellings(b" the", rev)
    assert spellings(b"\xe4", rev) == {1}  # one byte: one byte token
    assert spellings(b"", rev) == {0}
    # Cut short by a stop string: the last token may run on past the bytes.
    assert 1 in spellings(b" th", rev, open_end=True)


# -- real llama-server recordings ----------------------------------------------------------------


@pytest.mark.parametrize("sub", ["llamacpp", "llamacpp_folds"])
def test_no_recording_states_a_wrong_position(sub: str, smol: Any) -> None:
    unknown = settled = 0
    for rec in manifest(sub):
        if rec["endpoint"] == "completion":
            continue
        result = realign(chunks(sub, rec), smol)
        ids = rec["ids"]
        assert result.text == result.content == rec["content"], rec["name"]
        for index, tid in stated(result) + [(t.index, t.id) for t in result.trailing]:
            if index is None:
                unknown += 1
            else:
                assert ids[index] == tid, (rec["name"], index, tid)
        refused = [r.index for r in result.refused]
        assert all(i is None or 0 <= i < len(ids) for i in refused)
        folds = any(len(e.get("bytes") or ()) > len(rec["bytes"][ids.index(e["id"])])
                    for c in chunks(sub, rec) for ch in c.get("choices") or []
                    for e in (ch.get("logprobs") or {}).get("content") or [])  # fmt: skip
        if folds and None not in refused:
            settled += 1
    if sub == "llamacpp":  # (the stop fold of llamacpp_folds has bytes no longer than its id's)
        assert settled >= 1, "some recording folds and has every position settled"
    assert unknown >= 1, "some recording folds in a way nothing can settle"


def test_stop_string_fold_puts_the_straddler_at_its_index(smol: Any) -> None:
    """llama.cpp gives the straddling token no entry and puts its shown text on the entry
    of the token inside the stop string: the straddler is refused at its true index, the
    stop token is cut off (trailing) at its own."""
    rec = next(r for r in manifest("llamacpp_folds") if r["name"].endswith("_stop"))
    ids = rec["ids"]
    result = realign(chunks("llamacpp_folds", rec), smol)
    assert result.content_matches and result.text == rec["content"]
    assert stated(result) == [(i, ids[i]) for i in range(len(ids) - 2)]
    assert [r.index for r in result.refused] == [len(ids) - 2]
    assert [(t.index, t.id) for t in result.trailing] == [(len(ids) - 1, ids[-1])]
    assert not result.exact  # the straddler's id is not known, and it says so


def test_without_usage_positions_after_an_unsettled_fold_are_unknown(smol: Any) -> None:
    rec = next(r for r in manifest("llamacpp_folds") if r["name"].endswith("_nousage"))
    assert rec["completion_tokens"] is None
    ids = rec["ids"]
    result = realign(chunks("llamacpp_folds", rec), smol)
    assert result.text == rec["content"]
    tokens = stated(result)
    first = next(k for k, (i, _) in enumerate(tokens) if i is None)
    assert all(i is None for i, _ in tokens[first:])
    assert [tid for i, tid in tokens[:first]] == ids[:first]
    assert any("unknown (index null)" in w for w in result.warnings)
    segs = [s.to_dict() for s in result.segments]
    unknown = [s for s in segs if any(t["index"] is None for t in s["tokens"])]
    assert unknown and all("position_unknown" in s for s in unknown)
