"""Feeding identified tokens to the `Aligner` and releasing confirmed segments.

A `Feeder` is what a `Realigner` hands its observed tokens to: it decides the decoding
mode (continuation or not; special tokens skipped or not) from the streamed content,
places unidentified tokens' bytes between identified ones
(`tokentrail.realign.placement`), stands in for them with tokens that spell the same
bytes (marked refused), and releases each segment once the content confirms its text.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable, Sequence

from ..align import Aligner
from ..segment import Segment, TokenSpan
from ..stops import split_segment
from ..vocab import Vocab
from .placement import GapRef, Group, Obs, placements
from .result import RealignedSegment, RefusedToken, TokenEvent, TokenHook, first_difference
from .vocabmap import continued, reverse

log = logging.getLogger("tokentrail.realign")


@functools.lru_cache(maxsize=16)
def _template(vocab: Vocab, skip_special_tokens: bool) -> Aligner:
    """An aligner over `vocab`'s compiled tables, built once per vocabulary and setting
    (compiling them costs milliseconds per stream on a large vocabulary)."""
    return Aligner(vocab, skip_special_tokens=skip_special_tokens)


def new_aligner(vocab: Vocab, skip_special_tokens: bool, prompt_ids: Sequence[int] = ()) -> Aligner:
    """`Aligner(vocab, skip_special_tokens=..., prompt_ids=...)`, from a cached template."""
    return _template(vocab, skip_special_tokens).fresh(prompt_ids=tuple(prompt_ids) or None)


class Feeder:
    """Observed tokens in, confirmed segments out, for one streamed choice.

    The reader (`tokentrail.realign.Realigner`) gives it the streamed content
    (`add_content`) and the tokens it observed (`add`), calls `advance` after each chunk
    and `finish` at the end. `skip_special_tokens` None follows the content. `warn`
    reports a problem in one line; `on_token` (optional) receives a `TokenEvent` for
    every token given to the aligner, in order, and for every refused token that had no
    bytes. `alternatives` False: the segments carry no alternatives (the events still do).
    `segments` False: no segments at all, only the events (`advance` and `finish` return
    none, and the content is not checked against the tokens' text).
    """

    def __init__(
        self,
        vocab: Vocab,
        skip_special_tokens: bool | None,
        prompt_ids: Sequence[int] = (),
        *,
        warn: Callable[[str], None],
        on_token: TokenHook | None = None,
        alternatives: bool = True,
        segments: bool = True,
    ) -> None:
        self.vocab = vocab
        self.prompt_ids = tuple(prompt_ids)
        self.on_token = on_token
        #: Whether the segments carry each token's alternatives (see `Realigner`).
        self.alternatives = alternatives
        #: Whether segments are made and released (see the class).
        self.segments = segments
        #: The stream was seen to send raw bytes (not UTF-8 on their own), so a U+FFFD it
        #: sends is a real U+FFFD; set by the reader.
        self.raw_seen = False
        #: Tokens refused while feeding, in order.
        self.refused: list[RefusedToken] = []
        #: Tokens whose text the content does not have (a stop string cut off), at the end.
        self.trailing: list[TokenSpan] = []
        #: Once the tokens' text and the streamed content part ways: where and how.
        self.diverged: str | None = None
        self._warn = warn
        self._rev = reverse(vocab)
        self._skip = skip_special_tokens
        first_rule = bool(vocab.first_pieces) or vocab.strip_leading > 0
        self._continuation: bool | None = None if first_rule else False
        if self.prompt_ids:
            self._continuation = True  # the prompt's text comes first: no first-token rules
        self._aligners: dict[bool, Aligner] | None = None
        self._primary = True
        self._map: list[int | GapRef] = []  # aligner token index -> stream index or gap
        self._pending: deque[Obs] = deque()
        self._held: deque[RealignedSegment] = deque()
        self._unconfirmed = ""  # streamed content not yet matched by released segments
        self._content: list[str] = []
        self._cb = bytearray()  # the streamed content, as bytes
        # Where pushed tokens end in the content: text the aligner emitted, plus the bytes
        # it still holds (pushed minus emitted, in its own byte stream).
        self._text_emitted = 0
        self._piece_pushed = 0
        self._piece_emitted = 0
        self._text_seen = False
        self._grew = False
        self._orphans: list[RefusedToken] = []

    # -- public ------------------------------------------------------------------------------

    @property
    def content(self) -> str:
        """The streamed content so far."""
        return "".join(self._content)

    @property
    def queued(self) -> int:
        """How many observed tokens wait for the content to settle them."""
        return len(self._pending)

    def add_content(self, text: str) -> None:
        """The content one chunk streamed (maybe none)."""
        self._grew = bool(text)
        if text:
            self._content.append(text)
            if self.segments:
                self._unconfirmed += text
            self._cb += text.encode("utf-8")

    def add(self, obs: Obs) -> None:
        """Queue one observed token (identified, not, or a gap of bytes)."""
        self._pending.append(obs)

    def prime(self) -> None:
        """Build the aligners now where nothing the stream sends can change them (a known
        prompt, or a vocabulary without first-token rules): their setup over the prompt
        then happens before the first token arrives (while the server computes it), not
        on that token's way out. Otherwise nothing: the first tokens decide."""
        if self._aligners is None and self._continuation is not None:
            self._build_aligners()

    def advance(self) -> list[Segment]:
        """Push what the content lets us decide; return the segments it confirms."""
        self._drain(final=False)
        return self._release(final=False)

    def finish(self) -> list[Segment]:
        """End of stream: settle the queue, flush the aligner, release everything."""
        self._drain(final=True)
        if self._aligners is not None:
            outs = {skip: al.finish() for skip, al in self._aligners.items()}
            self._take(outs[self._primary])
        released = self._release(final=True)
        if not self.segments:
            self._orphans.clear()
            return released  # none were made
        if self.diverged is None and self._unconfirmed:
            r = RefusedToken(None, "the streamed content has text that no token data accounts for")
            self.refused.append(r)
            released.append(RealignedSegment(self._unconfirmed, (), (r,)))
            self._unconfirmed = ""
        if self._orphans:
            released.append(RealignedSegment("", (), tuple(self._orphans)))
            self._orphans = []
        return released

    # -- feeding the aligner -----------------------------------------------------------------

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
        if self._aligners is None:
            self._build_aligners()
        return True

    def _build_aligners(self) -> None:
        """The aligner (one per undecided setting of skipping special tokens) for the
        decided mode."""
        vocab = continued(self.vocab) if self._continuation else self.vocab
        skips = [True, False] if self._skip is None else [self._skip]
        if self.prompt_ids:
            vocab = self.vocab  # the prompt itself takes the first-token rules
        self._aligners = {s: new_aligner(vocab, s, self.prompt_ids) for s in skips}
        self._primary = skips[0]

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
        index: int | GapRef | None,
        tid: int,
        logprob: float | None,
        top: tuple[tuple[int, float], ...] | None,
    ) -> None:
        assert self._aligners is not None and index is not None
        if self.on_token is not None:
            if isinstance(index, GapRef):
                self.on_token(TokenEvent(tid, logprob, top, refused=index.refused))
            else:
                self.on_token(TokenEvent(tid, logprob, top, index))
        if self._skipped(tid) is False:
            piece = self.vocab.pieces[tid] or b""
            if not self._text_seen and not self._continuation:
                piece = self.vocab.first_pieces.get(tid, piece)
            self._piece_pushed += len(piece)
            self._text_seen = True
        self._map.append(index)
        segments: list[Segment] = []
        if not self.alternatives:
            top = None
        for skip, aligner in self._aligners.items():  # two only until specials are decided
            out = aligner.push(tid, logprob, top)
            if skip == self._primary:
                segments = out
        self._take(segments)

    def _placeholders(self, data: bytes, refused: tuple[RefusedToken, ...]) -> None:
        """Stand-in tokens for bytes whose real tokens are unknown, so text stays exact."""
        self.refused.extend(refused)
        if not data:
            if self.on_token is not None:  # tokens with neither id nor bytes
                for ref in refused:
                    self.on_token(TokenEvent(None, None, None, ref.index, (ref,)))
            self._orphans.extend(refused)
            return
        ids = self._rev.split(data)
        ref = GapRef(refused)
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
            vocab = continued(self.vocab)
            self._aligners = {s: new_aligner(vocab, s) for s in self._aligners}
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
            starts = placements(rest, groups)
            if starts is None:
                reason = "its place in the text cannot be told, next to unidentified tokens"
                first = groups[1].obs
                at = len(run)
                for k, o in enumerate(first, at):
                    data = o.raw if o.kind == "gap" else self._own_bytes(o.id or 0)
                    refused = o.refused or (RefusedToken(o.index, reason),)
                    p[k] = Obs("unknown", o.index, None, o.logprob, o.top, data, refused)
                return True
            gap = rest[: starts[0]]
        claimed = [o.raw for o in run]
        if all(c is not None for c in claimed) and b"".join(c or b"" for c in claimed) == gap:
            # The content shows the very bytes claimed (a real U+FFFD, say): believed
            # from a server seen to send raw bytes, else refused at the end.
            ids = [self._lookup(c or b"") for c in claimed]
            if self.raw_seen and all(i is not None for i in ids):
                for o, tid in zip([p.popleft() for _ in run], ids, strict=True):
                    assert tid is not None
                    self._push(o.index, tid, o.logprob, o.top)
                return True
            if not final and not self.raw_seen:
                return False
        for _ in run:
            p.popleft()
        self._placeholders(gap, tuple(r for o in run for r in o.refused))
        return True

    def _groups(self) -> list[Group]:
        """The queue as alternating runs of unidentified and identified tokens."""
        out: list[Group] = []
        for o in self._pending:
            unknown = o.kind == "unknown"
            if not out or out[-1].unknown != unknown:
                out.append(Group(unknown))
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
            if not self.segments:  # only where the pushed tokens end in the content
                self._orphans.clear()  # their events were given already
                continue
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
                if isinstance(m, GapRef):
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
            if self.diverged is not None or u.startswith(seg.text):
                if self.diverged is None:
                    self._unconfirmed = u[len(seg.text) :]
                out.append(held.popleft())
                continue
            if seg.text.startswith(u):
                if not final:
                    break
                out.extend(self._cut_trailing())
                break
            at = len("".join(self._content)) - len(u) + first_difference(seg.text, u)
            self.diverged = (
                f"the tokens' text differs from the streamed content at character {at}: "
                f"{seg.text[:20]!r} vs {u[:20]!r}"
            )
            self._warn(self.diverged)
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
        self.trailing.extend(rest)
        if rest:
            first = rest[0].index
            self._warn(
                f"the streamed content ends before the tokens' text does: tokens from index "
                f"{first} on carry text the content does not have (a stop string the server "
                "removed?)"
            )
        return out
