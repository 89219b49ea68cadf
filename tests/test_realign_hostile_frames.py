"""A stream the realigner cannot read is a `RealignError`, never a crash.

The proxy reads whatever its upstream sends (`engines.upstream.wire.StepReader`): a
`RealignError` becomes the client's error event naming what was wrong; any other
exception would be a bug with no message for anyone. Hypothesis takes the real
recordings of every dialect in tests/data/realign (OpenAI chat and completions, vLLM's
token ids and ``token_id:N`` strings, tokentrail's extension, llama.cpp's ``/completion``
and OpenAI endpoints with folds and stop strings) and replaces, deletes or adds values
anywhere in their chunks; feeding the result, finishing and reading the result must
either work or raise `RealignError`. (Its first run found an entry id outside the
vocabulary raising IndexError in llama.cpp's frames: `test_realign_plain_frame.py`.)
"""

from __future__ import annotations

import copy
import functools
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.realign_recordings import (
    DATA,
    llama_recordings,
    recording_chunks,
    recording_vocab,
)
from tokentrail import load_vocab
from tokentrail.realign import Realigner, RealignError

MANIFEST: list[dict[str, Any]] = json.loads((DATA / "MANIFEST.json").read_text("utf-8"))

#: Values a hostile or broken server might put anywhere.
HOSTILE = [
    None, True, 0, -1, 7, 2**70, -(2**70), 0.5, -9999.0, -1e308, 1e308, math.nan, math.inf,
    -math.inf, "", "x", "\ufffd", "bytes:\\xe2\\x80", "token_id:3", "token_id:-4",
    "token_id:999999999", [], [None], [300], [-1], [1, 2, 3], {}, {"id": 1}, {"error": "boom"},
]


@functools.cache
def _top_vocab(corpus: Path, rel: str) -> Any:
    return load_vocab(corpus / "tokenizers" / rel)


def _streams(corpus: Path) -> list[tuple[Any, list[Any]]]:
    out = []
    for e in MANIFEST:
        lines = (DATA / e["file"]).read_text("utf-8").splitlines()
        chunks = [json.loads(x) for x in lines if x.strip()]
        out.append((_top_vocab(corpus, e["tokenizer"]), chunks))
    for folder, rec in llama_recordings():
        if rec["endpoint"] != "completion" or len(out) % 2:  # (a share: every dialect)
            out.append((recording_vocab(folder), recording_chunks(folder, rec)))
    return out


def _places(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside one chunk."""
    out = [path] if path else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _places(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _places(v, (*path, i))
    return out


#: The keys the dialects read a token from (a mutation aims at them half the time).
TOKEN_KEYS = {
    "id", "tokens", "token_ids", "token", "logprob", "bytes", "top_logprobs", "content",
    "text", "tokens_predicted", "completion_probabilities", "logprobs", "finish_reason",
    "usage", "completion_tokens", "stop", "index", "choices", "delta", "tokentrail",
}


def _alter(chunk: Any, where: int, how: int, what: Any, focus: bool) -> None:
    """Replace (0), delete (1) or add beside (2) one value; or (3) replace that value
    everywhere it occurs in the chunk (an id changed consistently: in ``tokens``, the
    entry and its alternatives). `focus`: a value under one of `TOKEN_KEYS`."""
    places = _places(chunk)
    if focus:
        places = [p for p in places if any(k in TOKEN_KEYS for k in p[-2:])] or places
    if not places:
        return
    path = places[where % len(places)]
    parent = chunk
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    if how == 3 and not isinstance(parent[last], (dict, list)):
        old = parent[last]
        for p in places:
            holder = chunk
            for step in p[:-1]:
                holder = holder[step]
            value = holder[p[-1]]
            if type(value) is type(old) and value == old:
                holder[p[-1]] = copy.deepcopy(what)
    elif how == 0 or not isinstance(parent, dict):
        parent[last] = copy.deepcopy(what)
    elif how == 1:
        del parent[last]
    else:
        parent[f"{last}_"] = copy.deepcopy(what)  # an extra key beside it


@pytest.fixture(scope="module")
def streams(corpus: Path) -> list[tuple[Any, list[Any]]]:
    return _streams(corpus)


@settings(max_examples=600, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    which=st.integers(0, 10_000),
    changes=st.lists(
        st.tuples(st.integers(0, 60), st.integers(0, 10_000), st.integers(0, 3),
                  st.sampled_from(HOSTILE), st.booleans()),
        min_size=1, max_size=3,
    ),
    segments=st.booleans(),
)
def test_a_hostile_stream_is_a_realign_error_or_read(
    streams: list[tuple[Any, list[Any]]], which: int, changes: list[Any], segments: bool
) -> None:
    vocab, chunks = streams[which % len(streams)]
    chunks = copy.deepcopy(chunks)
    for at, where, how, what, focus in changes:
        if chunks:
            _alter(chunks[at % len(chunks)], where, how, what, focus)
    events: list[Any] = []
    r = Realigner(vocab, on_token=events.append, segments=segments)
    try:
        for chunk in chunks:
            r.feed(chunk)
        r.finish()
        result = r.result()
    except RealignError as e:
        assert str(e)  # it says what was wrong
        return
    assert result.tokens >= 0 and all(e.refused or e.id is not None for e in events)


#: A value of another type or out of range, for the exhaustive sweep below.
SWEEP = [None, -1, 2**70, "x", [], {}, -math.inf]


def _one_per_dialect(streams: list[tuple[Any, list[Any]]]) -> list[tuple[Any, list[Any]]]:
    """One stream per shape of first chunk (its keys, and its first choice's)."""
    seen, out = set(), []
    for vocab, chunks in streams:
        first = chunks[0] if chunks else {}
        choice = (first.get("choices") or [{}])[0] if isinstance(first, dict) else {}
        shape = (tuple(sorted(first)), tuple(sorted(choice)) if isinstance(choice, dict) else ())
        if shape not in seen:
            seen.add(shape)
            out.append((vocab, chunks))
    return out


def _read(vocab: Any, chunks: list[Any]) -> None:
    r = Realigner(vocab)
    try:
        for chunk in chunks:
            r.feed(chunk)
        r.result()
    except RealignError as e:
        assert str(e)


def test_every_single_change_to_a_streams_first_frames_is_read_or_refused(
    streams: list[tuple[Any, list[Any]]],
) -> None:
    """Every value of the first two chunks of one stream per recording, each replaced by
    each of `SWEEP` (alone, and everywhere it occurs), and each deleted: the sweep the
    random test above only samples."""
    runs = 0
    for vocab, chunks in _one_per_dialect(streams):
        for at in range(min(2, len(chunks))):
            for where in range(len(_places(chunks[at]))):
                for how, whats in ((0, SWEEP), (3, SWEEP), (1, [None])):
                    for what in whats:
                        altered = copy.deepcopy(chunks)
                        _alter(altered[at], where, how, what, False)
                        _read(vocab, altered)
                        runs += 1
    assert runs > 2000


def test_a_count_of_a_billion_unseen_tokens_is_not_enumerated() -> None:
    """A count is not believed past `MAX_UNDESCRIBED` tokens that came with neither data
    nor bytes: each would be a refused record (a billion of them, memory the proxy does
    not have). A frame's ``tokens_predicted`` that far ahead refuses the stream, at once;
    a usage total that far ahead is set aside with a warning (the stream is read)."""
    folder, rec = next(x for x in llama_recordings() if x[1]["endpoint"] == "completion")
    vocab = recording_vocab(folder)
    chunks = recording_chunks(folder, rec)
    chunks[1]["tokens_predicted"] = 10**9
    r = Realigner(vocab)
    with pytest.raises(RealignError, match="not a fold"):
        for chunk in chunks:
            r.feed(chunk)
    chunks = recording_chunks(folder, rec)
    chunks.append({"choices": [], "usage": {"completion_tokens": 10**9}})
    r = Realigner(vocab)
    for chunk in chunks:
        r.feed(chunk)
    result = r.result()
    assert result.tokens == len(rec["ids"]) and len(result.refused) < 10
    assert any("not believed" in w for w in result.warnings)
