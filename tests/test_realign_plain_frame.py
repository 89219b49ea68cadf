"""llama.cpp's usual ``/completion`` frame read directly (`llamacpp.plain_frame`).

The realigner reads a frame of llama.cpp's own shape (one token, its id in ``tokens``,
one ``completion_probabilities`` entry, a ``tokens_predicted`` count) without building
its `Frame` and `WireToken`s (issue #32: the proxy's CPU per token), and leaves every
other frame, and every frame that would take one of the general path's other turns (a
count that skips tokens, an id outside the vocabulary, content holding bytes of dropped
frames), to the general path. Nothing may change: on every real llama-server recording
in tests/data/realign, and on those frames altered in the ways the general path treats
specially (hypothesis), the events, segments, result and errors with the direct read
equal those of the general path alone (the oracle: `parse_chunk` and `_observe`).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.realign_recordings import llama_recordings as _recordings
from tests.helpers.realign_recordings import read_both_ways, realign_both_ways
from tests.helpers.realign_recordings import recording_chunks as _chunks
from tests.helpers.realign_recordings import recording_vocab as _vocab
from tokentrail.realign.dialects import llamacpp


def _run(vocab: Any, chunks: list[Any], segments: bool, direct: bool) -> tuple[Any, ...]:
    return realign_both_ways(vocab, chunks, segments, direct, "_plain_token")


@pytest.mark.parametrize("segments", [True, False], ids=["segments", "events-only"])
@pytest.mark.parametrize(
    ("folder", "rec"), _recordings(), ids=[f"{f}/{r['name']}" for f, r in _recordings()]
)
def test_the_direct_read_is_the_general_paths(
    folder: str, rec: dict[str, Any], segments: bool
) -> None:
    direct, general, taken = read_both_ways(folder, rec, segments, "_plain_token")
    assert direct == general
    if rec["endpoint"] != "completion":
        assert taken == 0  # OpenAI-shaped chunks are not llama.cpp's frames


def test_most_of_llamas_own_frames_are_read_directly() -> None:
    """It is the path llama.cpp's own endpoint takes: most of its frames (not a frame
    after dropped ones, e.g. an emoji's, nor the last one)."""
    frames = taken = 0
    for folder, rec in _recordings():
        if rec["endpoint"] == "completion":
            chunks = _chunks(folder, rec)
            (events, _, _), n = _run(_vocab(folder), chunks, True, True)
            assert len(events) == len(rec["ids"])
            frames += len(chunks)
            taken += n
    assert taken >= 0.7 * frames, (taken, frames)


_COMPLETION = [(f, r) for f, r in _recordings() if r["endpoint"] == "completion"]


def _alter(frame: dict[str, Any], how: str, k: int, size: int) -> None:
    """One change to a llama.cpp frame of the kind the general path treats specially."""
    probs = frame.get("completion_probabilities") or [{}]
    e = probs[0] if isinstance(probs[0], dict) else {}  # (an earlier change may have
    alts = e.get("top_logprobs")  # made them something else)
    alts = alts if isinstance(alts, list) and alts else [{}]
    alt = alts[k % len(alts)] if isinstance(alts[k % len(alts)], dict) else {}
    if how == "count":
        frame["tokens_predicted"] = frame.get("tokens_predicted", 1) + (k % 5) - 2
    elif how == "count-missing":
        frame.pop("tokens_predicted", None)
    elif how == "alt-id-outside":
        alt["id"] = size + k
    elif how == "alt-id-negative":
        alt["id"] = -1 - k
    elif how == "id-outside":
        e["id"] = size + k
        frame["tokens"] = [size + k]
    elif how == "tokens-other":
        frame["tokens"] = [(e.get("id", 0) + 1 + k) % size]
    elif how == "tokens-two":
        frame["tokens"] = [e.get("id", 0), e.get("id", 0)]
    elif how == "tokens-missing":
        frame.pop("tokens", None)
    elif how == "content-gap":
        frame["content"] = "xy"[k % 2] + str(frame.get("content", ""))
    elif how == "content-other":
        frame["content"] = "é" * (k % 3)
    elif how == "logprob-low":
        e["logprob"] = [-9999.0, -1e300, -math.inf, math.nan][k % 4]
    elif how == "logprob-int":
        e["logprob"] = 0
    elif how == "alt-logprob-low":
        alt["logprob"] = [-9999.0, -math.inf, math.nan][k % 3]
    elif how == "bytes-bad":
        (alt if k % 2 else e)["bytes"] = [256]
    elif how == "bytes-null":
        (alt if k % 2 else e)["bytes"] = None
    elif how == "top-none":
        e["top_logprobs"] = [None, [], "x"][k % 3]
    elif how == "top-probs":
        e["top_probs"] = e.pop("top_logprobs", [])
    elif how == "alt-nested":
        alt["top_logprobs"] = [copy.deepcopy(alt)] if k % 2 else None
    elif how == "alt-duplicate":
        alts.append(copy.deepcopy(alts[0]))
    elif how == "id-bool":
        e["id"] = True
        frame["tokens"] = [True]
    elif how == "stop":
        frame["stop"] = True
    elif how == "extension":
        frame["tokentrail"] = {"tokens": []}
    elif how == "entry-not-object":
        probs[0] = [e]
    elif how == "two-entries":
        frame["completion_probabilities"] = [e, copy.deepcopy(e)]


_HOW = st.sampled_from([
    "count", "count-missing", "alt-id-outside", "alt-id-negative", "id-outside",
    "tokens-other", "tokens-two", "tokens-missing", "content-gap", "content-other",
    "logprob-low", "logprob-int", "alt-logprob-low", "bytes-bad", "bytes-null", "top-none",
    "top-probs", "alt-nested", "alt-duplicate", "id-bool", "stop", "extension",
    "entry-not-object", "two-entries",
])  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    which=st.integers(0, len(_COMPLETION) - 1),
    changes=st.lists(st.tuples(st.integers(0, 200), _HOW, st.integers(0, 50)), max_size=3),
    segments=st.booleans(),
)
def test_altered_frames_read_as_the_general_path_reads_them(
    which: int, changes: list[tuple[int, str, int]], segments: bool
) -> None:
    folder, rec = _COMPLETION[which]
    direct, general, _ = read_both_ways(folder, rec, segments, "_plain_token", changes, _alter)
    assert direct == general


def test_plain_frame_reads_llamas_own_shape_and_nothing_else() -> None:
    frame = {
        "content": " the", "tokens": [271], "stop": False, "tokens_predicted": 3,
        "completion_probabilities": [{
            "id": 271, "token": " the", "bytes": [32, 116, 104, 101], "logprob": -0.25,
            "top_logprobs": [
                {"id": 271, "token": " the", "bytes": [32, 116, 104, 101], "logprob": -0.25},
                {"id": 264, "token": " a", "bytes": [32, 97], "logprob": -3.0},
            ],
        }],
    }  # fmt: skip
    assert llamacpp.plain_frame(frame) == (" the", 271, -0.25, [(271, -0.25), (264, -3.0)], 3)
    for how in ("stop", "tokens-two", "tokens-missing", "logprob-low", "bytes-bad", "top-probs"):
        altered = copy.deepcopy(frame)
        _alter(altered, how, 0, 1000)
        assert llamacpp.plain_frame(altered) is None, how


def test_an_id_outside_the_vocabulary_is_refused_not_a_crash() -> None:
    """(Found by the test above: the general path looked up such an id's piece to find
    bytes of dropped frames before refusing it, and raised IndexError.)"""
    folder, rec = _COMPLETION[0]
    vocab = _vocab(folder)
    chunks = _chunks(folder, rec)
    _alter(chunks[0], "id-outside", 3, vocab.size)
    (events, _, result), _ = _run(vocab, chunks, True, True)
    assert events[0].refused and events[0].logprob is None  # a stand-in spelling its text
    assert any("outside the vocabulary" in r.reason for r in result.refused)
    assert result.text == result.content == "".join(c.get("content", "") for c in chunks)
