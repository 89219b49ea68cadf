"""Feeding identified tokens to the `Aligner` and releasing confirmed segments.

`_Feeding` is the half of `Realigner` that turns the queue of observed tokens into
aligner pushes: it decides the decoding mode (continuation or not; special tokens
skipped or not) from the streamed content, places unidentified tokens' bytes between
identified ones (`tokentrail.realign.placement`), stands in for them with tokens that
spell the same bytes (marked refused), and releases each segment once the content
confirms its text.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

from ..align import Aligner
from ..segment import Segment, TokenSpan
from ..stops import split_segment
from ..vocab import Vocab
from .placement import _GapRef, _Group, _Obs, _placements
from .result import RealignedSegment, RefusedToken, _first_difference
from .vocabmap import _continued, _Reverse

log = logging.getLogger("tokentrail.realign")


class _Feeding:
    """The aligner-feeding half of `Realigner` (its state is set up there)."""

    if TYPE_CHECKING:
        vocab: Vocab
        prompt_ids: tuple[int, ...]
        _rev: _Reverse
        _skip: bool | None
        _continuation: bool | None
        _aligners: dict[bool, Aligner] | None
        _primary: bool
        _map: list[int | _GapRef]
        _pending: deque[_Obs]
        _held: deque[RealignedSegment]
        _unconfirmed: str
        _content: list[str]
        _cb: bytearray
        _text_emitted: int
        _piece_pushed: int
        _piece_emitted: int
        _text_seen: bool
        _raw_seen: bool
        _grew: bool
        _diverged: str | None
        _refused: list[RefusedToken]
        _orphans: list[RefusedToken]
        _trailing: list[TokenSpan]

        def _warn(self, message: str) -> None: ...

    def _skipped(self, tid: int) -> bool | None:
        """Whether a token adds no text; None while that is undecided (special, auto)."""
        if tid in self.vocab.hidden:
            return True
        if tid in self.vocab.special:
            return self._skip
        return False

    def _first_form(self, tid: int) -> bytes:
        """A token's bytes when it starts the text (SentencePiece's leading-space rule)."""
        v = self.vocab
        piece = v.first_pieces.get(tid, v.pieces[tid] or b"")
        k = 0
        while k < len(piece) and k < v.strip_leading and piece[k : k + 1] == b" ":
            k += 1
        return piece[k:]

    def _own_bytes(self, tid: int) -> bytes:
        """The content bytes a token adds, as far as the vocabulary's rules say (an
        undecided special token: none, as most servers skip them)."""
        if self._skipped(tid) is not False:
            return b""
        if not self._text_seen and not self._continuation:
            return self._first_form(tid)
        return self.vocab.pieces[tid] or b""

    def _rest(self) -> bytes:
        """Streamed content beyond what the pushed tokens account for."""
        pos = self._text_emitted + self._piece_pushed - self._piece_emitted
        return bytes(self._cb[pos:]) if len(self._cb) > pos else b""

    def _decide_mode(self, final: bool) -> bool:
        """Before the first push: is the stream a continuation (no leading-space strip)?"""
        if self._continuation is None:
            for o in self._pending:
                if o.kind == "token":
                    assert o.id is not None
                    if o.id in self.vocab.hidden or o.id in self.vocab.special:
                        continue
                    piece = self.vocab.pieces[o.id] or b""
                    if piece == self._first_form(o.id):
                        self._continuation = False
                    elif len(self._cb) >= len(piece) or final:
                        self._continuation = bytes(self._cb).startswith(piece)
                    else:
                        return False
                else:
                    data = o.raw if o.kind == "gap" else bytes(self._cb)
                    if not data and not final:
                        return False
                    self._continuation = (data or b"")[:1] == b" "
                break
            else:
                if not final:
                    return False
                self._continuation = False
        vocab = _continued(self.vocab) if self._continuation else self.vocab
        skips = [True, False] if self._skip is None else [self._skip]
        if self.prompt_ids:
            vocab = self.vocab  # the prompt itself takes the first-token rules
        self._aligners = {
            s: Aligner(vocab, skip_special_tokens=s, prompt_ids=self.prompt_ids or None)
            for s in skips
        }
        self._primary = skips[0]
        return True

    def _decide_skip(self, tid: int, final: bool) -> bool:
        """At the first special token, when following the stream: is it skipped?"""
        if self._skip is not None or tid not in self.vocab.special:
            return True
        piece = self.vocab.pieces[tid] or b""
        if not piece:
            return True  # no text either way
        rest = self._rest()
        if len(rest) >= len(piece):
            keep = rest.startswith(piece)
        elif not piece.startswith(rest) or final:
            keep = False
        else:
            return False
        self._skip = not keep
        assert self._aligners is not None
        self._aligners = {self._skip: self._aligners[self._skip]}
        self._primary = self._skip
        return True

    def _drain(self, final: bool) -> None:
        """Push queued tokens to the aligner, as far as the content lets us decide."""
        p = self._pending
        while p:
            if self._aligners is None and not self._decide_mode(final):
                return
            o = p[0]
            if o.kind == "gap":
                p.popleft()
                assert o.raw is not None
                self._placeholders(o.raw, o.refused)
            elif o.kind == "unknown":
                if not self._close_unknown(final):
                    return
            else:
                assert o.id is not None
                if not self._decide_skip(o.id, final):
                    return
                p.popleft()
                self._push(o.index, o.id, o.logprob, o.top)

    def _push(
        self,
        index: int | _GapRef | None,
        tid: int,
        logprob: float | None,
        top: tuple[tuple[int, float], ...] | None,
    ) -> None:
        assert self._aligners is not None and index is not None
        if self._skipped(tid) is False:
            piece = self.vocab.pieces[tid] or b""
            if not self._text_seen and not self._continuation:
                piece = self.vocab.first_pieces.get(tid, piece)
            self._piece_pushed += len(piece)
            self._text_seen = True
        self._map.append(index)
        segments: list[Segment] = []
        for skip, aligner in self._aligners.items():  # two only until specials are decided
            out = aligner.push(tid, logprob, top)
            if skip == self._primary:
                segments = out
        self._take(segments)

    def _placeholders(self, data: bytes, refused: tuple[RefusedToken, ...]) -> None:
        """Stand-in tokens for bytes whose real tokens are unknown, so text stays exact."""
        self._refused.extend(refused)
        if not data:
            self._orphans.extend(refused)
            return
        ids = self._rev.split(data)
        ref = _GapRef(refused)
        if ids is None:
            # No stand-ins spell these bytes: end the aligner's stream here and restart.
            self._warn(f"no tokens of {self.vocab.name} spell the bytes {data!r}")
            assert self._aligners is not None
            outs = {s: al.finish() for s, al in self._aligners.items()}
            self._take(outs[self._primary])
            text = data.decode("utf-8", "replace")
            self._held.append(RealignedSegment(text, (), refused))
            self._text_emitted += len(text.encode("utf-8"))
            self._text_seen = True
            vocab = _continued(self.vocab)
            self._aligners = {s: Aligner(vocab, skip_special_tokens=s) for s in self._aligners}
            self._map = []  # the new aligner counts its tokens from 0
            return
        for tid in ids:
            self._push(ref, tid, None, None)

    def _close_unknown(self, final: bool) -> bool:
        """Settle the unidentified tokens at the head of the queue, if the content allows.

        Their bytes are what the content holds between the tokens pushed so far and the
        identified tokens after them. Mid-stream that is settled when the content ends
        exactly with the bytes of the identified tokens queued after the run; at the end
        of the stream, when the identified tokens fit into the content in one way only
        (otherwise the first of them joins the unidentified run, and we try again).
        """
        p = self._pending
        if not final and not self._grew:
            return False  # nothing new to settle it with
        groups = self._groups()
        run = groups[0].obs
        rest = self._rest()
        if not final:
            if len(groups) != 2 or not groups[1].data:
                return False
            tail = groups[1].data
            if not rest.endswith(tail) or len(rest) - len(tail) < groups[0].least:
                return False
            gap = rest[: len(rest) - len(tail)]
        elif len(groups) == 1:
            gap = rest
        else:
            starts = _placements(rest, groups)
            if starts is None:
                reason = "its place in the text cannot be told, next to unidentified tokens"
                first = groups[1].obs
                at = len(run)
                for k, o in enumerate(first, at):
                    data = o.raw if o.kind == "gap" else self._own_bytes(o.id or 0)
                    refused = o.refused or (RefusedToken(o.index, reason),)
                    p[k] = _Obs("unknown", o.index, None, o.logprob, o.top, data, refused)
                return True
            gap = rest[: starts[0]]
        claimed = [o.raw for o in run]
        if all(c is not None for c in claimed) and b"".join(c or b"" for c in claimed) == gap:
            # The content shows the very bytes claimed (a real U+FFFD, say): believed
            # from a server seen to send raw bytes, else refused at the end.
            ids = [self._lookup(c or b"") for c in claimed]
            if self._raw_seen and all(i is not None for i in ids):
                for o, tid in zip([p.popleft() for _ in run], ids, strict=True):
                    assert tid is not None
                    self._push(o.index, tid, o.logprob, o.top)
                return True
            if not final and not self._raw_seen:
                return False
        for _ in run:
            p.popleft()
        self._placeholders(gap, tuple(r for o in run for r in o.refused))
        return True

    def _groups(self) -> list[_Group]:
        """The queue as alternating runs of unidentified and identified tokens."""
        out: list[_Group] = []
        for o in self._pending:
            unknown = o.kind == "unknown"
            if not out or out[-1].unknown != unknown:
                out.append(_Group(unknown))
            g = out[-1]
            g.obs.append(o)
            if unknown:
                g.least += 1 if o.raw else 0
            elif o.kind == "gap":
                g.data += o.raw or b""
            else:
                g.data += self._own_bytes(o.id or 0)
        return out

    def _lookup(self, data: bytes) -> int | None:
        ids = self._rev.ids.get(data)
        return ids[0] if ids else None

    # -- releasing segments ------------------------------------------------------------------

    def _take(self, segments: list[Segment]) -> None:
        """Aligner output -> realigned segments (stream indices, refused tokens), held."""
        for seg in segments:
            self._text_emitted += len(seg.text.encode("utf-8"))
            self._piece_emitted += sum(t.end - t.start for t in seg.tokens)
            spans = []
            refused: list[RefusedToken] = []
            if self._orphans:
                refused.extend(self._orphans)
                self._orphans = []
            for t in seg.tokens:
                if t.index < 0:  # a prompt token carrying a character it left open
                    spans.append(t)
                    continue
                m = self._map[t.index]
                if isinstance(m, _GapRef):
                    for r in m.refused:
                        if not any(r is x for x in refused):
                            refused.append(r)
                else:
                    spans.append(TokenSpan(m, t.id, t.start, t.end, t.logprob, t.top_logprobs))
            self._held.append(RealignedSegment(seg.text, tuple(spans), tuple(refused)))

    def _release(self, final: bool) -> list[Segment]:
        """Segments whose text the streamed content confirms (all of them at the end)."""
        out: list[Segment] = []
        held = self._held
        while held:
            seg = held[0]
            u = self._unconfirmed
            if self._diverged is not None or u.startswith(seg.text):
                if self._diverged is None:
                    self._unconfirmed = u[len(seg.text) :]
                out.append(held.popleft())
                continue
            if seg.text.startswith(u):
                if not final:
                    break
                out.extend(self._cut_trailing())
                break
            at = len("".join(self._content)) - len(u) + _first_difference(seg.text, u)
            self._diverged = (
                f"the tokens' text differs from the streamed content at character {at}: "
                f"{seg.text[:20]!r} vs {u[:20]!r}"
            )
            self._warn(self._diverged)
        return out

    def _cut_trailing(self) -> list[Segment]:
        """At the end: the content stops inside the held text; keep what it covers."""
        held = self._held
        u = self._unconfirmed
        seg = held.popleft()
        out: list[Segment] = []
        rest: list[TokenSpan] = []
        if u:
            parts = split_segment(seg, len(u))
            if parts is None:
                self._warn(
                    "the content ends inside a segment that cannot be cut exactly; all its "
                    "tokens are kept"
                )
                out.append(RealignedSegment(u, seg.tokens, seg.refused))
            else:
                left, right = parts
                out.append(RealignedSegment(left.text, left.tokens, seg.refused))
                rest.extend(right.tokens)
        else:
            rest.extend(seg.tokens)
        while held:
            rest.extend(held.popleft().tokens)
        self._unconfirmed = ""
        self._trailing.extend(rest)
        if rest:
            first = rest[0].index
            self._warn(
                f"the streamed content ends before the tokens' text does: tokens from index "
                f"{first} on carry text the content does not have (a stop string the server "
                "removed?)"
            )
        return out
