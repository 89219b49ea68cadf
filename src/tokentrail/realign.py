"""Rebuild exact segments, with token attribution, from any OpenAI-compatible stream.

`Realigner` reads the chunks a server streamed (parsed JSON objects), recovers the id of
every generated token from what the wire carries, and runs them through the `Aligner`,
so each segment of text comes with the tokens that made it, their logprobs and their
alternatives. Token ids are recovered, best first, from:

- tokentrail's own ``"tokentrail"`` extension (`tokentrail.server`): the segments are
  passed through, and checked against a realignment of the extension's token ids;
- explicit ids: vLLM's ``token_ids`` on each choice (``return_token_ids``),
  ``token_id:N`` token strings (vLLM's ``return_tokens_as_token_ids``), the ``id`` of
  llama.cpp's ``completion_probabilities`` entries;
- raw bytes: the ``bytes`` of OpenAI-style logprobs, or the token strings themselves
  (OpenAI's ``bytes:\\xe2\\x80`` form for bytes that are not UTF-8 on their own), mapped
  back to ids through the tokenizer's vocabulary.

Servers are not always faithful. Many send a token that is not valid UTF-8 on its own as
U+FFFD (bytes EF BF BD), and llama.cpp sends no frame at all for a token that leaves an
incomplete character, folding its bytes into the next frame. Such tokens cannot be
identified; the realigner says so (`RealignedSegment.refused`, `RealignResult.lossy`)
and keeps its text exact from the streamed content, instead of guessing. Nothing is
released until the streamed content confirms it; a disagreement is reported, never
papered over.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

from .align import Aligner
from .segment import Alternative, Segment, TokenSpan
from .stops import split_segment
from .vocab import Vocab

log = logging.getLogger(__name__)

#: UTF-8 of U+FFFD, the stand-in servers send for bytes that are not text on their own.
REPLACEMENT = "\ufffd".encode()
#: Logprobs at or below this are "minus infinity" on the wire: OpenAI and vLLM send
#: -9999.0, llama.cpp the lowest float.
WIRE_NEG_INF = -9999.0

_BYTES_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})|(.)", re.S)

# Ranks of ids that share bytes: the first one is used.
_PLAIN, _BYTE, _SPECIAL, _HIDDEN = range(4)


class RealignError(ValueError):
    """A chunk could not be understood: it names the chunk and the field."""


@dataclass(frozen=True, slots=True)
class RefusedToken:
    """A token the stream did not identify, so no text is attributed to it.

    `index` is its position among the generated tokens, or None when the server did not
    say how many tokens a missing frame held. `reported` is what the wire said about it.
    """

    index: int | None
    reason: str
    reported: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index, "reason": self.reason}
        if self.reported is not None:
            out["reported"] = self.reported
        return out


@dataclass(slots=True)
class RealignedSegment(Segment):
    """A segment rebuilt from a stream; `refused` lists unidentified tokens behind its text."""

    refused: tuple[RefusedToken, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = Segment.to_dict(self)
        if self.refused:
            out["refused"] = [r.to_dict() for r in self.refused]
        return out


@dataclass
class RealignResult:
    """Everything `realign` found: the segments and how far they can be trusted.

    `exact` is True when every token was identified (`lossy` False), the segments' text
    equals the streamed content, and a tokentrail extension, if any, agreed. `trailing`
    are tokens whose text the content does not have (a stop string the server cut off).
    """

    segments: list[Segment]
    source: str
    text: str
    content: str
    tokens: int
    refused: list[RefusedToken] = field(default_factory=list)
    trailing: list[TokenSpan] = field(default_factory=list)
    ambiguous: int = 0
    warnings: list[str] = field(default_factory=list)
    extension_agrees: bool | None = None

    @property
    def lossy(self) -> bool:
        return bool(self.refused)

    @property
    def content_matches(self) -> bool:
        return self.text == self.content

    @property
    def exact(self) -> bool:
        return not self.lossy and self.content_matches and self.extension_agrees is not False

    def summary(self) -> str:
        """One line saying what is wrong (or that nothing is)."""
        parts = []
        if self.refused:
            shown = [str(r.index) if r.index is not None else "?" for r in self.refused[:8]]
            more = ", ..." if len(self.refused) > 8 else ""
            parts.append(
                f"lossy stream ({self.source}): attribution refused for "
                f"{len(self.refused)} token(s) (indices {', '.join(shown)}{more}): "
                f"{self.refused[0].reason}"
            )
        if not self.content_matches:
            at = _first_difference(self.text, self.content)
            parts.append(
                f"the segments' text differs from the streamed content at character {at} "
                f"({self.text[at : at + 12]!r} vs {self.content[at : at + 12]!r})"
            )
        if self.extension_agrees is False:
            parts.append("the tokentrail extension disagrees with the realignment")
        if not parts:
            return f"exact: {self.tokens} tokens from {self.source}"
        return "; ".join(parts)


# -- what a chunk carries --------------------------------------------------------------------


@dataclass(slots=True)
class _Wire:
    """One token as the wire describes it, before its id is known."""

    id: int | None = None
    token: str | None = None
    raw: bytes | None = None
    logprob: float | None = None
    top: list[_Wire] | None = None
    source: str = ""
    #: llama.cpp entry: `raw` is everything sent with this token, dropped frames included.
    folded: bool = False


@dataclass(slots=True)
class _Frame:
    """The part of one chunk that matters here."""

    content: str = ""
    tokens: list[_Wire] = field(default_factory=list)
    ext: Mapping[str, Any] | None = None
    #: llama.cpp: position of the frame's first token (from tokens_predicted).
    first_index: int | None = None
    #: llama.cpp: the frame's content holds the text of its tokens plus dropped ones.
    folded_content: bool = False
    error: str | None = None


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _logprob(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RealignError(f"{where}: logprob must be a number, got {_type_name(value)}")
    value = float(value)
    if math.isnan(value):
        return None
    return -math.inf if value <= WIRE_NEG_INF else value


def _prob_to_logprob(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RealignError(f"{where}: prob must be a number, got {_type_name(value)}")
    return math.log(value) if value > 0 else -math.inf


def _byte_list(value: Any, where: str) -> bytes | None:
    if value is None:
        return None
    try:
        if isinstance(value, list):
            return bytes(value)
    except (TypeError, ValueError):
        pass
    raise RealignError(f"{where}: bytes must be a list of integers 0..255")


def _text(value: Any, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RealignError(f"{where} must be a string, got {_type_name(value)}")
    return value


def token_string_bytes(token: str) -> bytes:
    """The bytes a token string stands for.

    OpenAI writes a token that is not valid UTF-8 as ``bytes:\\xe2\\x80`` (backslash
    escapes, literal characters for the rest); any other string is its UTF-8.
    """
    if token.startswith("bytes:") and "\\x" in token:
        out = bytearray()
        for m in _BYTES_ESCAPE.finditer(token, 6):
            if m.group(1) is not None:
                out.append(int(m.group(1), 16))
            else:
                out += m.group(2).encode("utf-8")
        return bytes(out)
    return token.encode("utf-8")


def _entry(e: Any, where: str, source: str) -> _Wire:
    """A logprobs entry: OpenAI chat (token, logprob, bytes, top_logprobs) or llama.cpp."""
    if not isinstance(e, Mapping):
        raise RealignError(f"{where}: expected an object, got {_type_name(e)}")
    tid = e.get("id")
    if tid is not None and not _is_int(tid):
        raise RealignError(f"{where}.id must be an integer, got {_type_name(tid)}")
    token = e.get("token", e.get("tok_str", e.get("content")))
    if token is not None and not isinstance(token, str):
        raise RealignError(f"{where}.token must be a string, got {_type_name(token)}")
    if "logprob" in e:
        lp = _logprob(e["logprob"], f"{where}.logprob")
    else:
        lp = _prob_to_logprob(e.get("prob"), f"{where}.prob")
    top_src = next((e[k] for k in ("top_logprobs", "top_probs", "probs") if k in e), None)
    top = None
    if top_src is not None:
        if not isinstance(top_src, list):
            raise RealignError(f"{where}.top_logprobs must be a list, got {_type_name(top_src)}")
        top = [_entry(t, f"{where}.top_logprobs[{k}]", source) for k, t in enumerate(top_src)]
    raw = _byte_list(e.get("bytes"), f"{where}.bytes")
    return _Wire(tid, token, raw, lp, top, source if tid is None else "llama.cpp-ids")


def _sourced(w: _Wire) -> _Wire:
    """Name how the token is identified, for `RealignResult.source`."""
    if w.id is not None:
        return w
    if w.token is not None and w.token.startswith("token_id:"):
        w.source = "token-id-strings"
    elif w.raw is not None:
        w.source = "logprob-bytes"
    else:
        w.source = "token-strings"
    return w


def _attach(ids: Any, entries: list[_Wire], where: str, frame: _Frame) -> None:
    """vLLM `token_ids`: the ids, with the logprobs entries (same order) attached."""
    if not isinstance(ids, list) or not all(_is_int(i) for i in ids):
        raise RealignError(f"{where}.token_ids must be a list of integers")
    if entries and len(entries) != len(ids):
        raise RealignError(f"{where}: {len(ids)} token_ids but {len(entries)} logprobs entries")
    for k, tid in enumerate(ids):
        e = entries[k] if entries else None
        frame.tokens.append(
            _Wire(
                tid,
                logprob=e.logprob if e else None,
                top=e.top if e else None,
                source="vllm-token-ids",
            )
        )


def _chat_choice(ch: Mapping[str, Any], where: str, frame: _Frame) -> None:
    body = ch.get("delta", ch.get("message"))
    if body is not None and not isinstance(body, Mapping):
        raise RealignError(f"{where}.delta must be an object, got {_type_name(body)}")
    frame.content = _text((body or {}).get("content"), f"{where}.delta.content")
    lps = ch.get("logprobs")
    entries: list[_Wire] = []
    if lps is not None:
        if not isinstance(lps, Mapping):
            raise RealignError(f"{where}.logprobs must be an object, got {_type_name(lps)}")
        content = lps.get("content") or []
        if not isinstance(content, list):
            raise RealignError(f"{where}.logprobs.content must be a list")
        entries = [
            _sourced(_entry(e, f"{where}.logprobs.content[{k}]", "")) for k, e in enumerate(content)
        ]
    if ch.get("token_ids") is not None:
        _attach(ch["token_ids"], entries, where, frame)
    else:
        frame.tokens.extend(entries)


def _completion_choice(ch: Mapping[str, Any], where: str, frame: _Frame) -> None:
    frame.content = _text(ch.get("text"), f"{where}.text")
    lps = ch.get("logprobs")
    entries: list[_Wire] = []
    if lps is not None:
        if not isinstance(lps, Mapping):
            raise RealignError(f"{where}.logprobs must be an object, got {_type_name(lps)}")
        tokens = lps.get("tokens") or []
        values = lps.get("token_logprobs") or []
        tops = lps.get("top_logprobs") or []
        for name, v in (("tokens", tokens), ("token_logprobs", values), ("top_logprobs", tops)):
            if not isinstance(v, list):
                raise RealignError(f"{where}.logprobs.{name} must be a list")
        for k, tok in enumerate(tokens):
            if not isinstance(tok, str):
                raise RealignError(f"{where}.logprobs.tokens[{k}] must be a string")
            lp = None
            if k < len(values):
                lp = _logprob(values[k], f"{where}.logprobs.token_logprobs[{k}]")
            top = None
            alts = tops[k] if k < len(tops) else None
            if alts is not None:
                if not isinstance(alts, Mapping):
                    raise RealignError(f"{where}.logprobs.top_logprobs[{k}] must be an object")
                top = [
                    _sourced(_Wire(token=str(t), logprob=_logprob(v, f"{where}.top_logprobs")))
                    for t, v in alts.items()
                ]
            entries.append(_sourced(_Wire(token=tok, logprob=lp, top=top)))
    if ch.get("token_ids") is not None:
        _attach(ch["token_ids"], entries, where, frame)
    else:
        frame.tokens.extend(entries)


def _llama_frame(chunk: Mapping[str, Any], where: str) -> _Frame:
    """A llama.cpp /completion object (one streamed frame, or a whole response)."""
    frame = _Frame(content=_text(chunk.get("content"), f"{where}.content"), folded_content=True)
    probs = chunk.get("completion_probabilities") or []
    if not isinstance(probs, list):
        raise RealignError(f"{where}.completion_probabilities must be a list")
    entries = [
        _entry(e, f"{where}.completion_probabilities[{k}]", "llama.cpp")
        for k, e in enumerate(probs)
    ]
    ids = chunk.get("tokens")
    if ids is not None and (not isinstance(ids, list) or not all(_is_int(i) for i in ids)):
        raise RealignError(f"{where}.tokens must be a list of integers")
    ids = ids or []
    if ids:
        # The token ids are complete; entries may miss tokens whose frame was dropped.
        k = 0
        for tid in ids:
            if k < len(entries) and entries[k].id in (tid, None):
                e = entries[k]
                k += 1
                frame.tokens.append(_Wire(tid, e.token, None, e.logprob, e.top, "llama.cpp"))
            else:
                frame.tokens.append(_Wire(tid, source="llama.cpp"))
        if k < len(entries):
            raise RealignError(f"{where}: completion_probabilities name ids that are not in tokens")
    else:
        for e in entries:
            if e.id is not None:
                e.source = "llama.cpp"
                e.folded = e.raw is not None
            frame.tokens.append(e if e.id is not None else _sourced(e))
    n = chunk.get("tokens_predicted")
    # A streamed frame's tokens are the last ones generated; so are none in the final
    # frame. A whole response's count says how many are missing, not where.
    if _is_int(n) and (not chunk.get("stop") or not frame.tokens):
        frame.first_index = n - len(frame.tokens)
    return frame


def _pick_choice(choices: Any, choice: int, where: str) -> Mapping[str, Any] | None:
    if not isinstance(choices, list):
        raise RealignError(f"{where}.choices must be a list, got {_type_name(choices)}")
    for k, ch in enumerate(choices):
        if not isinstance(ch, Mapping):
            raise RealignError(f"{where}.choices[{k}] must be an object, got {_type_name(ch)}")
        if ch.get("index", k) == choice:
            return ch
    return None


def parse_chunk(chunk: Any, choice: int = 0, where: str = "chunk") -> _Frame | None:
    """What one chunk says about choice `choice`; None when it says nothing (usage)."""
    if not isinstance(chunk, Mapping):
        raise RealignError(f"{where}: expected a JSON object, got {_type_name(chunk)}")
    ext = chunk.get("tokentrail")
    if ext is not None and not isinstance(ext, Mapping):
        raise RealignError(f"{where}.tokentrail must be an object, got {_type_name(ext)}")
    if "choices" in chunk:
        ch = _pick_choice(chunk["choices"], choice, where)
        if ch is None:
            return _Frame(ext=ext) if ext is not None else None
        frame = _Frame(ext=ext)
        here = f"{where}.choices[{choice}]"
        if "delta" in ch or "message" in ch:
            _chat_choice(ch, here, frame)
        elif "text" in ch:
            _completion_choice(ch, here, frame)
        else:
            raise RealignError(f"{here} has neither 'delta', 'message' nor 'text'")
        return frame
    if "content" in chunk and any(
        k in chunk for k in ("stop", "completion_probabilities", "tokens", "id_slot")
    ):
        return _llama_frame(chunk, where)
    if ext is not None:
        return _Frame(ext=ext)
    if "error" in chunk:
        err = chunk["error"]
        msg = err.get("message") if isinstance(err, Mapping) else err
        return _Frame(error=str(msg))
    raise RealignError(
        f"{where}: not a chunk of a known format (no 'choices', no llama.cpp "
        "'content' and 'stop', no 'tokentrail')"
    )


# -- the vocabulary, read backwards ----------------------------------------------------------


class _Reverse:
    """bytes -> ids, and token names -> ids, for one vocabulary."""

    def __init__(self, vocab: Vocab) -> None:
        ranked: dict[bytes, list[tuple[int, int]]] = {}
        for i, piece in enumerate(vocab.pieces):
            if not piece:
                continue
            if i in vocab.hidden:
                rank = _HIDDEN
            elif i in vocab.special:
                rank = _SPECIAL
            elif i in vocab.byte_ids:
                rank = _BYTE
            else:
                rank = _PLAIN
            ranked.setdefault(piece, []).append((rank, i))
        self.ids: dict[bytes, tuple[int, ...]] = {}
        self.plain: dict[bytes, int] = {}
        longest = 1
        for piece, cands in ranked.items():
            cands.sort()
            self.ids[piece] = tuple(i for _, i in cands)
            if cands[0][0] <= _BYTE:
                self.plain[piece] = cands[0][1]
                longest = max(longest, len(piece))
        self.longest = longest
        self.names: dict[str, int] = {}
        for i, name in vocab.names.items():
            self.names.setdefault(name, i)
        for i in sorted(vocab.special | vocab.hidden):
            piece = vocab.pieces[i] if 0 <= i < len(vocab.pieces) else None
            if piece:
                self.names.setdefault(piece.decode("utf-8", "replace"), i)

    def split(self, data: bytes) -> list[int] | None:
        """Some ids (longest match first) whose pieces spell `data`, or None."""
        out = []
        pos = 0
        while pos < len(data):
            for n in range(min(self.longest, len(data) - pos), 0, -1):
                tid = self.plain.get(data[pos : pos + n])
                if tid is not None:
                    out.append(tid)
                    pos += n
                    break
            else:
                return None
        return out


_REVERSE: weakref.WeakKeyDictionary[Vocab, _Reverse] = weakref.WeakKeyDictionary()
_CONTINUED: weakref.WeakKeyDictionary[Vocab, Vocab] = weakref.WeakKeyDictionary()


def _reverse(vocab: Vocab) -> _Reverse:
    rev = _REVERSE.get(vocab)
    if rev is None:
        rev = _REVERSE[vocab] = _Reverse(vocab)
    return rev


def _continued(vocab: Vocab) -> Vocab:
    """The vocabulary decoding a continuation: no first-token rules (no leading strip)."""
    out = _CONTINUED.get(vocab)
    if out is None:
        out = replace(vocab, first_pieces={}, strip_leading=0)
        out.name = f"{vocab.name} (continuation)"
        _CONTINUED[vocab] = out
    return out


# -- the realigner -----------------------------------------------------------------------------


@dataclass(slots=True)
class _Obs:
    """A token in the stream: identified ("token"), not ("unknown"), or a dropped "gap"."""

    kind: str
    index: int | None
    id: int | None = None
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] | None = None
    #: unknown: the bytes the wire claimed (maybe stand-ins); gap: the exact bytes.
    raw: bytes | None = None
    refused: tuple[RefusedToken, ...] = ()


@dataclass(slots=True)
class _Group:
    """A run of queued tokens: unidentified (at least `least` bytes), or identified."""

    unknown: bool
    obs: list[_Obs] = field(default_factory=list)
    least: int = 0
    data: bytes = b""
    #: unidentified: a regex their bytes must match, from what the wire claimed (each
    #: U+FFFD stands for one to four bytes, other bytes for themselves).
    pattern: re.Pattern[bytes] | None = None

    def shape(self) -> re.Pattern[bytes]:
        if self.pattern is None:
            parts = []
            for o in self.obs:
                if not o.raw:
                    parts.append(b".*?")
                    continue
                pieces = o.raw.split(REPLACEMENT)
                parts.append(b"(?:.{1,4})".join(re.escape(x) for x in pieces))
            self.pattern = re.compile(b"".join(parts), re.S)
        return self.pattern


#: How many placements `_placements` tries before calling the fit ambiguous.
PLACEMENT_BUDGET = 20_000


def _placements(rest: bytes, groups: list[_Group]) -> list[int] | None:
    """Where each identified group starts in `rest`, if they fit in exactly one way.

    Groups keep their order; an unidentified group's bytes match what the wire claimed
    for it (failing any fit, just its least length); the last group, if identified, ends
    the content (failing that, the content may have been cut short: no anchor).
    """
    n = len(groups)
    budget = [PLACEMENT_BUDGET]

    def fits(g: _Group, data: bytes, shaped: bool) -> bool:
        if shaped:
            return g.shape().fullmatch(data) is not None
        return len(data) >= g.least

    def search(
        k: int, pos: int, acc: list[int], anchored: bool, shaped: bool, found: list[list[int]]
    ) -> None:
        # groups[k] is unidentified, starting at `pos`; place the identified one after it.
        budget[0] -= 1
        if budget[0] < 0 or len(found) > 1:
            return
        g = groups[k]
        if k + 1 == n:
            if fits(g, rest[pos:], shaped):
                found.append(list(acc))
            return
        data = groups[k + 1].data
        start = pos
        while len(found) < 2 and budget[0] >= 0:
            i = rest.find(data, start)
            if i < 0:
                return
            if fits(g, rest[pos:i], shaped):
                acc.append(i)
                end = i + len(data)
                if k + 2 < n:
                    search(k + 2, end, acc, anchored, shaped, found)
                elif not anchored or end == len(rest):
                    found.append(list(acc))
                acc.pop()
            if not data:
                return
            start = i + 1

    for anchored in (not groups[-1].unknown, False):
        for shaped in (True, False):
            found: list[list[int]] = []
            search(0, 0, [], anchored, shaped, found)
            if budget[0] < 0 or len(found) > 1:
                return None
            if found:
                return found[0]
    return None


@dataclass(slots=True)
class _GapRef:
    """Stands, in the aligner, for bytes whose tokens are unknown."""

    refused: tuple[RefusedToken, ...]


class Realigner:
    """Realigns one streamed choice: feed it chunks, get exact segments back.

    >>> r = Realigner("path/to/tokenizer.json")            # doctest: +SKIP
    >>> for chunk in chunks:                                # doctest: +SKIP
    ...     for seg in r.feed(chunk):
    ...         print(seg.text, seg.token_ids)
    >>> rest = r.finish(); result = r.result()              # doctest: +SKIP

    `skip_special_tokens` None (the default) follows the stream: a special token counts as
    skipped when the streamed content does not show its text. A segment is released only
    once the streamed content confirms its text, so output can lag the input a little.
    """

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool | None = None,
        *,
        choice: int = 0,
    ) -> None:
        from .loaders import load_vocab

        self.vocab: Vocab = load_vocab(tokenizer)
        self.choice = choice
        self._rev = _reverse(self.vocab)
        self._skip: bool | None = skip_special_tokens
        self._first_rule = bool(self.vocab.first_pieces) or self.vocab.strip_leading > 0
        self._continuation: bool | None = None if self._first_rule else False
        self._aligners: dict[bool, Aligner] | None = None
        self._primary = True
        self._map: list[int | _GapRef] = []
        self._pending: deque[_Obs] = deque()
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
        self._raw_seen = False  # the stream sent bytes that are not UTF-8 on their own
        self._grew = False
        self._diverged: str | None = None
        self._n = 0  # tokens seen
        self._n_chunks = 0
        self._refused: list[RefusedToken] = []
        self._orphans: list[RefusedToken] = []
        self._trailing: list[TokenSpan] = []
        self._warnings: list[str] = []
        self._sources: list[str] = []
        self._ambiguous = 0
        self._alts_dropped = 0
        self._ext: list[RealignedSegment] | None = None
        self._ours: list[RealignedSegment] = []
        self._out: list[Segment] = []
        self._done = False
        self._result: RealignResult | None = None

    # -- public ------------------------------------------------------------------------------

    def feed(self, chunk: Mapping[str, Any]) -> list[Segment]:
        """Add one parsed chunk; return the segments its content confirmed (maybe none)."""
        if self._done:
            raise RuntimeError("this Realigner is finished; make a new one for a new stream")
        self._n_chunks += 1
        where = f"chunk {self._n_chunks}"
        frame = parse_chunk(chunk, self.choice, where)
        if frame is None:
            return []
        if frame.error is not None:
            self._warn(f"{where}: the server reported an error: {frame.error}")
            return []
        self._grew = bool(frame.content)
        if frame.content:
            self._content.append(frame.content)
            self._unconfirmed += frame.content
            self._cb += frame.content.encode("utf-8")
        ext_segments: list[RealignedSegment] = []
        if frame.ext is not None:
            ext_segments = self._read_extension(frame, where)
        elif self._ext is not None and frame.tokens:
            self._warn(f"{where} carries tokens but no tokentrail extension")
        self._observe(frame, where)
        self._drain(final=False)
        released = self._release(final=False)
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
        if self._n == 0 and not self._pending and "".join(self._content):
            raise RealignError(
                "the stream carries no per-token data: ask the server for logprobs "
                "(or vLLM's return_token_ids), or use tokentrail's server"
            )
        self._drain(final=True)
        if self._aligners is not None:
            outs = {skip: al.finish() for skip, al in self._aligners.items()}
            self._take(outs[self._primary])
        released = self._release(final=True)
        if self._diverged is None and self._unconfirmed:
            r = RefusedToken(None, "the streamed content has text that no token data accounts for")
            self._refused.append(r)
            released.append(RealignedSegment(self._unconfirmed, (), (r,)))
            self._unconfirmed = ""
        if self._orphans:
            released.append(RealignedSegment("", (), tuple(self._orphans)))
            self._orphans = []
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
            agrees = self._check_extension()
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
            content="".join(self._content),
            tokens=self._n,
            refused=list(self._refused),
            trailing=list(self._trailing),
            ambiguous=self._ambiguous,
            warnings=list(self._warnings),
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
        # Reported through the result (and the CLI's summary); logged for -v.
        log.info("%s", message)
        self._warnings.append(message)

    def _source(self, name: str) -> None:
        if name and name not in self._sources:
            self._sources.append(name)

    def _identify(self, w: _Wire, main: bool = True) -> tuple[int | None, bytes | None, str | None]:
        """(id, claimed bytes, why not) for one wire token (`main`: not an alternative)."""
        v = self.vocab
        if w.id is not None:
            if not 0 <= w.id < v.size or v.pieces[w.id] is None:
                return None, w.raw, f"id {w.id} is outside the vocabulary of {v.name}"
            return w.id, w.raw, None
        tok = w.token
        if tok is not None and tok.startswith("token_id:"):
            try:
                tid = int(tok[len("token_id:") :])
            except ValueError:
                return None, None, f"{tok!r} is not a token id"
            if not 0 <= tid < v.size or v.pieces[tid] is None:
                return None, None, f"id {tid} is outside the vocabulary of {v.name}"
            return tid, None, None
        raw = w.raw
        from_token = token_string_bytes(tok) if tok is not None else None
        if raw is None:
            raw = from_token
        if raw is None:
            return None, None, "the stream gives neither an id nor bytes for it"
        if not self._raw_seen:
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                self._raw_seen = True  # a server that sends raw bytes: U+FFFD is U+FFFD
        if REPLACEMENT in raw and (main or not self._raw_seen):
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

    def _alternatives(self, wires: list[_Wire] | None) -> tuple[tuple[int, float], ...] | None:
        if not wires:
            return None
        out = []
        seen = set()
        for w in wires:
            tid, _, _ = self._identify(w, main=False)
            if tid is None or w.logprob is None:
                self._alts_dropped += 1
                continue
            if tid not in seen:
                seen.add(tid)
                out.append((tid, w.logprob))
        return tuple(out)

    def _piece(self, tid: int) -> bytes:
        """What a token adds to a llama.cpp frame: specials add nothing there."""
        v = self.vocab
        if tid in v.special or tid in v.hidden:
            return b""
        return v.pieces[tid] or b""

    def _observe(self, frame: _Frame, where: str) -> None:
        """Turn a frame's wire tokens into observations queued for the aligner."""
        dropped: list[int] = []
        if frame.first_index is not None:
            if frame.first_index > self._n:
                dropped = list(range(self._n, frame.first_index))
                self._n = frame.first_index
            elif frame.first_index < self._n:
                self._warn(f"{where}: tokens_predicted goes backwards; indices are approximate")
        content_gap = None
        if (
            frame.folded_content
            and frame.tokens
            and all(w.id is not None and not w.folded for w in frame.tokens)
        ):
            # llama.cpp without byte data: its content holds what dropped frames held.
            sent = frame.content.encode("utf-8")
            own = b"".join(self._piece(w.id) for w in frame.tokens if w.id is not None)
            if len(sent) > len(own) and sent.endswith(own):
                content_gap = sent[: len(sent) - len(own)]
        for k, w in enumerate(frame.tokens):
            self._source(w.source)
            tid, raw, why = self._identify(w)
            gap = content_gap if k == 0 else None
            if w.folded and tid is not None and raw is not None:
                own = self._piece(tid)
                if len(raw) > len(own) and raw.endswith(own):
                    gap = raw[: len(raw) - len(own)]
                elif raw not in (own, self.vocab.pieces[tid]):
                    self._warn(
                        f"{where}: llama.cpp sent bytes {list(raw)} for token {tid}, whose "
                        f"bytes are {list(own)}"
                    )
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
                self._pending.append(_Obs("unknown", idx, None, w.logprob, top, raw, (ref,)))
            else:
                self._pending.append(_Obs("token", idx, tid, w.logprob, top))
        self._dropped(dropped)

    def _dropped(self, indices: list[int]) -> None:
        """Tokens the server counted but sent nothing about."""
        for idx in indices:
            ref = RefusedToken(idx, "the server generated it but sent no data for it")
            self._pending.append(_Obs("unknown", idx, raw=None, refused=(ref,)))

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
        self._pending.append(_Obs("gap", None, raw=data, refused=refused))

    def _read_extension(self, frame: _Frame, where: str) -> list[RealignedSegment]:
        """tokentrail's extension: its token ids feed the check, its segments the output."""
        ext = frame.ext
        assert ext is not None
        if self._ext is None:
            self._ext = []
        self._source("tokentrail-extension")
        segs = ext.get("segments") or []
        if not isinstance(segs, list):
            raise RealignError(f"{where}.tokentrail.segments must be a list")
        out = [_ext_segment(s, f"{where}.tokentrail.segments[{k}]") for k, s in enumerate(segs)]
        self._ext.extend(out)
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
            if idx != self._n:
                self._warn(f"{where}: extension token index {idx}, expected {self._n}")
            lp = _logprob(token.get("logprob"), f"{where}.tokentrail.token.logprob")
            frame.tokens.append(_Wire(tid, logprob=lp, source="tokentrail-extension"))
        elif token is None:
            # A whole response: the ids are those of the spans, in order, once each.
            by_index = {t.index: t for s in out for t in s.tokens}
            by_index.update({t.index: t for t in stop_spans})
            spans = sorted(by_index.items())
            if [i for i, _ in spans] != list(range(self._n, self._n + len(spans))):
                self._warn(f"{where}: the extension's token indices are not consecutive")
            for _, t in spans:
                frame.tokens.append(_Wire(t.id, logprob=t.logprob, source="tokentrail-extension"))
        else:
            raise RealignError(f"{where}.tokentrail.token must be an object")
        return out

    def _check_extension(self) -> bool:
        """Do the extension's segments equal the realignment of its own token ids?"""
        assert self._ext is not None

        def key(s: Segment) -> tuple[str, list[tuple[int, int, int, int]]]:
            return s.text, [(t.index, t.id, t.start, t.end) for t in s.tokens]

        theirs = [key(s) for s in self._ext]
        ours = [key(s) for s in self._ours]
        if theirs == ours:
            return True
        n = next(
            (k for k, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b),
            min(len(theirs), len(ours)),
        )
        a = theirs[n] if n < len(theirs) else None
        b = ours[n] if n < len(ours) else None
        self._warn(
            f"the tokentrail extension disagrees with the realignment of its token ids at "
            f"segment {n}: extension {a}, realigned {b}"
        )
        return False

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
        vocab = _continued(self.vocab) if self._continuation else self.vocab
        skips = [True, False] if self._skip is None else [self._skip]
        self._aligners = {s: Aligner(vocab, skip_special_tokens=s) for s in skips}
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


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n


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


def realign(
    chunks: Iterable[Mapping[str, Any]],
    tokenizer: Any,
    skip_special_tokens: bool | None = None,
    *,
    choice: int = 0,
) -> RealignResult:
    """Realign a whole stream of parsed chunks with `tokenizer` (see `Realigner`)."""
    return Realigner(tokenizer, skip_special_tokens, choice=choice).realign(chunks)


# -- reading captures --------------------------------------------------------------------------


def read_chunks(lines: Iterable[str], where: str = "input", start: int = 1) -> Iterator[Any]:
    """Parsed chunks from JSON lines or a raw SSE capture (``data: {...}``, ``data: [DONE]``).

    Blank lines, SSE comments (``:``) and ``event:``/``id:``/``retry:`` fields are
    skipped; ``data: [DONE]`` ends the stream. A line that is not JSON raises
    RealignError naming the line.
    """
    for n, line in enumerate(lines, start):
        s = line.strip()
        if not s or s.startswith(":"):
            continue
        if s.startswith("data:"):
            s = s[len("data:") :].strip()
            if s == "[DONE]":
                return
        elif s.split(":", 1)[0] in ("event", "id", "retry"):
            continue
        try:
            yield json.loads(s)
        except json.JSONDecodeError as e:
            raise RealignError(f"{where} line {n}: not JSON ({e.msg}): {s[:60]!r}") from None


# -- command line ------------------------------------------------------------------------------


def _finite(value: float | None) -> float | None:
    if value is None or math.isnan(value):
        return None
    if math.isinf(value):
        return WIRE_NEG_INF if value < 0 else None
    return value


def segment_json(seg: Segment) -> dict[str, Any]:
    """A segment as the CLI prints it: JSON-safe (-inf logprobs as -9999.0)."""
    out = seg.to_dict()
    for t in out["tokens"]:
        if "logprob" in t:
            t["logprob"] = _finite(t["logprob"])
        for a in t.get("top_logprobs") or ():
            a["logprob"] = _finite(a["logprob"])
    try:
        conf = seg.confidence
    except (OverflowError, ValueError):
        conf = None
    if conf is not None:
        out["confidence"] = {
            k: (v if not isinstance(v, float) or math.isfinite(v) else None)
            for k, v in conf.to_dict().items()
        }
    return out


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `tokentrail realign` to the CLI."""
    p = subparsers.add_parser(
        "realign",
        help="rebuild exact segments and token attribution from a captured stream",
        description=(
            "Read the chunks an OpenAI-compatible server streamed (JSON lines, or a raw "
            "SSE capture with 'data: ' lines) and print one JSON object per segment: its "
            "text, the tokens behind it and their confidence. Exit 0 when exact, 3 when "
            "the stream was lossy (some tokens could not be identified; their text is "
            "still printed, with 'refused') or its text differs from the content, and 2 "
            "on bad input."
        ),
    )
    p.add_argument("--tokenizer", required=True, help="tokenizer file or model folder")
    skip = p.add_mutually_exclusive_group()
    skip.add_argument(
        "--skip-special-tokens",
        dest="skip_special_tokens",
        action="store_const",
        const=True,
        default=None,
        help="special tokens add no text (default: follow the stream's content)",
    )
    skip.add_argument(
        "--keep-special-tokens",
        dest="skip_special_tokens",
        action="store_const",
        const=False,
        help="special tokens add their text",
    )
    p.add_argument("--choice", type=int, default=0, help="which choice to realign (default 0)")
    p.add_argument("input", nargs="?", default="-", help="capture file (default: stdin)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """`tokentrail realign`: see `register`."""
    from .cli import fail
    from .loaders import TokenizerLoadError

    try:
        realigner = Realigner(args.tokenizer, args.skip_special_tokens, choice=args.choice)
    except (TokenizerLoadError, OSError, ValueError) as e:
        return fail(f"cannot load tokenizer {args.tokenizer}: {e}")
    except Exception as e:  # a tokenizer library rejecting a corrupt file
        return fail(f"cannot load tokenizer {args.tokenizer}: {type(e).__name__}: {e}")
    stream: TextIO
    try:
        stream = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")  # noqa: SIM115
    except OSError as e:
        return fail(f"cannot read {args.input}: {e.strerror}")
    out = sys.stdout
    where = "stdin" if args.input == "-" else args.input
    try:
        with stream:
            for chunk in _chunks_of(stream, where):
                for seg in realigner.feed(chunk):
                    out.write(json.dumps(segment_json(seg), ensure_ascii=False) + "\n")
            for seg in realigner.finish():
                out.write(json.dumps(segment_json(seg), ensure_ascii=False) + "\n")
    except RealignError as e:
        return fail(str(e))
    except UnicodeDecodeError as e:
        return fail(f"{where} is not UTF-8 text: {e.reason} at byte {e.start}")
    out.flush()
    result = realigner.result()
    if result.exact:
        return 0
    sys.stderr.write(f"tokentrail: warning: {result.summary()}\n")
    return 3


def _chunks_of(stream: TextIO, where: str) -> Iterator[Any]:
    """JSON lines / SSE, or (when the first line is not JSON) one JSON document."""
    first = ""
    n = 0
    for n, line in enumerate(stream, 1):  # noqa: B007 (n is used after the loop)
        if line.strip():
            first = line
            break
    if not first:
        return
    try:
        head = list(read_chunks([first], where, n))
    except RealignError:
        doc = first + stream.read()
        try:
            whole = json.loads(doc)
        except json.JSONDecodeError:
            head = list(read_chunks([first], where, n))  # raises, naming the line
            return
        yield from (whole if isinstance(whole, list) else [whole])
        return
    yield from head
    yield from read_chunks(stream, where, n + 1)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m tokentrail.realign ...`: the same as `tokentrail realign`."""
    parser = argparse.ArgumentParser(prog="python -m tokentrail.realign")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    return int(run(parser.parse_args(["realign", *(argv or sys.argv[1:])])))


if __name__ == "__main__":
    raise SystemExit(main())
