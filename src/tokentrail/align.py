"""The streaming aligner: token ids in, final text segments with their tokens out.

Text is tracked as one global byte stream: every token owns the byte range
[gstart, gend) it appended. Decoding turns a prefix of that stream into final text;
each emitted segment covers the stream from the previous segment's end to the new
final position, and lists every token overlapping it with the offsets (within the
token's own bytes) it contributed. Nothing is ever re-decoded, so the cost per token is
O(1) amortised, and only bytes whose text can still change are held back.
"""

from __future__ import annotations

import codecs
import copy
import logging
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .byte_text import DECODE_ERRORS, CleanupStream, completed_char, show_bytes
from .segment import Alternative, OneTokenSegment, Segment, TokenSpan, new_span
from .vocab import Vocab, load_vocab

log = logging.getLogger(__name__)

TopLogprobs = Mapping[int, float] | Iterable[tuple[int, float]]


class _Keep:
    """Marker: keep the aligner's current prompt."""


_KEEP = _Keep()

_new_segment = object.__new__


class Aligner:
    """Turns a stream of token ids into final text segments with exact token attribution.

    >>> aligner = Aligner("path/to/tokenizer.json")          # doctest: +SKIP
    >>> for token_id, logprob in stream:                      # doctest: +SKIP
    ...     for segment in aligner.push(token_id, logprob):
    ...         print(segment.text, [t.id for t in segment.tokens])
    >>> rest = aligner.finish()                               # doctest: +SKIP

    The concatenated segment texts equal the tokenizer's own decode of the ids (with the
    same `skip_special_tokens`); emitted text never changes; every token appears in at
    least one segment, in order, with the byte range of its own bytes each one used.

    With `prompt_ids`, the stream continues that prompt: the prompt is read-only
    context, pushed through the same rules but never returned. `prompt_text` is the text
    the prompt alone made final; what `push`/`finish` return is exactly the rest, so
    `prompt_text + "".join(continuation texts) == decode(prompt_ids + ids)`. A prompt's
    still-open tail (half a character, a held-back space) comes out with the first
    continuation segment that completes it, listing the prompt tokens that carry it with
    negative `index` (-1 is the prompt's last token); continuation tokens count from 0.

    `reference` chooses whose decode the text equals (see `load_vocab`): "auto" (the
    format's own library; llama.cpp for GGUF files), "llama.cpp" or "transformers".
    """

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = False,
        prompt_ids: Sequence[int] | None = None,
        reference: str = "auto",
    ) -> None:
        self.vocab: Vocab = load_vocab(tokenizer, reference=reference)
        self.skip_special_tokens = bool(skip_special_tokens)
        v = self.vocab
        self._skipped = v.hidden | (v.special if skip_special_tokens else frozenset())
        self._mode = v.byte_mode
        self._pieces = v.pieces
        # Text for ids that take the fast path: not skipped, not byte fallback, valid UTF-8.
        fast = list(v.texts)
        for i in self._skipped | v.byte_ids:
            # sentencepiece decodes byte runs char by char, so an ASCII byte is final at
            # once; tokenizers' all-or-nothing runs must wait for the run to end.
            ascii_ok = self._mode == "spm_runs" and i not in self._skipped
            if 0 <= i < len(fast) and not (ascii_ok and (v.pieces[i] or b"\x80") < b"\x80"):
                fast[i] = None
        self._fast_text = fast
        self._lens = [0 if p is None else len(p) for p in v.pieces]
        self._edits = bool(v.run_edits)
        self._alt_cache: dict[int, tuple[bytes, str, str, bool]] = {}
        self._generic = v.generic
        self._holes = frozenset(i for i, p in enumerate(v.pieces) if p is None)
        self._prompt: tuple[int, ...] = self._check_prompt(prompt_ids)
        self.reset()

    def fresh(self, prompt_ids: Sequence[int] | _Keep | None = _KEEP) -> Aligner:
        """A new aligner over the same compiled tables, with an empty stream (cheap).

        It continues the same prompt as this one unless `prompt_ids` names another
        (None: no prompt)."""
        clone = object.__new__(Aligner)
        clone.__dict__.update(self.__dict__)
        clone.reset(prompt_ids)
        return clone

    def __copy__(self) -> Aligner:
        """A copy mid-stream that shares no mutable state with the original."""
        clone = object.__new__(Aligner)
        clone.__dict__.update(self.__dict__)
        clone._pending = deque(list(p) for p in self._pending)
        clone._dec = codecs.getincrementaldecoder("utf-8")(DECODE_ERRORS[self._mode])
        clone._dec.setstate(self._dec.getstate())
        clone._run_text = list(self._run_text)
        clone._clean = copy.deepcopy(self._clean)
        clone._ids = list(self._ids)
        return clone

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        """The prompt this stream continues (empty: none)."""
        return self._prompt

    def _check_prompt(self, prompt_ids: Sequence[int] | None) -> tuple[int, ...]:
        if prompt_ids is None:
            return ()
        if isinstance(prompt_ids, (str, bytes)):
            raise TypeError("prompt_ids must be a sequence of token ids, not a string")
        ids = tuple(prompt_ids)
        if all(type(i) is int for i in ids):
            in_range = not ids or (min(ids) >= 0 and max(ids) < len(self._pieces))
            if in_range and self._holes.isdisjoint(ids):
                return ids  # the common case, checked in fast passes (long prompts)
        for i in ids:
            try:
                self.vocab.check_id(i)
            except (TypeError, ValueError) as e:
                raise type(e)(f"prompt_ids: {e}") from None
        return tuple(int(i) for i in ids)

    # -- state ---------------------------------------------------------------------

    def reset(self, prompt_ids: Sequence[int] | _Keep | None = _KEEP) -> None:
        """Forget the stream; the next push starts a new sequence.

        The new sequence continues the same prompt as before, unless `prompt_ids`
        names another (None: no prompt)."""
        if not isinstance(prompt_ids, _Keep):
            self._prompt = self._check_prompt(prompt_ids)
        self._n = 0
        self._pos = 0  # bytes appended to the global stream
        self._done = 0  # bytes consumed by emitted segments (or dropped by rules)
        self._pending: deque[list[Any]] = deque()
        self._first = True
        self._strip = self.vocab.strip_leading
        self._dec = codecs.getincrementaldecoder("utf-8")(DECODE_ERRORS[self._mode])
        self._run = 0
        self._run_text: list[str] = []
        self._run_first = False  # the open run is the decode's first string (run_edits)
        self._poisoned = False
        self._clean = CleanupStream() if self.vocab.cleanup else None
        self._ids: list[int] = []  # generic path only
        self._emitted = ""  # generic path only
        self._update_fast()
        self.prompt_text = ""
        if self._prompt:
            self._prime(self._prompt)

    def _prime(self, prompt: Sequence[int]) -> None:
        """Push the prompt as context: its final text is kept as `prompt_text`, and
        its tokens take indices -len(prompt)..-1 so the continuation counts from 0."""
        self._n = -len(prompt)
        push = self.push
        fast_text = self._fast_text
        pieces = self._pieces
        parts: list[str] = []
        for i in prompt:
            if self._fast:
                text = fast_text[i]
                if text is not None:
                    # push()'s hot path without the segment nobody will read.
                    parts.append(text)
                    self._pos += len(pieces[i])  # type: ignore[arg-type]
                    self._n += 1
                    continue
            parts.extend(s.text for s in push(i))
        self.prompt_text = "".join(parts)

    def _update_fast(self) -> None:
        self._fast = (
            not self._pending
            and self._strip == 0
            and not (self._first and self.vocab.first_pieces)
            and self._clean is None
            and not self._poisoned
            and self._generic is None
        )

    @property
    def tokens_pushed(self) -> int:
        return self._n

    # -- public API ----------------------------------------------------------------

    def push(
        self,
        token_id: int,
        logprob: float | None = None,
        top_logprobs: TopLogprobs | None = None,
    ) -> list[Segment]:
        """Add one token; return the segments that became final with it (0 or 1)."""
        if self._fast and type(token_id) is int and token_id >= 0 and top_logprobs is None:
            # Nothing pending and a complete token: it is its own segment. (`_done`
            # equals `_pos` whenever nothing is pending; the slow path relies on it.)
            # `_fast_text` is None for ids outside the vocabulary, skipped ones and
            # partial characters, which take the general path below.
            try:
                text = self._fast_text[token_id]
            except IndexError:
                text = None
            if text is not None:
                idx = self._n
                self._n = idx + 1
                n = self._lens[token_id]
                self._pos += n
                if logprob is not None:
                    logprob = float(logprob)
                # object.__new__ plus two slot stores: no constructor frame (hot path).
                seg = _new_segment(OneTokenSegment)
                seg.text = text
                seg.tokens = (new_span(TokenSpan, (idx, token_id, 0, n, logprob, None, False)),)
                return [seg]
        pieces = self._pieces
        if type(token_id) is not int or not 0 <= token_id < len(pieces):
            self.vocab.check_id(token_id)
            token_id = int(token_id)
        piece = pieces[token_id]
        if piece is None:
            self.vocab.check_id(token_id)
        idx = self._n
        self._n = idx + 1
        if logprob is not None:
            logprob = float(logprob)
        top = None if top_logprobs is None else self.alternatives(top_logprobs)
        if self._fast:
            text = self._fast_text[token_id]
            if text is not None:
                # Nothing pending and a complete token: it is its own segment. (`_done`
                # equals `_pos` whenever nothing is pending; the slow path relies on it.)
                n = len(piece)
                self._pos += n
                span = new_span(TokenSpan, (idx, token_id, 0, n, logprob, top, False))
                return [OneTokenSegment(text, (span,))]
        if self._generic is not None:
            return self._push_generic(idx, token_id, logprob, top, final=False)
        return self._push_slow(idx, token_id, logprob, top)

    def finish(self) -> list[Segment]:
        """Flush what is held back, return the last segments and reset for a new stream."""
        if self._generic is not None:
            out = self._push_generic(-1, -1, None, None, final=True)
            self.reset()
            return out
        parts: list[str] = []
        if self._mode == "hf_runs":
            self._end_run(parts)
        else:
            parts.append(self._dec.decode(b"", True))
        text = self._strip_text("".join(parts))
        if self._clean is not None:
            text, _ = self._clean.feed(text, self._pos, final=True)
        out = self._emit(text, self._pos)
        self.reset()
        return out

    def align(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float | None] | None = None,
    ) -> list[Segment]:
        """Align a whole sequence at once: push every id, then finish."""
        segments: list[Segment] = []
        for i, token_id in enumerate(ids):
            lp = None if logprobs is None else logprobs[i]
            segments.extend(self.push(token_id, lp))
        segments.extend(self.finish())
        return segments

    # -- internals -----------------------------------------------------------------

    def alternatives(self, top: TopLogprobs) -> tuple[Alternative, ...]:
        """(id, logprob) pairs (or an id -> logprob mapping) as `Alternative`s with their
        bytes, text and display, for the step about to be pushed; the per-id lookups are
        cached for the life of the aligner.

        `display` is what the alternative would have shown after the incomplete UTF-8
        bytes held now: a character it completes, else its own bytes with any that make
        no complete character as `<0xNN>`. Held bytes combine with any token in a byte
        stream, and only with byte tokens inside byte-fallback runs (another token ends
        the run)."""
        kind = top.__class__  # (a list or tuple without the ABC check: the usual case)
        plain = kind is list or kind is tuple or not isinstance(top, Mapping)
        items = top if plain else top.items()
        out = []
        cache = self._alt_cache
        held = self._dec.getstate()[0] if self._pending else b""
        for tid, lp in items:
            tid = int(tid)
            hit = cache.get(tid)
            if hit is None:
                hit = self._alt_entry(tid)
                cache[tid] = hit
            raw, text, shown, joins = hit
            if held and joins:
                shown = completed_char(held, raw, shown)
            out.append(Alternative(tid, float(lp), raw, text, shown))
        return tuple(out)

    def _alt_entry(self, tid: int) -> tuple[bytes, str, str, bool]:
        """(bytes, text, display with nothing held, whether held bytes join it)."""
        v = self.vocab
        raw, text = v.token_bytes(tid), v.token_text(tid)
        shown = show_bytes(raw) if raw and tid not in v.hidden else text
        joins = bool(raw) and tid not in self._skipped and (
            self._mode == "stream" or tid in v.byte_ids
        )
        return raw, text, shown, joins

    def _end_run(self, parts: list[str]) -> None:
        """Close a byte-fallback run (tokenizers' all-or-nothing rule)."""
        if self._mode != "hf_runs":  # stream / spm_runs: flush the incomplete tail
            parts.append(self._dec.decode(b"", True))
            self._dec.reset()
            return
        if self._run and not self._poisoned:
            try:
                self._run_text.append(self._dec.decode(b"", True))
                text = "".join(self._run_text)
                parts.append(self.vocab.edit_run(text, self._run_first) if self._edits else text)
            except UnicodeDecodeError:
                parts.append(self._replacements(self._run, self._run_first))
        self._dec.reset()
        self._run = 0
        self._run_text = []
        self._poisoned = False

    def _replacements(self, n: int, first: bool) -> str:
        """The text of `n` bytes of an invalid byte-fallback run: one U+FFFD each (as the
        decoder's later steps leave it; `first`: the run starts the decode)."""
        if not self._edits:
            return "\ufffd" * n
        edit = self.vocab.edit_run
        return edit("\ufffd", first) + edit("\ufffd", False) * (n - 1) if n else ""

    def _strip_text(self, text: str) -> str:
        if self._strip and text:
            k = 0
            while k < len(text) and k < self._strip and text[k] == " ":
                k += 1
            text = text[k:]
            self._strip = 0 if text else self._strip - k
        return text

    def _push_slow(
        self, idx: int, token_id: int, logprob: float | None, top: tuple[Alternative, ...] | None
    ) -> list[Segment]:
        v = self.vocab
        mode = self._mode
        parts: list[str] = []
        start = self._pos
        if not self._pending:
            self._done = start  # the fast path does not keep `_done` up to date
        if token_id in self._skipped:
            if v.skipped_breaks_runs:
                self._end_run(parts)
        else:
            piece = self._pieces[token_id]
            was_first = self._first
            if self._first:
                first = v.first_pieces.get(token_id)
                if first is not None:
                    if self._strip:
                        # A first piece already lacks the leading spaces a Strip removes
                        # (`strip_leading`), so the span covers only the bytes the text
                        # has; an all-space piece leaves the rest of the count.
                        self._strip = self._strip - (len(piece) - len(first)) if not first else 0
                    piece = first
                # sentencepiece strips the dummy prefix of every piece until some text
                # has come out (a lone "▁" first leaves the next piece first too).
                self._first = v.first_until_text and not piece
            assert piece is not None
            if mode == "stream":
                parts.append(self._dec.decode(piece))
            elif token_id not in v.byte_ids:
                self._end_run(parts)
                parts.append(piece.decode("utf-8", "replace"))
            elif mode == "spm_runs":
                parts.append(self._dec.decode(piece))
            else:  # hf_runs, a byte token
                if not self._run:
                    self._run_first = was_first
                self._run += 1
                if self._poisoned:
                    parts.append(self._replacements(1, False))
                else:
                    try:
                        self._run_text.append(self._dec.decode(piece))
                    except UnicodeDecodeError:
                        self._poisoned = True
                        self._dec.reset()
                        self._run_text = []
                        parts.append(self._replacements(self._run, self._run_first))
            self._pos += len(piece)
        self._pending.append([idx, token_id, start, self._pos, logprob, top])

        # Where final text ends in the byte stream.
        if mode == "hf_runs":
            end = self._pos if self._poisoned else self._pos - self._run
        else:
            end = self._pos - len(self._dec.getstate()[0])
        text = self._strip_text("".join(parts))
        if self._clean is not None:
            text, clean_end = self._clean.feed(text, end)
            end = self._done if clean_end is None else clean_end
        out = self._emit(text, end)
        self._update_fast()
        return out

    def _push_generic(
        self,
        idx: int,
        token_id: int,
        logprob: float | None,
        top: tuple[Alternative, ...] | None,
        final: bool,
    ) -> list[Segment]:
        """Unknown decoder pipelines: re-decode everything (O(n) a token, still exact).

        Text is emitted once the full decode extends what was emitted and does not end
        in U+FFFD or whitespace that a later token might still change; tokens are
        attributed whole to the segment that emits their text.
        """
        if not final:
            self._ids.append(token_id)
            n = len(self._pieces[token_id] or b"")
            self._pending.append([idx, token_id, self._pos, self._pos + n, logprob, top])
            self._pos += n
        assert self._generic is not None
        full = self._generic(self._ids, self.skip_special_tokens)
        stable = full if final else full.rstrip("\ufffd \t\n")
        if not stable.startswith(self._emitted):
            if not final:
                return []
            # The decoder rewrote text that had looked final (no known pipeline does).
            # Text already sent cannot be taken back: say so rather than stay silent.
            log.warning(
                "%s: the decode rewrote already-emitted text; the stream differs from "
                "decode() after character %d",
                self.vocab.name,
                next(
                    (
                        i
                        for i, (a, b) in enumerate(zip(self._emitted, full, strict=False))
                        if a != b
                    ),
                    min(len(self._emitted), len(full)),
                ),
            )
            stable = self._emitted + full[len(self._emitted) :]
        text = stable[len(self._emitted) :]
        self._emitted = stable
        if not final and not text:
            return []
        return self._emit(text, self._pos)

    def _emit(self, text: str, end: int) -> list[Segment]:
        pend = self._pending
        done = self._done
        spans = []
        while pend:
            idx, tid, gs, ge, lp, top = pend[0]
            if gs < end or (gs == ge and gs <= end):
                spans.append(TokenSpan(idx, tid, max(done, gs) - gs, min(end, ge) - gs, lp, top))
                if ge > end:
                    break
                pend.popleft()
            else:
                break
        self._done = max(done, end)
        if not spans:
            return []
        return [Segment(text, tuple(spans))]
