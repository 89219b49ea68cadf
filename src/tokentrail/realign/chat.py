"""An upstream's own chat channels, attributed per token (``serve --upstream-chat``).

In this mode the proxy forwards a chat request to the upstream's
``/v1/chat/completions`` (its chat template, its reasoning parser, its tool-call parser,
its constrained decoding), asking for logprobs (and vLLM's ``return_token_ids``), and
`ChannelTracker` reads the streamed answer back into tokens, each labelled with the
channel its text arrived in:

- ``reasoning``: ``delta.reasoning_content`` or ``delta.reasoning`` (one of them: a
  server that sends both sends the same text twice);
- ``content``: ``delta.content``;
- ``tool_call``: the tokens between the texts the upstream sent as text, when tool-call
  deltas arrived meanwhile: the raw text the upstream parsed into ``delta.tool_calls``;
- ``markup``: the tokens whose bytes are in no text field (``<think>``, ``</think>``,
  an end token, whitespace a parser trimmed).

The rule, general and byte-exact: the tokens' bytes (``vocab.pieces`` of each id: exact
ids where the wire gives them, llama.cpp's ``id`` and vLLM's ``token_ids``; else the
entry's ``bytes``, looked up in the vocabulary) are laid end to end, and each text
fragment, in the order the upstream sent them, is found in those bytes at or after
where the previous one ended (at that point if it can be, else at the next token
start, else anywhere). What lies between two fragments is markup (or the tool call's
text, see above). A token that straddles a boundary is listed in each part with its
own byte range, so per channel the tokens' bytes join to exactly that channel's text.

Never guessed: a fragment whose bytes the tokens do not spell (an upstream that sent
no logprobs for some deltas: llama-server sends none with tools while streaming) is a
part with ``tokens`` None and a ``reason``.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..vocab import Vocab
from .dialects import parse_chunk
from .result import RealignError
from .vocabmap import reverse
from .wire import WireToken, token_string_bytes

__all__ = [
    "CHANNEL_NAMES",
    "ChannelPart",
    "ChannelTracker",
    "ChatToken",
    "arguments_span",
    "json_span",
]

#: The channels a token can be labelled with.
CHANNEL_NAMES = ("reasoning", "content", "tool_call", "markup")


@dataclass(slots=True)
class ChatToken:
    """One generated token: `id` (None: not identified, `refused` says why), its bytes,
    the wire's logprob and alternatives ((id, logprob, bytes))."""

    index: int
    id: int | None
    data: bytes
    logprob: float | None
    top: list[tuple[int | None, float | None, bytes]] = field(default_factory=list)
    refused: str | None = None


@dataclass(slots=True)
class ChannelPart:
    """Text of one channel and the tokens behind it: (token, start, end) byte ranges.
    `tokens` None: the upstream sent no token data for this text (`reason` says so)."""

    channel: str
    text: str
    tokens: list[tuple[ChatToken, int, int]] | None
    reason: str | None = None


class ChannelTracker:
    """Reads an upstream's chat chunks (choice 0) into `ChannelPart`s (see the module).

    `feed(chunk)` returns the parts that became final; `finish()` the rest. `tokens`,
    `texts` (per channel), `tool_calls` (merged pieces by index), `finish_reason` and
    `usage` are kept for the whole answer."""

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        self._rev = reverse(vocab)
        self.tokens: list[ChatToken] = []
        self.texts: dict[str, str] = {c: "" for c in CHANNEL_NAMES}
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: Mapping[str, Any] | None = None
        self._raw = bytearray()
        self._starts: list[int] = []  # each token's first byte in _raw
        self._cursor = 0  # bytes before it are attributed
        #: Fragments not yet placed: (channel, text, where the bytes ended when it came,
        #: whether it was its chunk's last text, tool-call pieces read before it came).
        self._pending: list[tuple[str, str, int, bool, int]] = []
        #: Tool-call pieces read so far, and before the last placed fragment came: the
        #: bytes between two fragments are the call's text when pieces came between them
        #: (a delta's text comes before its pieces: a whole message's content, then calls).
        self._tool_pieces = 0
        self._tools_placed = 0
        #: The byte ranges (of all the tokens' bytes laid end to end) labelled tool_call.
        self.tool_ranges: list[tuple[int, int]] = []

    # -- reading --

    def feed(self, chunk: Mapping[str, Any]) -> list[ChannelPart]:
        """The parts one chunk (streamed, or a whole response) made final."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        choices = [c for c in chunk.get("choices") or [] if isinstance(c, Mapping)]
        choice = next((c for c in choices if c.get("index", 0) == 0), None)
        if choice is None:
            return []
        try:
            frame = parse_chunk({"choices": [choice]}, 0)
        except RealignError as e:
            raise ValueError(f"the upstream sent what cannot be read: {e}") from e
        wires = [] if frame is None else frame.tokens
        for w in wires:
            self._add(w)
        body = choice.get("delta", choice.get("message")) or {}
        reasoning = body.get("reasoning_content") or body.get("reasoning") or ""
        texts = [
            (channel, text)
            for channel, text in (("reasoning", reasoning), ("content", body.get("content")))
            if isinstance(text, str) and text
        ]
        for k, (channel, text) in enumerate(texts):
            self.texts[channel] += text
            self._pending.append(
                (channel, text, len(self._raw), k == len(texts) - 1, self._tool_pieces)
            )
        for piece in body.get("tool_calls") or []:
            self._tool_piece(piece)
        if choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])
        return self._place()

    def finish(self) -> list[ChannelPart]:
        """The stream has ended: the parts still held, and the tokens after the last
        text (markup, or the tool call's text)."""
        out = self._place(final=True)
        for channel, text, _, _, _ in self._pending:
            why = "the upstream's tokens do not spell this text (it sent no logprobs for it)"
            out.append(ChannelPart(channel, text, None, why))
        self._pending.clear()
        end = len(self._raw)
        if self._cursor < end:
            out += self._gap(self._cursor, end, self._tool_pieces > self._tools_placed)
            self._cursor = end
        return out

    def _add(self, w: WireToken) -> None:
        tid, why = w.id, None
        raw = w.raw if w.raw is not None else (token_string_bytes(w.token) if w.token else None)
        if tid is not None and not self.vocab.has_id(tid):
            tid, why = None, f"id {tid} is outside the vocabulary"
        if tid is None and why is None and raw:
            ids = self._rev.ids.get(raw)
            tid = ids[0] if ids else None
            why = None if ids else "its bytes match no token of the vocabulary"
        if tid is None and why is None:
            why = "the upstream gave neither an id nor bytes for it"
        data = (self.vocab.pieces[tid] or b"") if tid is not None else (raw or b"")
        top = []
        for t in w.top or ():
            tb = t.raw if t.raw is not None else (token_string_bytes(t.token) if t.token else b"")
            t_id = t.id if t.id is not None else next(iter(self._rev.ids.get(tb) or ()), None)
            top.append((t_id, t.logprob, tb if t_id is None else self.vocab.pieces[t_id] or b""))
        tok = ChatToken(len(self.tokens), tid, data, w.logprob, top, why)
        self.tokens.append(tok)
        self._starts.append(len(self._raw))
        self._raw += data

    def _tool_piece(self, piece: Any) -> None:
        if not isinstance(piece, Mapping):
            return
        self._tool_pieces += 1
        index = piece.get("index", len(self.tool_calls))
        call = self.tool_calls.setdefault(index, {"id": None, "name": "", "arguments": ""})
        if piece.get("id"):
            call["id"] = piece["id"]
        fn = piece.get("function") or {}
        if fn.get("name"):
            call["name"] += fn["name"]
        args = fn.get("arguments")
        if isinstance(args, str):
            call["arguments"] += args
        elif args is not None:
            call["arguments"] += json.dumps(args)

    # -- placing text on the bytes --

    def _find(self, data: bytes, ended: int, last: bool) -> int:
        """Where `data` starts: a chunk's last text ends where the tokens had come to
        when it came (text is sent as soon as its tokens complete it), when it can; else
        at the cursor, else at the next token start, else anywhere after the cursor."""
        raw, at = self._raw, self._cursor
        p = ended - len(data)
        if last and p >= at and raw.startswith(data, p):
            return p
        if raw.startswith(data, at):
            return at
        for s in self._starts:
            if s > at and raw.startswith(data, s):
                return s
        return raw.find(data, at)

    def _place(self, final: bool = False) -> list[ChannelPart]:
        out: list[ChannelPart] = []
        while self._pending:
            channel, text, ended, last, tools = self._pending[0]
            data = text.encode("utf-8")
            p = self._find(data, ended, last)
            if p < 0:
                break  # its tokens have not all arrived yet (or never will: `finish`)
            self._pending.pop(0)
            if p > self._cursor:
                out += self._gap(self._cursor, p, tools > self._tools_placed)
            self._tools_placed = tools
            out.append(ChannelPart(channel, text, self._spans(p, p + len(data))))
            self._cursor = p + len(data)
        return out

    def _gap(self, start: int, end: int, tools: bool) -> list[ChannelPart]:
        """Bytes in no text field: markup, or (`tools`: tool-call pieces arrived
        meanwhile) the tool call's text; special tokens are markup either way."""
        label = "tool_call" if tools else "markup"
        out: list[ChannelPart] = []
        for tok, a, b in self._spans(start, end):
            ch = (
                "markup"
                if tok.id is not None and tok.id in self.vocab.special | self.vocab.hidden
                else label
            )
            text = tok.data[a:b].decode("utf-8", "replace")
            if out and out[-1].channel == ch and out[-1].tokens is not None:
                out[-1].tokens.append((tok, a, b))
                out[-1].text += text
            else:
                out.append(ChannelPart(ch, text, [(tok, a, b)]))
        for part in out:
            self.texts[part.channel] += part.text if part.channel in ("tool_call", "markup") else ""
        if label == "tool_call":
            self.tool_ranges.append((start, end))
        return out

    def raw(self, start: int, end: int) -> bytes:
        """Bytes [start, end) of the tokens' bytes laid end to end."""
        return bytes(self._raw[start:end])

    def spans(self, start: int, end: int) -> list[tuple[ChatToken, int, int]]:
        """The tokens covering bytes [start, end), each with its own byte range."""
        return self._spans(start, end)

    def _spans(self, start: int, end: int) -> list[tuple[ChatToken, int, int]]:
        """The tokens covering bytes [start, end), each with its own byte range."""
        out = []
        k = max(0, bisect.bisect_right(self._starts, start) - 1)
        while k < len(self.tokens) and self._starts[k] < end:
            s = self._starts[k]
            tok = self.tokens[k]
            a, b = max(start, s) - s, min(end, s + len(tok.data)) - s
            if b > a or (not tok.data and start <= s < end):
                out.append((tok, a, b))
            k += 1
        return out


def arguments_span(
    tracker: ChannelTracker, arguments: str, after: int = 0, before: int | None = None
) -> tuple[int, int] | None:
    """Where (bytes of the tokens laid end to end, from `after`, starting before
    `before`) the tool_call channel holds a JSON value equal to `arguments` parsed, or
    None."""
    try:
        want = json.loads(arguments)
    except ValueError:
        return None
    return json_span(tracker, want, after, before)


def json_span(
    tracker: ChannelTracker, want: Any, after: int = 0, before: int | None = None
) -> tuple[int, int] | None:
    """Where (bytes, as `arguments_span`) the tool_call channel first holds a JSON
    value equal to `want` (of its type: 1 is not true), or None."""
    decoder = json.JSONDecoder()
    for start, end in tracker.tool_ranges:
        if end <= after:
            continue
        start = max(start, after)
        text = tracker.raw(start, end).decode("utf-8", "replace")
        for i, ch in enumerate(text):
            if ch not in '{["-0123456789tfn':
                continue
            a = start + len(text[:i].encode("utf-8"))
            if before is not None and a >= before:
                return None
            try:
                value, stop = decoder.raw_decode(text, i)
            except ValueError:
                continue
            if value == want and type(value) is type(want):
                return a, a + len(text[i:stop].encode("utf-8"))
    return None
