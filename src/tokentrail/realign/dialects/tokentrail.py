"""tokentrail's own ``"tokentrail"`` extension: segments and token ids, checked.

A tokentrail server streams, next to the OpenAI fields, the token of each step (``id``,
``index``, ``logprob``) and the segments it made final. The realigner passes those
segments through and checks them against its own realignment of the extension's ids.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...segment import Alternative, Segment, TokenSpan
from ..result import RealignedSegment, RealignError
from ..wire import _byte_list, _Frame, _is_int, _logprob, _text, _type_name, _Wire

if TYPE_CHECKING:
    from ..core import Realigner

NAME = "tokentrail-extension"


def read_extension(r: Realigner, frame: _Frame, where: str) -> list[RealignedSegment]:
    """tokentrail's extension: its token ids feed the check, its segments the output."""
    ext = frame.ext
    assert ext is not None
    if r._ext is None:
        r._ext = []
    r._source("tokentrail-extension")
    segs = ext.get("segments") or []
    if not isinstance(segs, list):
        raise RealignError(f"{where}.tokentrail.segments must be a list")
    out = [_ext_segment(s, f"{where}.tokentrail.segments[{k}]") for k, s in enumerate(segs)]
    r._ext.extend(out)
    stop = ext.get("stop")
    stop_spans = []
    if isinstance(stop, Mapping):
        stop_spans = [
            _ext_span(t, f"{where}.tokentrail.stop.tokens[{k}]")
            for k, t in enumerate(stop.get("tokens") or [])
        ]
    token = ext.get("token")
    frame.tokens = []
    frame.first_index = None
    frame.folded_content = False
    if isinstance(token, Mapping):
        tid = token.get("id")
        idx = token.get("index")
        if not _is_int(tid) or not _is_int(idx):
            raise RealignError(f"{where}.tokentrail.token needs integer 'id' and 'index'")
        if idx != r._n:
            r._warn(f"{where}: extension token index {idx}, expected {r._n}")
        lp = _logprob(token.get("logprob"), f"{where}.tokentrail.token.logprob")
        frame.tokens.append(_Wire(tid, logprob=lp, source="tokentrail-extension"))
    elif token is None:
        # A whole response: the ids are those of the spans, in order, once each.
        by_index = {t.index: t for s in out for t in s.tokens}
        by_index.update({t.index: t for t in stop_spans})
        spans = sorted(by_index.items())
        if [i for i, _ in spans] != list(range(r._n, r._n + len(spans))):
            r._warn(f"{where}: the extension's token indices are not consecutive")
        for _, t in spans:
            frame.tokens.append(_Wire(t.id, logprob=t.logprob, source="tokentrail-extension"))
    else:
        raise RealignError(f"{where}.tokentrail.token must be an object")
    return out


def check_extension(r: Realigner) -> bool:
    """Do the extension's segments equal the realignment of its own token ids?"""
    assert r._ext is not None

    def key(s: Segment) -> tuple[str, list[tuple[int, int, int, int]]]:
        return s.text, [(t.index, t.id, t.start, t.end) for t in s.tokens]

    theirs = [key(s) for s in r._ext]
    ours = [key(s) for s in r._ours]
    if theirs == ours:
        return True
    n = next(
        (k for k, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b),
        min(len(theirs), len(ours)),
    )
    a = theirs[n] if n < len(theirs) else None
    b = ours[n] if n < len(ours) else None
    r._warn(
        f"the tokentrail extension disagrees with the realignment of its token ids at "
        f"segment {n}: extension {a}, realigned {b}"
    )
    return False


def _ext_span(t: Any, where: str) -> TokenSpan:
    if not isinstance(t, Mapping):
        raise RealignError(f"{where}: expected an object, got {_type_name(t)}")
    for name in ("index", "id", "start", "end"):
        if not _is_int(t.get(name)):
            raise RealignError(f"{where}.{name} must be an integer")
    top = None
    if t.get("top_logprobs") is not None:
        alts = t["top_logprobs"]
        if not isinstance(alts, list):
            raise RealignError(f"{where}.top_logprobs must be a list")
        top_list = []
        for k, a in enumerate(alts):
            here = f"{where}.top_logprobs[{k}]"
            if not isinstance(a, Mapping) or not _is_int(a.get("id")):
                raise RealignError(f"{here} needs an integer 'id'")
            lp = _logprob(a.get("logprob"), f"{here}.logprob")
            raw = _byte_list(a.get("bytes"), f"{here}.bytes") or b""
            top_list.append(
                Alternative(
                    a["id"],
                    -math.inf if lp is None else lp,
                    raw,
                    _text(a.get("text"), f"{here}.text"),
                )
            )
        top = tuple(top_list)
    return TokenSpan(
        t["index"], t["id"], t["start"], t["end"], _logprob(t.get("logprob"), where), top
    )


def _ext_segment(s: Any, where: str) -> RealignedSegment:
    if not isinstance(s, Mapping):
        raise RealignError(f"{where}: expected an object, got {_type_name(s)}")
    tokens = s.get("tokens") or []
    if not isinstance(tokens, list):
        raise RealignError(f"{where}.tokens must be a list")
    spans = tuple(_ext_span(t, f"{where}.tokens[{k}]") for k, t in enumerate(tokens))
    return RealignedSegment(_text(s.get("text"), f"{where}.text"), spans)
