"""The `Realigner`: chunks in, exact segments (with the tokens behind them) out.

It reads each chunk with its dialect's parser (`tokentrail.realign.dialects`),
identifies every token from what the wire carries (ids, ``token_id:N`` strings, raw
bytes, token strings), and hands them to its `Feeder` (`tokentrail.realign.feeding`),
which feeds an `Aligner`; a token it cannot identify is refused, never guessed, and its
text kept exact from the streamed content. `on_token` lets a caller follow every token
the aligner is given (`tokentrail.engines.upstream.engine` turns them into steps).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..segment import Segment, TokenSpan
from ..vocab import Vocab
from .dialects import llamacpp, parse_chunk, tokentrail, vllm
from .dialects import token_ids as token_id_strings
from .feeding import Feeder
from .placement import Obs
from .positions import Fold
from .result import (
    RealignedSegment,
    RealignError,
    RealignResult,
    RefusedToken,
    TokenHook,
)
from .settle import MAX_UNDESCRIBED, Counts
from .vocabmap import reverse
from .wire import REPLACEMENT, Frame, WireToken, token_string_bytes

log = logging.getLogger("tokentrail.realign")


def _lead(data: bytes, own: bytes) -> bytes | None:
    """The bytes before a token's own at the end of `data` (what llama.cpp's dropped
    frames held, sent with this one); None when `data` is not more than them."""
    if len(data) > len(own) and data.endswith(own):
        return data[: len(data) - len(own)]
    return None


def _first_each(pairs: Iterable[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """Alternatives as (id, logprob), each id once (its first listing)."""
    seen: set[int] = set()
    out = []
    for pair in pairs:
        if pair[0] not in seen:
            seen.add(pair[0])
            out.append(pair)
    return tuple(out)


def _note(warnings: list[str], message: str) -> None:
    """A warning: reported through the result (and the CLI's summary); logged for -v."""
    log.info("%s", message)
    warnings.append(message)


class Realigner(Counts):
    """Realigns one streamed choice: feed it chunks, get exact segments back.

    >>> r = Realigner("path/to/tokenizer.json")            # doctest: +SKIP
    >>> for chunk in chunks:                                # doctest: +SKIP
    ...     for seg in r.feed(chunk):
    ...         print(seg.text, seg.token_ids)
    >>> rest = r.finish(); result = r.result()              # doctest: +SKIP

    `skip_special_tokens` None (the default) follows the stream: a special token counts as
    skipped when the streamed content does not show its text. A segment is released only
    once the streamed content confirms its text, so output can lag the input a little.

    `on_token`, when given, is called with a `TokenEvent` for every token given to the
    aligner, in stream order: identified ones, and the stand-ins for tokens the stream
    did not identify (see `TokenEvent`). `alternatives` False leaves the alternatives
    out of the realigner's own segments (the events still carry them): for a subscriber
    that aligns the tokens again itself, as the proxy does, it saves a lookup of every
    alternative per token. `segments` False goes further, for a subscriber that wants
    only the events: `feed` and `finish` return no segments and `result` holds none
    (nor the text, nor the checks against the content that releasing them makes); the
    events are the same.
    """

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool | None = None,
        *,
        choice: int = 0,
        prompt_ids: Sequence[int] | None = None,
        on_token: TokenHook | None = None,
        alternatives: bool = True,
        segments: bool = True,
    ) -> None:
        from ..vocab import load_vocab

        self.vocab: Vocab = load_vocab(tokenizer)
        self.choice = choice
        #: The prompt the stream continues, when known: realigned in its context (its
        #: decoding rules, a character it left open), as `Aligner(prompt_ids=...)`.
        self.prompt_ids: tuple[int, ...] = tuple(prompt_ids or ())
        self._segments = segments
        self._rev = reverse(self.vocab)
        self._warnings: list[str] = []
        # The feeder warns into the same list, through a function that does not hold
        # this realigner: no reference cycle, so a finished stream's realigner, feeder
        # and segments are freed at once instead of waiting for a full collection.
        self._feeder = Feeder(
            self.vocab,
            skip_special_tokens,
            self.prompt_ids,
            warn=functools.partial(_note, self._warnings),
            on_token=on_token,
            alternatives=alternatives,
            segments=segments,
        )
        self._n = 0  # tokens seen
        self._n_chunks = 0
        self._refused: list[RefusedToken] = []
        self._errors: list[str] = []
        self._sources: list[str] = []
        self._ambiguous = 0
        self._alts_dropped = 0
        self._ext: list[RealignedSegment] | None = None
        self._ours: list[RealignedSegment] = []
        self._out: list[Segment] = []
        self._done = False
        self._result: RealignResult | None = None
        # Gaps whose token count the server did not say (llama.cpp's OpenAI endpoints):
        # the stream index at each, and its refused marker. Segments after the first
        # are held until the end, when usage.completion_tokens may settle the counts.
        self._open_gaps: list[Fold] = []
        #: Counts sent mid-stream: raw index of a chunk's last entry -> tokens up to it.
        self._pins: dict[int, int] = {}
        self._unbacked = 0  # tokens counted with neither data nor bytes (MAX_UNDESCRIBED)
        self._deferred: list[Segment] = []
        self._total: int | None = None
        self._total_at = 0  # entries seen when the last count came
        self._total_pin = False  # it came with entries (it counts up to them, not the end)
        self._finish: str | None = None  # the choice's finish_reason
        self._chat = False  # a chat stream (llama.cpp lists no entry for a textless token)
        self._llama = False  # entries with llama.cpp's ids and bytes
        self._stop_cut_at = -1  # the last entry whose bytes did not end with its token's
        self._multi = False
        self._cut_gap = False  # the next gap's last token was cut short by a stop string
        self._trailing: list[TokenSpan] = []

    # -- public ------------------------------------------------------------------------------

    @property
    def on_token(self) -> TokenHook | None:
        """What each `TokenEvent` is given to (None: nobody); may be set before feeding."""
        return self._feeder.on_token

    @on_token.setter
    def on_token(self, hook: TokenHook | None) -> None:
        self._feeder.on_token = hook

    @property
    def errors(self) -> list[str]:
        """Error bodies the server sent so far (``{"error": ...}``), one line each."""
        return list(self._errors)

    def prime(self) -> None:
        """Do now the setup the first chunk would otherwise pay for, where it does not
        depend on what the stream sends (the aligner over a known `prompt_ids`); call
        it while waiting for the first chunk. Optional: results are the same."""
        self._feeder.prime()

    def feed(self, chunk: Mapping[str, Any]) -> list[Segment]:
        """Add one parsed chunk; return the segments its content confirmed (maybe none)."""
        if self._done:
            raise RuntimeError("this Realigner is finished; make a new one for a new stream")
        self._n_chunks += 1
        if chunk.__class__ is dict and self._ext is None:
            # The usual frames of llama.cpp's /completion and of vLLM's /v1/completions
            # (the proxy's two native upstreams), read directly: see `_plain_token` and
            # `_plain_ids_token`.
            if "choices" in chunk:
                ids = vllm.plain_frame(chunk, self.choice)
                if ids is not None and self._plain_ids_token(ids):
                    return self._released(self._feeder.advance())
            else:
                plain = llamacpp.plain_frame(chunk)
                if plain is not None and self._plain_token(plain):
                    return self._released(self._feeder.advance())
        where = f"chunk {self._n_chunks}"
        frame = parse_chunk(chunk, self.choice, where)
        if frame is None:
            return []
        if frame.error is not None:
            self._errors.append(f"{where}: the server answered an error: {frame.error}")
            self._warn(self._errors[-1])
            return []
        self._feeder.add_content(frame.content)
        ext_segments: list[RealignedSegment] = []
        if frame.ext is not None:
            frame, ext_segments = self._read_extension(frame, where)
        elif self._ext is not None and frame.tokens:
            self._warn(f"{where} carries tokens but no tokentrail extension")
        if frame.other_choices:
            self._multi = True
        self._observe(frame, where)
        self._chat = self._chat or frame.chat
        if frame.finish is not None:
            self._finish = frame.finish
        if frame.total is not None:
            # The last count sent is the total only if no entry came after it; one sent
            # with entries also says how many tokens came up to its last entry.
            self._total = frame.total
            self._total_at = self._n
            self._total_pin = bool(frame.tokens) and frame.first_index is None
            if self._total_pin:
                self._pins[self._n - 1] = frame.total
        return self._released(self._feeder.advance(), ext_segments)

    def _released(
        self, released: list[Segment], ext_segments: Sequence[RealignedSegment] = ()
    ) -> list[Segment]:
        """What `feed` returns of the segments the feeder released after one chunk."""
        if not self._segments:
            return []
        if (self._open_gaps or (self._chat and self._llama)) and self._ext is None:
            # Positions may still move: after a fold of unknown count, and on llama.cpp's
            # chat streams, where only the counts at the end can show unlisted tokens.
            self._deferred.extend(released)
            return []
        if self._ext is not None:
            self._ours.extend(released)
            self._out.extend(ext_segments)
            return list(ext_segments)
        self._out.extend(released)
        return released

    def finish(self) -> list[Segment]:
        """End of stream: flush what is held, settle every open question."""
        if self._done:
            raise RuntimeError("finish() was already called")
        self._done = True
        if self._n == 0 and not self._feeder.queued and self._feeder.content:
            raise RealignError(
                "the stream carries no per-token data: ask the server for logprobs "
                "(or vLLM's return_token_ids), or use tokentrail's server"
            )
        released = self._feeder.finish()
        self._refused = list(self._feeder.refused)
        self._trailing = list(self._feeder.trailing)
        released = self._settle_counts(self._deferred + released)
        self._deferred = []
        if not self._segments:
            return []
        if self._ext is not None:
            self._ours.extend(released)
            return []
        self._out.extend(released)
        return released

    def result(self) -> RealignResult:
        """The outcome; finishes the stream first if needed."""
        if not self._done:
            self.finish()
        if self._result is not None:
            return self._result
        agrees = None
        if self._ext is not None:
            disagreement = tokentrail.compare(self._ext, self._ours)
            if disagreement is not None:
                self._warn(disagreement)
            agrees = disagreement is None
        if self._alts_dropped:
            self._warn(
                f"{self._alts_dropped} alternative(s) in top_logprobs could not be identified "
                "and were left out"
            )
        text = "".join(s.text for s in self._out)
        self._result = RealignResult(
            segments=list(self._out),
            source="+".join(self._sources) or "none",
            text=text,
            content=self._feeder.content,
            tokens=self._n,
            refused=list(self._refused),
            trailing=list(self._trailing),
            ambiguous=self._ambiguous,
            warnings=list(self._warnings),
            errors=list(self._errors),
            extension_agrees=agrees,
        )
        return self._result

    def realign(self, chunks: Iterable[Mapping[str, Any]]) -> RealignResult:
        """Feed every chunk, finish, and return the result."""
        for chunk in chunks:
            self.feed(chunk)
        return self.result()

    # -- reading the wire --------------------------------------------------------------------

    def _warn(self, message: str) -> None:
        _note(self._warnings, message)

    def _source(self, name: str) -> None:
        if name and name not in self._sources:
            self._sources.append(name)

    def _read_extension(self, frame: Frame, where: str) -> tuple[Frame, list[RealignedSegment]]:
        """tokentrail's extension: its token ids replace the frame's own (they feed the
        check), its segments are the output."""
        ext = tokentrail.parse_extension(frame, where)
        if self._ext is None:
            self._ext = []
        self._source(tokentrail.NAME)
        self._ext.extend(ext.segments)
        warning = ext.misnumbered(self._n, where)
        if warning is not None:
            self._warn(warning)
        own = replace(frame, tokens=list(ext.tokens), first_index=None, folded_content=False)
        return own, list(ext.segments)

    def _identify(
        self, w: WireToken, main: bool = True
    ) -> tuple[int | None, bytes | None, str | None]:
        """(id, claimed bytes, why not) for one wire token (`main`: not an alternative)."""
        v = self.vocab
        if w.id is not None:
            if not v.has_id(w.id):
                return None, w.raw, f"id {w.id} is outside the vocabulary of {v.name}"
            return w.id, w.raw, None
        tok = w.token
        if token_id_strings.claims(tok):
            assert tok is not None
            tid, why = token_id_strings.identify(tok, v)
            return tid, None, why
        raw = w.raw
        from_token = token_string_bytes(tok) if tok is not None else None
        if raw is None:
            raw = from_token
        if raw is None:
            return None, None, "the stream gives neither an id nor bytes for it"
        if not self._feeder.raw_seen:
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                self._feeder.raw_seen = True  # a server that sends raw bytes: U+FFFD is U+FFFD
        if REPLACEMENT in raw and (main or not self._feeder.raw_seen):
            # Believed only from a server seen to send raw bytes, and (for a generated
            # token) once the content shows the same bytes: see _close_unknown.
            why = "its bytes are U+FFFD, a stand-in servers send for bytes not valid UTF-8 alone"
            return None, raw, why
        for key in (raw, from_token):
            if key:
                ids = self._rev.ids.get(key)
                if ids:
                    if len(ids) > 1 and main:
                        self._ambiguous += 1
                    return ids[0], raw, None
        if tok is not None and tok in self._rev.names:
            return self._rev.names[tok], raw, None
        if not raw:
            return None, raw, "it has no bytes and no name that identifies it"
        return None, raw, f"its bytes match no token of {v.name}"

    def _alternatives(self, wires: list[WireToken] | None) -> tuple[tuple[int, float], ...] | None:
        if not wires:
            return None
        pairs = []
        has_id = self.vocab.has_id
        for w in wires:
            tid = w.id
            if tid is None or not has_id(tid):  # (an id in the vocabulary is itself)
                tid, _, _ = self._identify(w, main=False)
            if tid is None or w.logprob is None:
                self._alts_dropped += 1
                continue
            pairs.append((tid, w.logprob))
        return _first_each(pairs)

    def _piece(self, tid: int) -> bytes:
        """What a token adds to a llama.cpp frame: specials add nothing there."""
        v = self.vocab
        if tid in v.special or tid in v.hidden:
            return b""
        return v.pieces[tid] or b""

    def _plain_token(self, plain: llamacpp.PlainFrame) -> bool:
        """`_observe` for llama.cpp's usual frame (`llamacpp.plain_frame`), without its
        `Frame` and `WireToken`s, where reading it takes none of `_observe`'s other
        turns: the count says it is the next token, its id and its alternatives' ids are
        in the vocabulary, and the content holds no bytes of frames llama.cpp dropped.
        False (nothing read yet, the content included): the general path reads it."""
        content, tid, lp, alts, n = plain
        has_id = self.vocab.has_id
        if n - 1 != self._n or not has_id(tid):
            return False
        if _lead(content.encode("utf-8"), self._piece(tid)) is not None:
            return False  # a content gap: see _observe
        for alt in alts:
            if not has_id(alt[0]):
                return False  # identified by its bytes: see _alternatives
        top = _first_each(alts) if alts else None
        self._feeder.add_content(content)
        self._source("llama.cpp")
        self._n = n
        self._feeder.add(Obs("token", n - 1, tid, lp, top))
        return True

    def _plain_ids_token(self, plain: vllm.PlainFrame) -> bool:
        """`_observe` for vLLM's usual completions frame (`vllm.plain_frame`), without
        its `Frame` and `WireToken`s, where reading it takes none of the general path's
        other turns: its id is in the vocabulary, and so is every alternative's
        ``token_id:N``. False (nothing read yet, the text included): the general path
        reads it."""
        text, tid, lp, alts = plain
        vocab = self.vocab
        if not vocab.has_id(tid):
            return False
        top = None
        if alts is not None:
            pairs = []
            for name, value in alts:
                if not token_id_strings.claims(name):
                    return False  # identified by its bytes: see _alternatives
                aid, _ = token_id_strings.identify(name, vocab)
                if aid is None:
                    return False  # left out, and counted: see _alternatives
                pairs.append((aid, value))
            top = _first_each(pairs)
        self._feeder.add_content(text)
        self._source(vllm.NAME)
        idx = self._n
        self._n += 1
        self._feeder.add(Obs("token", idx, tid, lp, top))
        return True

    def _observe(self, frame: Frame, where: str) -> None:
        """Turn a frame's wire tokens into observations queued for the aligner."""
        dropped: list[int] = []
        sent = frame.content.encode("utf-8")
        if frame.first_index is not None:
            jump = frame.first_index - self._n
            # Tokens whose frames were dropped send their bytes with this one: a count
            # past its bytes is of tokens nobody described (`MAX_UNDESCRIBED`).
            self._unbacked += max(0, jump - len(sent))
            if self._unbacked > MAX_UNDESCRIBED:
                raise RealignError(
                    f"{where}: tokens_predicted says {jump} tokens came without frames "
                    f"since the last one, and the stream's counts now hold more than "
                    f"{MAX_UNDESCRIBED} tokens without data or bytes: not a fold"
                )
            if frame.first_index > self._n:
                dropped = list(range(self._n, frame.first_index))
                self._n = frame.first_index
            elif frame.first_index < self._n:
                self._warn(f"{where}: tokens_predicted goes backwards; indices are approximate")
        content_gap = None
        if (
            frame.folded_content
            and frame.tokens
            and all(w.id is not None and not w.folded and self.vocab.has_id(w.id)
                    for w in frame.tokens)
        ):
            # llama.cpp without byte data: its content holds what dropped frames held.
            own = b"".join(self._piece(w.id) for w in frame.tokens if w.id is not None)
            content_gap = _lead(sent, own)
        for k, w in enumerate(frame.tokens):
            self._source(w.source)
            self._llama = self._llama or w.folded
            tid, raw, why = self._identify(w)
            gap = content_gap if k == 0 else None
            if w.folded and tid is not None and raw is not None:
                own = self._piece(tid)
                lead = _lead(raw, own)
                if lead is not None:
                    gap = lead
                elif raw not in (own, self.vocab.pieces[tid]):
                    # At a stop string llama.cpp puts the text it held back (the part of
                    # the straddling token before the stop) on the entry of the token
                    # that completed the stop: those bytes are the held tokens', and this
                    # token's own bytes are past the content (the feeder cuts them off).
                    self._warn(
                        f"{where}: llama.cpp sent bytes {list(raw)} for token {tid}, whose "
                        f"bytes are {list(own)}: taken as the bytes of tokens it sent no "
                        "entry for (a stop string cut this token off?)"
                    )
                    gap = raw
                    self._cut_gap = True
                    self._stop_cut_at = self._n
            if gap:
                self._gap(gap, dropped)
                dropped = []
            self._dropped(dropped)
            dropped = []
            idx = self._n
            self._n += 1
            top = self._alternatives(w.top)
            if tid is None:
                shown = w.token if w.token is not None else (repr(raw) if raw else None)
                ref = RefusedToken(idx, why or "unidentified", shown)
                self._feeder.add(Obs("unknown", idx, None, w.logprob, top, raw, (ref,)))
            else:
                self._feeder.add(Obs("token", idx, tid, w.logprob, top))
        self._dropped(dropped)

    def _dropped(self, indices: list[int]) -> None:
        """Tokens the server counted but sent nothing about."""
        for idx in indices:
            ref = RefusedToken(idx, "the server generated it but sent no data for it")
            self._feeder.add(Obs("unknown", idx, raw=None, refused=(ref,)))

    def _gap(self, data: bytes, dropped: list[int]) -> None:
        """Bytes sent with a llama.cpp frame whose own token did not carry them."""
        reason = (
            "llama.cpp sent no frame for it (its bytes left an incomplete character or a "
            "possible stop string), and folded its bytes into the next frame"
        )
        if dropped:
            refused = tuple(RefusedToken(i, reason) for i in dropped)
        else:
            refused = (RefusedToken(None, reason + "; the server did not say how many"),)
        shown = data.decode("utf-8", "backslashreplace")
        refused = tuple(RefusedToken(r.index, r.reason, shown) for r in refused)
        if not dropped:
            self._open_gaps.append(Fold(self._n, refused[0], data, self._cut_gap))
        self._cut_gap = False
        self._feeder.add(Obs("gap", None, raw=data, refused=refused))


def realign(
    chunks: Iterable[Mapping[str, Any]],
    tokenizer: Any,
    skip_special_tokens: bool | None = None,
    *,
    choice: int = 0,
    prompt_ids: Sequence[int] | None = None,
) -> RealignResult:
    """Realign a whole stream of parsed chunks with `tokenizer` (see `Realigner`)."""
    r = Realigner(tokenizer, skip_special_tokens, choice=choice, prompt_ids=prompt_ids)
    return r.realign(chunks)
