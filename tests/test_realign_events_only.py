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

import functools
import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.llamacpp import find_smollm2
from tokentrail import load_vocab
from tokentrail.realign import Realigner

DATA = Path(__file__).resolve().parent / "data" / "realign"
DEMO_MODEL = Path(__file__).resolve().parents[1] / "src" / "tokentrail" / "demo_model"
FOLDERS = ("llamacpp_demo", "llamacpp", "llamacpp_folds")


def _recordings() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for folder in FOLDERS:
        manifest = json.loads((DATA / folder / "MANIFEST.json").read_text("utf-8"))
        out += [(folder, rec) for rec in manifest["recordings"]]
    return out


@functools.cache
def _vocab(folder: str) -> Any:
    return load_vocab(DEMO_MODEL if folder == "llamacpp_demo" else find_smollm2())


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
    lines = (DATA / folder / rec["file"]).read_text("utf-8").splitlines()
    chunks = [json.loads(line) for line in lines if line.strip()]
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
