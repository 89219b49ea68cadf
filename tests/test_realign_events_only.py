"""`Realigner(segments=False)`: the events alone, as the proxy's reader uses them.

The proxy reads only the realigner's `TokenEvent`s (`engines.upstream.wire.StepReader`);
its output stage aligns the tokens again itself. With ``segments=False`` the realigner
makes no segments and checks nothing against the streamed content (issue #32: the
proxy's CPU per token). The events must not change: on every real llama-server recording
in tests/data/realign (streamed ``/completion``, ``/v1/completions`` and ``/v1/chat``, at
temperature 0 and 1.5, with folded frames and a stop string), the events with and
without segments are equal, and their identified ids are the recording's true ids.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.realign_recordings import llama_recordings as _recordings
from tests.helpers.realign_recordings import recording_chunks
from tests.helpers.realign_recordings import recording_vocab as _vocab
from tokentrail.realign import Realigner


def _events(vocab: Any, chunks: list[Any], segments: bool) -> tuple[list[Any], Any]:
    events: list[Any] = []
    r = Realigner(vocab, on_token=events.append, alternatives=False, segments=segments)
    fed = [seg for chunk in chunks for seg in r.feed(chunk)]
    fed += r.finish()
    return events, (fed, r.result())


@pytest.mark.parametrize(
    ("folder", "rec"), _recordings(), ids=[f"{f}/{r['name']}" for f, r in _recordings()]
)
def test_events_without_segments_are_the_events_with_them(folder: str, rec: dict[str, Any]) -> None:
    vocab = _vocab(folder)
    chunks = recording_chunks(folder, rec)
    with_segments, (segments, full) = _events(vocab, chunks, True)
    alone, (none, bare) = _events(vocab, chunks, False)
    assert alone == with_segments
    assert segments and full.segments and none == [] and bare.segments == []
    # The identified events carry the recording's true ids, in order. (Their indices
    # are the ones known while streaming: after a folded frame the result renumbers.)
    rest = iter(rec["ids"])
    named = [e.id for e in alone if e.identified]
    assert named and all(any(t == tid for t in rest) for tid in named)
    assert bare.tokens == full.tokens and bare.refused == full.refused
