"""What the client of ``serve --upstream-chat`` gets: the upstream chat's answer as read
by `tokentrail.realign.chat.ChannelTracker`, written as OpenAI chunks and responses.

`ChatWriter` writes the upstream's own deltas (``content``, ``reasoning`` and
``reasoning_content``, ``tool_calls``, its finish reason and usage) with
``logprobs.content`` holding the content channel's tokens and
``logprobs.reasoning_content`` the reasoning's, the ``tokentrail`` extension's
``segments`` (one per channel part, with its ``channel`` and its tokens' byte ranges, or
``tokens: null`` and a ``reason``), each tool call's ``raw`` text and JSON fields, all
in the main path's spellings (`wire_tokens`). `read_chunk` feeds one upstream chunk to
the tracker. The exchange with the upstream is `tokentrail.server.proxy_chat`'s.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from ..errors import StructureError
from ..realign.chat import ChannelPart, ChannelTracker, ChatToken, arguments_span, json_span
from ..segment import Alternative, Segment, TokenSpan, confidence_of
from ..structure.fields import json_fields
from .wire_tokens import spellings, wire_logprob

__all__ = ["ChatWriter", "read_chunk"]


class ChatWriter:
    """Our chat chunks and response for one upstream answer (see the module)."""

    def __init__(
        self, vocab: Any, payload: Mapping[str, Any], model: str, request_id: str | None = None
    ) -> None:
        self.vocab = vocab
        self.spell = spellings(vocab)
        self.logprobs = bool(payload.get("logprobs"))
        top = payload.get("top_logprobs")
        self.top = top if isinstance(top, int) and not isinstance(top, bool) else 0
        self.id = request_id or f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.listed: dict[str, int] = {"content": 0, "reasoning": 0}
        self.first = True  # no chunk written yet (`event`)

    def _text(self, tok: ChatToken) -> str:
        if tok.id is not None:
            return self.spell.token_text(tok.id)
        return tok.data.decode("utf-8", "replace")

    def _alternatives(self, tok: ChatToken) -> tuple[Alternative, ...]:
        """The token's alternatives as the main path's (`Alternative`: no `display`, which
        needs the aligner's held bytes; an id the vocabulary lacks stays None)."""
        return tuple(
            Alternative(
                i,  # type: ignore[arg-type]
                lp,  # type: ignore[arg-type]
                b,
                self.spell.token_text(i) if i is not None else b.decode("utf-8", "replace"),
            )
            for i, lp, b in tok.top
        )

    def _span(self, tok: ChatToken, start: int, end: int) -> TokenSpan:
        """`tok`'s share [start, end) of its bytes, as the main path's `TokenSpan` (an
        unidentified token has id -1 here: only its figures are read)."""
        tid = -1 if tok.id is None else tok.id
        return TokenSpan(tok.index, tid, start, end, tok.logprob, self._alternatives(tok))

    def _token(self, tok: ChatToken, start: int, end: int) -> dict[str, Any]:
        """A segment's token, written by the main path's rule (`Spellings.span`); one the
        upstream's data did not identify has its bytes, id null and `refused`."""
        span = self._span(tok, start, end)
        if tok.id is not None:
            out = self.spell.span(span)
        else:
            out = {"index": tok.index, "id": None, "start": start, "end": end,
                   "logprob": wire_logprob(tok.logprob), "text": self._text(tok),
                   "bytes": list(tok.data)}  # fmt: skip
        if self.top and span.top_logprobs:
            out["top_logprobs"] = self.spell.alternatives(span.top_logprobs, self.top)
        if tok.refused is not None:
            out["refused"] = tok.refused
        return out

    def segments(self, parts: list[ChannelPart]) -> list[dict[str, Any]]:
        """One per part, as the main path writes a channel part: its text, channel,
        tokens and their `confidence`; tokens and confidence null (and a `reason`)
        where the upstream sent no token data for the text."""
        out = []
        for p in parts:
            seg: dict[str, Any] = {"text": p.text, "channel": p.channel}
            if p.tokens is None:
                seg["tokens"] = seg["confidence"] = None
            else:
                seg["tokens"] = [self._token(*t) for t in p.tokens]
                conf = confidence_of([self._span(*t) for t in p.tokens])
                seg["confidence"] = None if conf is None else conf.to_dict()
            if p.reason is not None:
                seg["reason"] = p.reason
            out.append(seg)
        return out

    def chat_logprobs(self, parts: list[ChannelPart]) -> dict[str, Any]:
        """``content`` (the content channel's tokens) and ``reasoning_content``; a token
        that straddles two parts of a channel is listed once."""
        out: dict[str, list[dict[str, Any]]] = {"content": [], "reasoning_content": []}
        for p in parts:
            if p.channel not in self.listed or p.tokens is None:
                continue
            key = "content" if p.channel == "content" else "reasoning_content"
            for tok, a, b in p.tokens:
                if tok.index >= self.listed[p.channel]:
                    out[key].append(self._entry(tok, a, b))
                    self.listed[p.channel] = tok.index + 1
        return out

    def _entry(self, tok: ChatToken, start: int, end: int) -> dict[str, Any]:
        """A token of `logprobs`, by the main path's rule (`Spellings.chat_logprob`)."""
        if tok.id is not None:
            return self.spell.chat_logprob(self._span(tok, start, end), self.top)
        return {
            "token": self._text(tok),
            "logprob": wire_logprob(tok.logprob),
            "bytes": list(tok.data),
            "top_logprobs": self.spell.chat_logprob(self._span(tok, start, end), self.top)[
                "top_logprobs"
            ],
        }

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}  # fmt: skip

    def chunk(
        self, upstream: Mapping[str, Any] | None, parts: list[ChannelPart], first: bool
    ) -> dict[str, Any]:
        """Our chunk for the upstream's choice-0 delta (or message) and the parts it made final."""
        up = upstream or {}
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        content = up.get("content")
        if content is not None:
            delta["content"] = content
        reasoning = up.get("reasoning_content") or up.get("reasoning")
        if reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if up.get("tool_calls"):
            delta["tool_calls"] = [
                {**c, "index": c.get("index", k)} for k, c in enumerate(up["tool_calls"])
            ]
        out = self._envelope("chat.completion.chunk")
        out["choices"] = [{
            "index": 0,
            "delta": delta,
            "logprobs": self.chat_logprobs(parts) if self.logprobs else None,
            "finish_reason": None,
        }]  # fmt: skip
        out["tokentrail"] = {"segments": self.segments(parts)}
        return out

    def event(
        self, tracker: ChannelTracker, choice: Mapping[str, Any] | None, parts: list[ChannelPart]
    ) -> dict[str, Any] | None:
        """Our chunk for one `read_chunk` event (the upstream's choice 0 and the parts it
        made final; None and the rest at the end): the last one has the finish reason
        and the calls and fields; a usage-only event is the usage chunk (None: nothing
        to send)."""
        if choice is None and not parts:
            if tracker.usage is None or self.first:
                return None
            out = self._envelope("chat.completion.chunk")
            out["choices"], out["usage"] = [], dict(tracker.usage)
            return out
        up = None if choice is None else choice.get("delta", choice.get("message"))
        out = self.chunk(up, parts, self.first)
        self.first = False
        if choice is not None and choice.get("finish_reason"):
            out["choices"][0]["finish_reason"] = choice["finish_reason"]
            out["tokentrail"]["tool_calls"] = self.calls(tracker)
            out["tokentrail"]["fields"] = self.fields(tracker)
        return out

    def calls(self, tracker: ChannelTracker) -> list[dict[str, Any]]:
        """Each tool call as the upstream parsed it, with the tool_call channel's raw text."""
        raw = tracker.texts["tool_call"]
        out = []
        for k in sorted(tracker.tool_calls):
            c = tracker.tool_calls[k]
            out.append({"index": k, "id": c["id"], "name": c["name"], "arguments": c["arguments"]})
        return [{**c, "raw": raw if len(out) == 1 else None} for c in out]

    def fields(self, tracker: ChannelTracker) -> list[dict[str, Any]]:
        """Each call's fields as the main path lists them: its name
        (``/tool_calls/N/function/name``) and its arguments' leaves
        (``/tool_calls/N/arguments/<pointer>``), with their tokens. A call's arguments
        are found where the tool_call channel's bytes, after the previous call's, hold a
        JSON value equal to the arguments the upstream parsed, and its name as a JSON
        string before them; none where no such value is there (the upstream rewrote
        them) or a token in it was not identified."""
        out: list[dict[str, Any]] = []
        after = 0
        for k in sorted(tracker.tool_calls):
            call = tracker.tool_calls[k]
            args = arguments_span(tracker, call["arguments"], after)
            if args is None:
                continue
            name = json_span(tracker, call["name"], after, args[0]) if call["name"] else None
            after = args[1]
            for span, path in ((name, f"/tool_calls/{k}/function/name"),
                               (args, f"/tool_calls/{k}/arguments")):  # fmt: skip
                if span is not None:
                    out += self._json_fields(tracker, *span, path)
        return out

    def _json_fields(
        self, tracker: ChannelTracker, start: int, end: int, prefix: str
    ) -> list[dict[str, Any]]:
        """The fields of the JSON value in bytes [start, end), their paths under `prefix`."""
        spans = tracker.spans(start, end)
        if any(t.id is None for t, _, _ in spans):
            return []
        text = tracker.raw(start, end).decode("utf-8")
        seg = Segment(text, tuple(self._span(*t) for t in spans))
        try:
            found = json_fields(text, [seg])
        except StructureError:
            return []
        out = []
        for f in found:
            d = f.to_dict()
            d["path"] = prefix + d["path"]
            out.append(d)
        return out

    def response(self, tracker: ChannelTracker, parts: list[ChannelPart]) -> dict[str, Any]:
        texts = tracker.texts
        calls = [
            {"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in (tracker.tool_calls[k] for k in sorted(tracker.tool_calls))
        ]  # fmt: skip
        message: dict[str, Any] = {
            "role": "assistant",
            "content": texts["content"] if texts["content"] or not calls else None,
            "reasoning": texts["reasoning"] or None,
            "reasoning_content": texts["reasoning"] or None,
        }
        if calls:
            message["tool_calls"] = calls
        out = self._envelope("chat.completion")
        out["choices"] = [{
            "index": 0,
            "message": message,
            "logprobs": self.chat_logprobs(parts) if self.logprobs else None,
            "finish_reason": tracker.finish_reason,
        }]  # fmt: skip
        if tracker.usage is not None:
            out["usage"] = dict(tracker.usage)
        out["tokentrail"] = {
            "segments": self.segments(parts),
            "tool_calls": self.calls(tracker),
            "fields": self.fields(tracker),
        }
        return out


def read_chunk(
    tracker: ChannelTracker, chunk: Mapping[str, Any]
) -> tuple[Mapping[str, Any] | None, list[ChannelPart]]:
    """One upstream chunk (a whole response is one) read by `tracker`: its choice 0 and
    the parts it made final (all the rest once it has a finish reason). After the last
    chunk, a tracker with no finish reason still holds parts: `tracker.finish()`."""
    choice = _choice(chunk)
    parts = tracker.feed(chunk)
    if choice is not None and choice.get("finish_reason"):
        parts += tracker.finish()
    return choice, parts


def _choice(chunk: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for c in chunk.get("choices") or []:
        if isinstance(c, Mapping) and c.get("index", 0) == 0:
            return c
    return None
