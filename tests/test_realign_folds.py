"""Realign never states a wrong position: llama.cpp `/v1` streams that fold tokens.

llama.cpp's OpenAI endpoints send no entry for a token that ends inside a character (or
inside a possible stop string) and fold its bytes into the next entry, without saying
how many tokens they were; their chat streams also list no entry for a token that adds
no text (the end-of-turn token; a special token sampled mid-stream). A position is
stated only when every reading of the entries' bytes and the counts the stream sent
(``usage``, ``timings.predicted_n``, mid-stream or at the end) agrees on it; otherwise it
is unknown (index None), never shifted, and a later count can fix positions again.
Recordings: ``tests/data/realign/llamacpp`` (record_llamacpp.py) and
``tests/data/realign/llamacpp_folds`` (`record_llamacpp.py --folds`), real llama-server
streams on SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokentrail import load_vocab
from tokentrail.realign import realign
from tokentrail.realign.counts import solve, spellings
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


def test_a_count_is_stated_only_when_every_reading_agrees() -> None:
    one, some = frozenset({1}), frozenset({1, 2})

    def counts(options, missing, tail=frozenset({0})):  # type: ignore[no-untyped-def]
        return solve(options, [None] * (len(options) + 1), missing, tail)[1]

    assert counts([one, one], None) == [1, 1]  # one byte each: one token each
    assert counts([some, one], None) == [None, 1]  # no total: the first cannot be told
    assert counts([some, one], 3) == [2, 1]  # usage: 3 missing, so the first held 2
    assert counts([some, some], 3) == [None, None]  # 1+2 or 2+1
    assert counts([one, some], 3) == [1, 2]
    # llama.cpp's chat streams leave out the end token: 0 or 1 more after the last entry.
    assert counts([some], 2, frozenset({0, 1})) == [None]
    assert counts([one], 2, frozenset({0, 1})) == [1]


def test_sums_come_back_when_a_count_pins_them() -> None:
    some = frozenset({1, 2})
    # 1+2 or 2+1: neither count is known, but after both folds 3 tokens were held.
    sums, counts, ok = solve([some, some], [None, None, None], 3, frozenset({0}))
    assert ok and sums == [None, 3] and counts == [None, None]
    # A count sent mid-stream (after fold 1) pins the sum there, and so fold 0's count.
    sums, counts, ok = solve([some, some, some], [None, None, 4, None], None)
    assert ok and sums == [2, 4, None] and counts == [2, 2, None]
    # A fold of any count (None) is fixed by the total alone.
    assert solve([None], [None, None], 5) == ([5], [5], True)
    # Counts no reading fits: nothing is stated.
    assert solve([frozenset({1})], [None, None], 5, frozenset({0})) == ([None], [None], False)


@given(
    options=st.lists(
        st.none() | st.frozensets(st.integers(0, 3), min_size=1, max_size=3), max_size=4
    ),
    data=st.data(),
)
@settings(max_examples=300, deadline=None)
def test_solve_states_what_every_reading_agrees_on(options: Any, data: st.DataObject) -> None:
    """Against brute force: every assignment of counts (a fold of any count: 0..12)
    that fits the pins, the total and the tail; a sum or count is stated exactly when
    all of them agree on it."""
    import itertools

    m = len(options)
    pins = data.draw(st.lists(st.none() | st.integers(0, 8), min_size=m + 1, max_size=m + 1))
    pins[0] = data.draw(st.sampled_from([None, 0]))
    missing = data.draw(st.none() | st.integers(0, 12))
    tail = data.draw(st.frozensets(st.integers(0, 2), min_size=1))
    ranges = [range(13) if o is None else sorted(o) for o in options]
    fits = []
    for counts in itertools.product(*ranges):
        sums = list(itertools.accumulate(counts, initial=0))
        if any(p is not None and p != s for p, s in zip(pins, sums, strict=True)):
            continue
        if missing is not None and missing - sums[-1] not in tail:
            continue
        fits.append((sums[1:], counts))
    sums, counts, ok = solve(options, pins, missing, tail)
    assert ok == bool(fits)
    if not fits:
        return
    for k in range(m):
        seen_sums = {f[0][k] for f in fits}
        seen_counts = {f[1][k] for f in fits}
        if sums[k] is not None:
            assert seen_sums == {sums[k]}
        elif missing is not None or None not in options[: k + 1]:
            # (with no total, a fold of any count is unbounded: brute force stops at 12)
            assert len(seen_sums) > 1
        if counts[k] is not None:
            assert seen_counts == {counts[k]}
        elif missing is not None and options[k] is not None:
            assert len(seen_counts) > 1


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
    assert settled >= 1, "some recording folds and has every position settled"
    if sub == "llamacpp":  # emoji folds whose counts no total decides (0 or 1 end token)
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


def test_without_counts_positions_after_an_unsettled_fold_are_unknown(smol: Any) -> None:
    rec = next(r for r in manifest("llamacpp_folds") if r["name"].endswith("_nousage"))
    assert rec["completion_tokens"] is None
    ids = rec["ids"]
    # As sent, the last chunk's timings.predicted_n counts the tokens: all are known.
    result = realign(chunks("llamacpp_folds", rec), smol)
    assert stated(result) == [(i, ids[i]) for i, _ in stated(result)]
    assert None not in [i for i, _ in stated(result)]
    # Without it, nothing tells how many tokens the emoji folds held.
    bare = [{k: v for k, v in c.items() if k != "timings"} for c in chunks("llamacpp_folds", rec)]
    result = realign(bare, smol)
    assert result.text == rec["content"]
    tokens = stated(result)
    first = next(k for k, (i, _) in enumerate(tokens) if i is None)
    assert all(i is None for i, _ in tokens[first:])
    assert [tid for i, tid in tokens[:first]] == ids[:first]
    assert any("unknown (index null)" in w for w in result.warnings)
    segs = [s.to_dict() for s in result.segments]
    unknown = [s for s in segs if any(t["index"] is None for t in s["tokens"])]
    assert unknown and all("position_unknown" in s for s in unknown)


def test_a_count_that_shows_an_unlisted_token_unsettles_the_chat_positions(smol: Any) -> None:
    """A chat stream whose usage counts one token more than its entries and end token
    (a special token sampled mid-stream, with no entry): where it was cannot be told,
    so no position is stated rather than every later one one too low."""
    rec = next(r for r in manifest("llamacpp") if r["name"] == "llamacpp_v1_chat_cjk_t15")
    ids, stream = rec["ids"], chunks("llamacpp", rec)
    result = realign(stream, smol)  # as recorded: 40 entries, 40 counted, a length stop
    assert stated(result) == [(i, ids[i]) for i in range(len(ids))]
    more = [dict(c, usage=dict(c["usage"], completion_tokens=len(ids) + 1)) if "usage" in c
            else c for c in stream]  # fmt: skip
    result = realign(more, smol)
    assert result.text == rec["content"]
    assert [i for i, _ in stated(result)] == [None] * len(ids)
    assert any("contradict" in w or "unknown" in w for w in result.warnings)


# -- folds at random places, several in a row ---------------------------------------------------
#
# A real llama-server stream, folded further the way llama.cpp folds: an entry's chunk
# is dropped and its content and bytes go onto the next entry (whose id stays its own),
# with nothing saying how many tokens the entry now stands for. Counts can be sent along
# (`usage` mid-stream, as vLLM's continuous usage stats, or llama.cpp's per-token
# `timings.predicted_n`) and at the end. Every stated position must be the true one.


def _entry(chunk: dict[str, Any]) -> dict[str, Any] | None:
    for ch in chunk.get("choices") or []:
        content = (ch.get("logprobs") or {}).get("content") or []
        if content:
            assert len(content) == 1  # llama.cpp sends one entry per chunk
            return content[0]
    return None


def _true_indices(rec: dict[str, Any], stream: list[dict[str, Any]]) -> list[int]:
    """Each entry's true position: the token whose id it carries, after the tokens whose
    bytes it folded in (from the recording's ids and their bytes)."""
    out, p = [], 0
    for c in stream:
        e = _entry(c)
        if e is None:
            continue
        acc = b""
        for q in range(p, len(rec["ids"])):
            acc += bytes(rec["bytes"][q])
            if rec["ids"][q] == e["id"] and acc == bytes(e["bytes"]):
                out.append(q)
                p = q + 1
                break
        else:
            raise AssertionError(f"{rec['name']}: entry {e['id']} fits no tokens after {p}")
    return out


def _fold(chunks: list[dict[str, Any]], into: dict[str, Any]) -> dict[str, Any]:
    """`chunks` folded onto `into` (the next entry's chunk), as llama.cpp sends it."""
    out = json.loads(json.dumps(into))
    ch = out["choices"][0]
    e = ch["logprobs"]["content"][0]
    raw = b"".join(bytes(_entry(c)["bytes"]) for c in chunks) + bytes(e["bytes"])  # type: ignore[index]
    e["bytes"] = list(raw)
    e["token"] = raw.decode("utf-8", "replace")
    chat = "delta" in ch
    field = "content" if chat else "text"

    def body(c: dict[str, Any]) -> dict[str, Any]:
        return c["choices"][0]["delta"] if chat else c["choices"][0]

    texts = [body(c).get(field) or "" for c in chunks]
    body(out)[field] = "".join(texts) + (body(out).get(field) or "")
    return out


V1 = [r for r in manifest("llamacpp") if r["endpoint"] in ("v1_chat", "v1_completions")]


@given(data=st.data())
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_random_folds_never_state_a_wrong_position(smol: Any, data: st.DataObject) -> None:
    rec = data.draw(st.sampled_from(V1), label="recording")
    stream = chunks("llamacpp", rec)
    truth = _true_indices(rec, stream)
    at = [k for k, c in enumerate(stream) if _entry(c) is not None]
    # Which entries fold into the next one: runs of several, anywhere but the last.
    folded = data.draw(st.sets(st.integers(0, len(at) - 2), max_size=len(at) // 2), label="fold")
    pins = data.draw(st.sets(st.integers(0, len(at) - 1), max_size=3), label="counts") - folded
    how = data.draw(st.sampled_from(["usage", "timings"]), label="count as")
    keep_usage = data.draw(st.booleans(), label="usage at the end")
    chat = rec["endpoint"] == "v1_chat"
    # A chat stream lists no entry for a token that adds no text (a special token
    # sampled mid-stream): the entries after it sit one further on, the counts grow.
    extra = data.draw(st.lists(st.integers(0, len(at) - 1), max_size=2), label="unlisted")
    if not chat or not (keep_usage or pins):
        extra = []  # (with no count at all nothing on the wire can show one: a known limit)
    truth = [t + sum(1 for e in extra if e <= j) for j, t in enumerate(truth)]
    out: list[dict[str, Any]] = []
    held: list[dict[str, Any]] = []
    kept: list[int] = []  # true index of each entry sent
    pinned_after: list[int] = []  # positions in `kept` of entries that carry a count
    n = 0
    for c in stream:
        if _entry(c) is None:
            if "usage" in c and not keep_usage:
                continue
            if "usage" in c and extra:
                c = json.loads(json.dumps(c))
                c["usage"]["completion_tokens"] += len(extra)
            out.append(c)
            continue
        j, n = n, n + 1
        if j in folded:
            held.append(c)
            continue
        c = _fold(held, c) if held else json.loads(json.dumps(c))
        held = []
        if j in pins:
            count = truth[j] + 1
            if how == "usage":
                c["usage"] = {"completion_tokens": count}
            else:
                c["timings"] = {"predicted_n": count}
            pinned_after.append(len(kept))
        kept.append(truth[j])
        out.append(c)
    result = realign(out, smol)
    assert result.text == result.content
    firsts = [t for s in result.segments for t in s.tokens if t.start == 0 or t.end == 0]
    got = [t.index for t in firsts] + [t.index for t in result.trailing if t.start == 0]
    assert len(got) == len(kept), (got, kept)
    for stated, true in zip(got, kept, strict=True):
        assert stated is None or stated == true, (rec["name"], got, kept)
    refused = [r.index for r in result.refused if r.index is not None]
    assert all(0 <= i < len(rec["ids"]) + len(extra) and i not in kept for i in refused)
    # Positions come back: the entry a count came with is stated, and on a stream that
    # lists every token it does not fold (completions), so is every entry after the
    # last fold before it.
    folds_at = [i for i in range(len(kept)) if kept[i] > (kept[i - 1] + 1 if i else 0)]
    for p in pinned_after:
        last_fold = p if chat else max((f for f in folds_at if f <= p), default=0)
        for i in range(last_fold, p + 1):
            assert got[i] == kept[i], (rec["name"], i, got, kept)
