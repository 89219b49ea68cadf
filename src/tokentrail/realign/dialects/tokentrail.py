"""tokentrail's own ``"tokentrail"`` extension: segments and token ids, checked.

A tokentrail server streams, next to the OpenAI fields, the token of each step (``id``,
``index``, ``logprob``) and the segments it made final. The realigner passes those
segments through and checks them against its own realignment of the extension's ids.

This module only reads: `parse_extension` turns a frame's extension into an
`Extension`, `compare` says where two lists of segments differ; the `Realigner` applies
both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...segment import Alternative, Segment, TokenSpan
from .. import wire
from ..result import RealignedSegment, RealignError
from ..wire import Frame, WireToken

NAME = "tokentrail-extension"


@dataclass(frozen=True, slots=True)
class Extension:
    """What one chunk's ``"tokentrail"`` object says.

    `segments` are the segments it made final, `stop_spans` the tokens of a stop string
    that ended the text, `tokens` the ids of the tokens it carries (in stream order: the
    step's token in a streamed chunk, every token of a whole response), and `indices`
    the stream index the extension gives each of them.
    """

    segments: tuple[RealignedSegment, ...]
    stop_spans: tuple[TokenSpan, ...]
    tokens: tuple[WireToken, ...]
    indices: tuple[int, ...]
    #: A streamed chunk (one ``token``), not a whole response.
    streamed: bool

    def misnumbered(self, expected: int, where: str) -> str | None:
        """A warning when the tokens' indices do not continue from `expected` (else None)."""
        if self.streamed:
            if self.indices[0] == expected:
                return None
            return f"{where}: extension token index {self.indices[0]}, expected {expected}"
        if list(self.indices) != list(range(expected, expected + len(self.indices))):
            return f"{where}: the extension's token indices are not consecutive"
        return None


def parse_extension(frame: Frame, where: str) -> Extension:
    """Read `frame.ext`, the chunk's ``"tokentrail"`` object (raises `RealignError`)."""
    ext = frame.ext
    assert ext is not None
    segs = ext.get("segments") or []
    if not isinstance(segs, list):
        raise RealignError(f"{where}.tokentrail.segments must be a list")
    out = tuple(_ext_segment(s, f"{where}.tokentrail.segments[{k}]") for k, s in enumerate(segs))
    stop = ext.get("stop")
    stop_spans: tuple[TokenSpan, ...] = ()
    if isinstance(stop, Mapping):
        stop_spans = tuple(
            _ext_span(t, f"{where}.tokentrail.stop.tokens[{k}]")
            for k, t in enumerate(stop.get("tokens") or [])
        )
    token = ext.get("token")
    if isinstance(token, Mapping):
        tid = token.get("id")
        idx = token.get("index")
        if not wire.is_int(tid) or not wire.is_int(idx):
            raise RealignError(f"{where}.tokentrail.token needs integer 'id' and 'index'")
        lp = wire.logprob(token.get("logprob"), f"{where}.tokentrail.token.logprob")
        one = WireToken(tid, logprob=lp, source=NAME)
        return Extension(out, stop_spans, (one,), (idx,), streamed=True)
    if token is not None:
        raise RealignError(f"{where}.tokentrail.token must be an object")
    # A whole response: the ids are those of the spans, in order, once each.
    by_index = {t.index: t for s in out for t in s.tokens}
    by_index.update({t.index: t for t in stop_spans})
    spans = sorted(by_index.items())
    tokens = tuple(WireToken(t.id, logprob=t.logprob, source=NAME) for _, t in spans)
    return Extension(out, stop_spans, tokens, tuple(i for i, _ in spans), streamed=False)


def compare(theirs: Sequence[Segment], ours: Sequence[Segment]) -> str | None:
    """Where the extension's segments (`theirs`) differ from the realignment of its token
    ids (`ours`), in one line; None when they are equal."""

    def key(s: Segment) -> tuple[str, list[tuple[int, int, int, int]]]:
        return s.text, [(t.index, t.id, t.start, t.end) for t in s.tokens]

    a_keys = [key(s) for s in theirs]
    b_keys = [key(s) for s in ours]
    if a_keys == b_keys or _coverage(theirs) == _coverage(ours):
        return None
    n = next(
        (k for k, (a, b) in enumerate(zip(a_keys, b_keys, strict=False)) if a != b),
        min(len(a_keys), len(b_keys)),
    )
    a = a_keys[n] if n < len(a_keys) else None
    b = b_keys[n] if n < len(b_keys) else None
    return (
        f"the tokentrail extension disagrees with the realignment of its token ids at "
        f"segment {n}: extension {a}, realigned {b}"
    )


def _coverage(segments: Sequence[Segment]) -> tuple[str, list[tuple[int, int, int]]]:
    """The text and each token's (index, id, bytes given), whatever the segment
    boundaries: a server holding text back for a stop string cuts segments where a
    realignment without its stop strings does not."""
    spans: list[tuple[int, int, int]] = []
    for s in segments:
        for t in s.tokens:
            if spans and spans[-1][0] == t.index:
                spans[-1] = (t.index, t.id, spans[-1][2] + t.end - t.start)
            else:
                spans.append((t.index, t.id, t.end - t.start))
    return "".join(s.text for s in segments), spans


def _ext_span(t: Any, where: str) -> TokenSpan:
    if not isinstance(t, Mapping):
        raise RealignError(f"{where}: expected an object, got {wire.type_name(t)}")
    for name in ("index", "id", "start", "end"):
        if not wire.is_int(t.get(name)):
            raise RealignError(f"{where}.{name} must be an integer")
    top = None
    if t.get("top_logprobs") is not None:
        alts = t["top_logprobs"]
        if not isinstance(alts, list):
            raise RealignError(f"{where}.top_logprobs must be a list")
        top_list = []
        for k, a in enumerate(alts):
            here = f"{where}.top_logprobs[{k}]"
            if not isinstance(a, Mapping) or not wire.is_int(a.get("id")):
                raise RealignError(f"{here} needs an integer 'id'")
            lp = wire.logprob(a.get("logprob"), f"{here}.logprob")
            raw = wire.byte_list(a.get("bytes"), f"{here}.bytes") or b""
            top_list.append(
                Alternative(
                    a["id"],
                    -math.inf if lp is None else lp,
                    raw,
                    wire.text(a.get("text"), f"{here}.text"),
                )
            )
        top = tuple(top_list)
    return TokenSpan(
        t["index"], t["id"], t["start"], t["end"], wire.logprob(t.get("logprob"), where), top
    )


def _ext_segment(s: Any, where: str) -> RealignedSegment:
    if not isinstance(s, Mapping):
        raise RealignError(f"{where}: expected an object, got {wire.type_name(s)}")
    tokens = s.get("tokens") or []
    if not isinstance(tokens, list):
        raise RealignError(f"{where}.tokens must be a list")
    spans = tuple(_ext_span(t, f"{where}.tokens[{k}]") for k, t in enumerate(tokens))
    return RealignedSegment(wire.text(s.get("text"), f"{where}.text"), spans)
