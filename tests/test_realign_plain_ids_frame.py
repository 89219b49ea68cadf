"""vLLM's usual ``/v1/completions`` frame read directly (`vllm.plain_frame`).

A vLLM upstream answers the proxy's requests (``return_token_ids``,
``return_tokens_as_token_ids``, ``logprobs``) with one frame per token: one choice, its
``text``, ``token_ids`` of one id, and logprobs whose alternatives are ``token_id:N``
strings. The realigner reads that frame without building its `Frame` and `WireToken`s
(issue #32: the proxy's CPU per token in front of a GPU-rate upstream), and leaves every
other frame, and every frame that would take another turn of the general path (an id
outside the vocabulary, an alternative named by its text or left out, a count, a finish,
an extension), to the general path. Nothing may change: on every real vLLM recording (the
demo model's, tests/data/realign/vllm_demo, recorded as the proxy asks), on the
hand-made vLLM recordings of tests/data/realign (two tokens a frame, token strings), and
on those frames altered in the ways the general path treats specially (hypothesis), the
events, segments, result and errors with the direct read equal those of the general
path alone (the oracle: `parse_chunk` and `_observe`).
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.env import corpus_path
from tests.helpers.realign_recordings import (
    DATA,
    read_both_ways,
    realign_both_ways,
    vllm_recordings,
)
from tokentrail import load_vocab
from tokentrail.realign.dialects import vllm

_RECORDINGS = vllm_recordings()


def _run(vocab: Any, chunks: list[Any], segments: bool, direct: bool) -> tuple[Any, ...]:
    return realign_both_ways(vocab, chunks, segments, direct, "_plain_ids_token")


@pytest.mark.parametrize("segments", [True, False], ids=["segments", "events-only"])
@pytest.mark.parametrize(
    ("folder", "rec"), _RECORDINGS, ids=[f"{f}/{r['name']}" for f, r in _RECORDINGS]
)
def test_the_direct_read_is_the_general_paths(
    folder: str, rec: dict[str, Any], segments: bool
) -> None:
    direct, general, taken = read_both_ways(folder, rec, segments, "_plain_ids_token")
    assert direct == general
    events = direct[0]
    assert [e.id for e in events] == rec["ids"]  # vLLM's own ids, its ground truth
    # Every token's frame but the last (it carries the finish) is read directly.
    assert taken == len(rec["ids"]) - 1


@pytest.mark.parametrize("segments", [True, False], ids=["segments", "events-only"])
@pytest.mark.parametrize(
    "name", ["vllm_completions_return_token_ids", "vllm_completions_tokens_as_token_ids"]
)
def test_the_hand_made_vllm_recordings_read_as_before(name: str, segments: bool) -> None:
    """Frames of two tokens, and alternatives named by their text: the general path's."""
    manifest = {e["name"]: e for e in json.loads((DATA / "MANIFEST.json").read_text("utf-8"))}
    entry = manifest[name]
    vocab = load_vocab(str(corpus_path("tokenizers", entry["tokenizer"])))
    lines = (DATA / entry["file"]).read_text("utf-8").splitlines()
    chunks = [json.loads(line) for line in lines if line.strip()]
    direct, _ = _run(vocab, chunks, segments, True)
    general, _ = _run(vocab, chunks, segments, False)
    assert direct == general
    assert [e.id for e in direct[0]] == entry["ids"]


def _alter(frame: dict[str, Any], how: str, k: int, size: int) -> None:
    """One change to a vLLM frame of the kind the general path treats specially."""
    choices = frame.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    ch = first if isinstance(first, dict) else {}
    lps = ch.get("logprobs") if isinstance(ch.get("logprobs"), dict) else {}
    tops = lps.get("top_logprobs")
    top = tops[0] if isinstance(tops, list) and tops and isinstance(tops[0], dict) else {}
    names = list(top)
    name = names[k % len(names)] if names else "token_id:0"
    if how == "id-outside":
        ch["token_ids"] = [size + k]
    elif how == "id-negative":
        ch["token_ids"] = [-1 - k]
    elif how == "id-bool":
        ch["token_ids"] = [True]
    elif how == "ids-two":
        ch["token_ids"] = [k % size, (k + 1) % size]
    elif how == "ids-missing":
        ch.pop("token_ids", None)
    elif how == "ids-not-list":
        ch["token_ids"] = [None, "x", 7][k % 3]
    elif how == "alt-outside":
        top[f"token_id:{size + k}"] = top.pop(name, -1.0)
    elif how == "alt-named-by-text":
        top[[" the", "é", "\ufffd", "bytes:\\xe2"][k % 4]] = top.pop(name, -1.0)
    elif how == "alt-bad-id":
        top[["token_id:x", "token_id:", "token_id:-3", "token_id: 5"][k % 4]] = top.pop(name, -1.0)
    elif how == "alt-same-id":
        top["token_id:0" + name.removeprefix("token_id:")] = -20.0 - k
    elif how == "alt-logprob-low":
        top[name] = [-9999.0, -1e300, -math.inf, math.nan, None][k % 5]
    elif how == "alt-logprob-int":
        top[name] = [0, True, "1"][k % 3]
    elif how == "logprob-low":
        lps["token_logprobs"] = [[-9999.0, -math.inf, math.nan, None][k % 4]]
    elif how == "logprob-int":
        lps["token_logprobs"] = [[0, False, "x"][k % 3]]
    elif how == "logprobs-null":
        ch["logprobs"] = None
    elif how == "logprobs-not-object":
        ch["logprobs"] = [lps]
    elif how == "logprobs-content":
        lps["content"] = []
    elif how == "tokens-two":
        lps["tokens"] = ["a", "b"]
    elif how == "tokens-missing":
        lps.pop(["tokens", "token_logprobs", "top_logprobs"][k % 3], None)
    elif how == "top-empty":
        lps["top_logprobs"] = [[{}], [None], [], None][k % 4]
    elif how == "finish":
        ch["finish_reason"] = ["stop", "length", 5][k % 3]
    elif how == "usage":
        frame["usage"] = [{"completion_tokens": k}, {"prompt_tokens": 3}, 7][k % 3]
    elif how == "timings":
        frame["timings"] = {"predicted_n": k}
    elif how == "index-other":
        ch["index"] = 1 + k % 2
    elif how == "two-choices":
        frame["choices"] = [ch, {**copy.deepcopy(ch), "index": 1}]
    elif how == "text-other":
        ch["text"] = [None, 5, "", "xé"][k % 4]
    elif how == "delta":
        ch["delta"] = {"content": ch.get("text")}
    elif how == "extension":
        frame["tokentrail"] = {"tokens": []}
    elif how == "choices-odd":
        frame["choices"] = [[], [None], "x", {}][k % 4]


_HOW = st.sampled_from([
    "id-outside", "id-negative", "id-bool", "ids-two", "ids-missing", "ids-not-list",
    "alt-outside", "alt-named-by-text", "alt-bad-id", "alt-same-id", "alt-logprob-low",
    "alt-logprob-int", "logprob-low", "logprob-int", "logprobs-null", "logprobs-not-object",
    "logprobs-content", "tokens-two", "tokens-missing", "top-empty", "finish", "usage",
    "timings", "index-other", "two-choices", "text-other", "delta", "extension", "choices-odd",
])  # fmt: skip


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    which=st.integers(0, len(_RECORDINGS) - 1),
    changes=st.lists(st.tuples(st.integers(0, 200), _HOW, st.integers(0, 50)), max_size=3),
    segments=st.booleans(),
)
def test_altered_frames_read_as_the_general_path_reads_them(
    which: int, changes: list[tuple[int, str, int]], segments: bool
) -> None:
    folder, rec = _RECORDINGS[which]
    direct, general, _ = read_both_ways(folder, rec, segments, "_plain_ids_token", changes, _alter)
    assert direct == general


def test_plain_frame_reads_vllms_own_shape_and_nothing_else() -> None:
    frame = {
        "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
        "choices": [{
            "index": 0, "text": " the", "token_ids": [271],
            "logprobs": {
                "text_offset": [4], "token_logprobs": [-0.25], "tokens": ["token_id:271"],
                "top_logprobs": [{"token_id:271": -0.25, "token_id:264": -3.0}],
            },
            "finish_reason": None, "stop_reason": None,
        }],
    }  # fmt: skip
    assert vllm.plain_frame(frame, 0) == (
        " the",
        271,
        -0.25,
        [("token_id:271", -0.25), ("token_id:264", -3.0)],
    )
    assert vllm.plain_frame(frame, 1) is None  # another choice's
    for how in ("finish", "usage", "ids-two", "logprob-low", "two-choices", "delta"):
        altered = copy.deepcopy(frame)
        _alter(altered, how, 0, 1000)
        assert vllm.plain_frame(altered, 0) is None, how
    bare = copy.deepcopy(frame)
    _alter(bare, "logprobs-null", 0, 1000)
    assert vllm.plain_frame(bare, 0) == (" the", 271, None, None)  # ids without logprobs
