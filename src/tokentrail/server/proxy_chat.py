"""``serve --upstream URL --upstream-chat``: chat requests go to the upstream's own chat
endpoint, so its reasoning parser, tool-call parser and constrained decoding run there,
and come back attributed per token with their channel.

`chat_route` is the ``/v1/chat/completions`` route the proxy puts in front of its own
(which renders the template here and sends token ids upstream). The upstream's answer
is read by `tokentrail.engines.upstream_chat.ChannelTracker`; what the client gets is
the upstream's own deltas (``content``, ``reasoning`` and ``reasoning_content`` both,
``tool_calls`` as the upstream sent them, its finish reason and usage), with
``logprobs.content`` holding the content channel's tokens only and
``logprobs.reasoning_content`` the reasoning's, and the ``tokentrail`` extension's
``segments``: one per channel part, each with its ``channel``
(reasoning/content/tool_call/markup) and its tokens' byte ranges, or ``tokens: null``
and a ``reason`` where the upstream sent no token data for that text. On the last
chunk (or the response), ``tool_calls`` lists each call's ``raw`` text (the tool_call
channel's bytes) and the upstream's parsed ``name`` and ``arguments``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ..engines.upstream_chat import ChannelPart, ChannelTracker, ChatToken, chat_body
from ..engines.upstream_wire import status_error
from ..errors import APIError, StructureError, UpstreamError
from ..segment import Segment, TokenSpan
from ..structure.fields import json_fields
from .formatting import sse

__all__ = ["ChatWriter", "chat_route"]


def _lp(value: float | None) -> float | None:
    return (
        None if value is None or value != value or value in (float("inf"), float("-inf")) else value
    )


class ChatWriter:
    """Our chat chunks and response for one upstream answer (see the module)."""

    def __init__(self, vocab: Any, payload: Mapping[str, Any], model: str) -> None:
        self.vocab = vocab
        self.logprobs = bool(payload.get("logprobs"))
        top = payload.get("top_logprobs")
        self.top = top if isinstance(top, int) and not isinstance(top, bool) else 0
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.listed: dict[str, int] = {"content": 0, "reasoning": 0}

    def _text(self, tok: ChatToken) -> str:
        if tok.id is not None:
            return str(self.vocab.token_text(tok.id))
        return tok.data.decode("utf-8", "replace")

    def _token(self, tok: ChatToken, start: int, end: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": tok.index,
            "id": tok.id,
            "start": start,
            "end": end,
            "logprob": _lp(tok.logprob),
            "text": self._text(tok),
            "bytes": list(tok.data),
        }
        if self.top:
            out["top_logprobs"] = [
                {
                    "id": i,
                    "logprob": _lp(lp),
                    "bytes": list(b),
                    "text": b.decode("utf-8", "replace"),
                }
                for i, lp, b in tok.top[: self.top]
            ]
        if tok.refused is not None:
            out["refused"] = tok.refused
        return out

    def segments(self, parts: list[ChannelPart]) -> list[dict[str, Any]]:
        out = []
        for p in parts:
            seg: dict[str, Any] = {"text": p.text, "channel": p.channel}
            seg["tokens"] = None if p.tokens is None else [self._token(*t) for t in p.tokens]
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
            for tok, _, _ in p.tokens:
                if tok.index >= self.listed[p.channel]:
                    out[key].append(self._entry(tok))
                    self.listed[p.channel] = tok.index + 1
        return out

    def _entry(self, tok: ChatToken) -> dict[str, Any]:
        return {
            "token": self._text(tok),
            "logprob": _lp(tok.logprob),
            "bytes": list(tok.data),
            "top_logprobs": [
                {"token": b.decode("utf-8", "replace"), "logprob": _lp(lp), "bytes": list(b)}
                for _, lp, b in tok.top[: self.top]
            ],
        }

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

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

    def calls(self, tracker: ChannelTracker) -> list[dict[str, Any]]:
        """Each tool call as the upstream parsed it, with the tool_call channel's raw text."""
        raw = tracker.texts["tool_call"]
        out = []
        for k in sorted(tracker.tool_calls):
            c = tracker.tool_calls[k]
            out.append({"index": k, "id": c["id"], "name": c["name"], "arguments": c["arguments"]})
        return [{**c, "raw": raw if len(out) == 1 else None} for c in out]

    def fields(self, tracker: ChannelTracker) -> list[dict[str, Any]]:
        """The JSON fields of each call's arguments, with their tokens: found where the
        tool_call channel's bytes hold a JSON value equal to the arguments the upstream
        parsed (paths ``/tool_calls/N/arguments/<pointer>``); none where no such value
        is there (the upstream rewrote them) or a token in it was not identified."""
        out: list[dict[str, Any]] = []
        for k in sorted(tracker.tool_calls):
            found = arguments_span(tracker, tracker.tool_calls[k]["arguments"])
            if found is None:
                continue
            start, end = found
            spans = tracker.spans(start, end)
            if any(t.id is None for t, _, _ in spans):
                continue
            text = tracker.raw(start, end).decode("utf-8")
            seg = Segment(
                text, tuple(TokenSpan(t.index, t.id, a, b, t.logprob) for t, a, b in spans)
            )
            try:
                fields = json_fields(text, [seg])
            except StructureError:
                continue
            for f in fields:
                d = f.to_dict()
                d["path"] = f"/tool_calls/{k}/arguments{d['path']}"
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


def arguments_span(tracker: ChannelTracker, arguments: str) -> tuple[int, int] | None:
    """Where (bytes of the tokens laid end to end) the tool_call channel holds a JSON
    value equal to `arguments` parsed, or None."""
    try:
        want = json.loads(arguments)
    except ValueError:
        return None
    decoder = json.JSONDecoder()
    for start, end in tracker.tool_ranges:
        text = tracker.raw(start, end).decode("utf-8", "replace")
        for i, ch in enumerate(text):
            if ch not in '{["-0123456789tfn':
                continue
            try:
                value, stop = decoder.raw_decode(text, i)
            except ValueError:
                continue
            if value == want:
                a = start + len(text[:i].encode("utf-8"))
                return a, a + len(text[i:stop].encode("utf-8"))
    return None


def _payload(raw: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(raw)
    except ValueError as e:
        raise APIError(400, f"the body is not JSON: {e}") from None
    if not isinstance(payload, dict):
        raise APIError(400, "the body must be a JSON object")
    if not isinstance(payload.get("messages"), list) or not payload["messages"]:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    n = payload.get("n", 1)
    if n not in (None, 1):
        raise APIError(400, "'n' must be 1 with --upstream-chat", param="n")
    return payload


def _api(e: UpstreamError) -> APIError:
    """The client's answer: the upstream's own 4xx as a request error, else 502/504."""
    kind = "invalid_request_error" if 400 <= e.status < 500 else "upstream_error"
    return APIError(e.status, str(e), type=kind, code=e.code)


async def _chunks(resp: Any, streamed: bool) -> AsyncIterator[dict[str, Any]]:
    """The upstream's chunks (a whole response is one)."""
    if not streamed:
        yield json.loads(await resp.aread())
        return
    async for line in resp.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            yield json.loads(data)
        except ValueError:
            raise UpstreamError(
                f"the upstream sent a line that is not JSON: {data[:80]!r}"
            ) from None


def _choice(chunk: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for c in chunk.get("choices") or []:
        if isinstance(c, Mapping) and c.get("index", 0) == 0:
            return c
    return None


def chat_route(engine: Any, model_name: str) -> Any:
    """The ``/v1/chat/completions`` route of ``--upstream-chat`` for `engine` (an
    `UpstreamEngine`: its url, dialect, vocabulary and client options)."""
    import httpx
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def chat(request: Any) -> Any:
        payload = _payload(await request.body())
        body = chat_body(payload, engine.dialect, engine.model)
        writer = ChatWriter(engine.vocab, payload, str(payload.get("model") or model_name))
        client = httpx.AsyncClient(**engine.client_options())
        path = "/v1/chat/completions"
        try:
            resp = await client.send(client.build_request("POST", path, json=body), stream=True)
        except httpx.HTTPError as e:
            await client.aclose()
            raise _api(engine.transport_error(e)) from None
        if resp.status_code >= 400:
            text = (await resp.aread()).decode("utf-8", "replace")
            await resp.aclose()
            await client.aclose()
            raise _api(status_error(resp.status_code, text, engine.url + path))

        async def events() -> AsyncIterator[
            tuple[Mapping[str, Any] | None, list[ChannelPart], Any]
        ]:
            tracker = ChannelTracker(engine.vocab)
            try:
                async for chunk in _chunks(resp, bool(body["stream"])):
                    choice = _choice(chunk)
                    parts = tracker.feed(chunk)
                    if choice is not None and choice.get("finish_reason"):
                        parts += tracker.finish()
                    yield choice, parts, tracker
                if tracker.finish_reason is None:
                    yield None, tracker.finish(), tracker
            finally:
                await resp.aclose()
                await client.aclose()

        if not payload.get("stream"):
            parts: list[ChannelPart] = []
            seen: list[ChannelTracker] = []
            try:
                async for _, p, t in events():
                    parts += p
                    seen.append(t)
            except (UpstreamError, ValueError) as e:
                raise _api(e if isinstance(e, UpstreamError) else UpstreamError(str(e))) from None
            if not seen:
                raise _api(UpstreamError("the upstream sent no answer"))
            return JSONResponse(writer.response(seen[-1], parts))

        async def stream() -> AsyncIterator[bytes]:
            first = True
            try:
                async for choice, p, tracker in events():
                    if choice is None and not p:
                        if tracker.usage is not None and not first:
                            out = writer._envelope("chat.completion.chunk")
                            out["choices"], out["usage"] = [], dict(tracker.usage)
                            yield sse(out)
                        continue
                    up = None if choice is None else choice.get("delta", choice.get("message"))
                    out = writer.chunk(up, p, first)
                    first = False
                    if choice is not None and choice.get("finish_reason"):
                        out["choices"][0]["finish_reason"] = choice["finish_reason"]
                        out["tokentrail"]["tool_calls"] = writer.calls(tracker)
                        out["tokentrail"]["fields"] = writer.fields(tracker)
                    yield sse(out)
            except (UpstreamError, ValueError) as e:
                yield sse({"error": {"message": str(e), "type": "upstream_error"}})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Route("/v1/chat/completions", chat, methods=["POST"])
