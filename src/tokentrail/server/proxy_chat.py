"""``serve --upstream URL --upstream-chat``: chat requests go to the upstream's own chat
endpoint, so its reasoning parser, tool-call parser and constrained decoding run there,
and come back attributed per token with their channel.

`UpstreamChat` is the app's `ChatRunner` in this mode: a chat request is read, checked
(body cap, Guard, pydantic) and queued as every request is, and once the scheduler
admits it (it holds a place in the batch, so a full queue is a 429) it goes to the
upstream instead of the engine's batch, on one `httpx.AsyncClient` kept for the app's
life; the upstream's SSE is read with `httpx-sse`. The upstream's answer is read by
`tokentrail.realign.chat.ChannelTracker`; what the client gets is
the upstream's own deltas (``content``, ``reasoning`` and ``reasoning_content`` both,
``tool_calls`` as the upstream sent them, its finish reason and usage), with
``logprobs.content`` holding the content channel's tokens only and
``logprobs.reasoning_content`` the reasoning's, and the ``tokentrail`` extension's
``segments``: one per channel part, each with its ``channel``
(reasoning/content/tool_call/markup) and its tokens' byte ranges, or ``tokens: null``
and a ``reason`` where the upstream sent no token data for that text. On the last
chunk (or the response), ``tool_calls`` lists each call's ``raw`` text (the tool_call
channel's bytes) and the upstream's parsed ``name`` and ``arguments``. Logprobs follow
the server's one rule: -inf is written -9999.0 (`tokentrail.segment.WIRE_NEG_INF`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from ..engines.upstream.chat import chat_body
from ..engines.upstream.wire import status_error
from ..errors import APIError, StructureError, UpstreamError
from ..realign.chat import ChannelPart, ChannelTracker, ChatToken, arguments_span, json_span
from ..segment import Alternative, Segment, TokenSpan, confidence_of
from ..structure.fields import json_fields
from .formatting import sse
from .jobs import Job
from .protocol import GenRequest
from .wire_errors import bad_request
from .wire_tokens import spellings, wire_logprob

__all__ = ["ChatWriter", "UpstreamChat", "read_chunk"]

#: `Scheduler.release`: frees a job's place in the batch and counts its outcome.
Release = Callable[[Job, str, "float | None"], None]


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


def _api(e: UpstreamError) -> APIError:
    """The client's answer: the upstream's own 4xx as a request error, else 502/504."""
    kind = "invalid_request_error" if 400 <= e.status < 500 else "upstream_error"
    return APIError(e.status, str(e), type=kind, code=e.code)


async def _chunks(resp: Any, streamed: bool) -> AsyncIterator[dict[str, Any]]:
    """The upstream's chunks (a whole response is one). A stream is read with
    `httpx-sse` to its very end (past ``[DONE]``), so its connection can be reused."""
    from httpx_sse import EventSource

    if not streamed:
        yield _json(await resp.aread())
        return
    done = False
    async for event in EventSource(resp).aiter_sse():
        if done or not event.data:
            continue
        if event.data.strip() == "[DONE]":
            done = True
            continue
        yield _json(event.data)


def _json(data: str | bytes) -> dict[str, Any]:
    try:
        out = json.loads(data)
    except ValueError:
        raise UpstreamError(f"the upstream sent what is not JSON: {data[:80]!r}") from None
    if not isinstance(out, dict):
        raise UpstreamError(f"the upstream sent what is not a JSON object: {data[:80]!r}")
    return out


def _choice(chunk: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for c in chunk.get("choices") or []:
        if isinstance(c, Mapping) and c.get("index", 0) == 0:
            return c
    return None


class UpstreamChat:
    """The `ChatRunner` of ``--upstream-chat`` (see the module): `engine` is the
    proxy's `UpstreamEngine` (its url, dialect, vocabulary and client options), its
    one `httpx.AsyncClient` opened with the app (`open`) and closed with it (`aclose`)."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.client: Any = None
        #: Clients opened so far: one per run of the app (``/tokentrail/upstream``).
        self.clients_opened = 0

    def check(self, req: GenRequest) -> None:
        if req.n != 1:
            raise bad_request("n", "'n' must be 1 with --upstream-chat", "unsupported_value")
        if req.structure.alarm is not None:  # the upstream's chat runs without our stages
            raise bad_request(
                "tokentrail.alarm",
                "'tokentrail.alarm' is not supported with --upstream-chat (it is without it)",
                "unsupported_value",
            )
        if req.structure.branch is not None:  # the upstream's own chat cannot be rewound
            raise bad_request(
                "tokentrail.branch",
                "'tokentrail.branch' is not supported with --upstream-chat: use an "
                "in-process engine",
                "unsupported_value",
            )
        if req.structure.retry is not None:  # the upstream's chat cannot take tokens back
            raise bad_request(
                "tokentrail.retry", "'tokentrail.retry' is not supported with --upstream-chat",
                "unsupported_value",
            )

    def open(self) -> None:
        import httpx

        if self.client is None:  # the scheduler caps the requests; idle ones are kept
            limits = httpx.Limits(
                max_connections=None, max_keepalive_connections=self.engine.capacity
            )
            self.client = httpx.AsyncClient(limits=limits, **self.engine.client_options())
            self.clients_opened += 1

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    def stats(self) -> dict[str, Any]:
        return {"chat_clients_opened": self.clients_opened}

    async def run(
        self, job: Job, body: dict[str, Any], release: Release
    ) -> dict[str, Any] | AsyncIterator[bytes] | None:
        """Send `job`'s chat request (`body`, validated) upstream: the whole response,
        or (``stream``) an SSE body, or None when the client left first; `release` is
        called once when the answer ends (a stream's when it is closed). The upstream's
        refusal is an APIError, before anything is sent to the client."""
        try:
            resp, sent = await self._send(body)
        except BaseException:
            release(job, "failed", None)
            raise
        writer = ChatWriter(self.engine.vocab, body, self.model_name, job.id)
        answer = _Answer(self, job, resp, bool(sent["stream"]), writer, release)
        if body.get("stream"):
            return answer
        return await answer.whole()

    async def _send(self, payload: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        import httpx

        if self.client is None:
            self.open()
        engine, client = self.engine, self.client
        body = chat_body(payload, engine.dialect, engine.model)
        path = "/v1/chat/completions"
        try:
            resp = await client.send(client.build_request("POST", path, json=body), stream=True)
        except httpx.HTTPError as e:
            raise _api(engine.transport_error(e)) from None
        if resp.status_code >= 400:
            text = (await resp.aread()).decode("utf-8", "replace")
            await resp.aclose()
            raise _api(status_error(resp.status_code, text, engine.url + path))
        return resp, body


class _Answer:
    """One upstream answer being read (`UpstreamChat.run`): as one response (`whole`),
    or as our SSE chunks (it is their async iterator, and frees the job's place when
    closed, started or not)."""

    def __init__(
        self, runner: UpstreamChat, job: Job, resp: Any, streamed: bool, writer: ChatWriter,
        release: Release,
    ) -> None:  # fmt: skip
        self.runner = runner
        self.job = job
        self.resp = resp
        self.streamed = streamed
        self.writer = writer
        self.tracker = ChannelTracker(runner.engine.vocab)
        self._release: Release | None = release
        self._ttft: float | None = None
        self._outcome = "cancelled"
        self._body = self._stream()
        self._gone: asyncio.Future[Any] | None = None  # the client's hang-up, once asked

    def _end(self, outcome: str) -> None:
        if self._release is not None:
            self._release(self.job, outcome, self._ttft)
            self._release = None

    async def _events(self) -> AsyncIterator[tuple[Mapping[str, Any] | None, list[ChannelPart]]]:
        """(the upstream's choice 0, the parts it made final) per chunk; (None, the rest)
        at the end when the upstream sent no finish reason."""
        import httpx

        tracker, job = self.tracker, self.job
        try:
            async for chunk in _chunks(self.resp, self.streamed):
                choice, parts = read_chunk(tracker, chunk)
                job.generated = len(tracker.tokens)
                if self._ttft is None and tracker.tokens:
                    self._ttft = time.monotonic() - job.submitted
                yield choice, parts
            if tracker.finish_reason is None:
                yield None, tracker.finish()
        except httpx.HTTPError as e:
            raise self.runner.engine.transport_error(e) from None
        except ValueError as e:  # what the tracker cannot read
            raise UpstreamError(str(e)) from None
        finally:
            await self.resp.aclose()

    async def _collect(self) -> dict[str, Any]:
        parts: list[ChannelPart] = []
        seen = False
        try:
            async for _, p in self._events():
                parts += p
                seen = True
        except UpstreamError as e:
            raise _api(e) from None
        if not seen:
            raise _api(UpstreamError("the upstream sent no answer"))
        return self.writer.response(self.tracker, parts)

    async def whole(self) -> dict[str, Any] | None:
        """The whole response; None when the client hung up first (the upstream's
        answer is then closed, which stops it)."""
        collect = asyncio.ensure_future(self._collect())
        gone = asyncio.ensure_future(self.job.next_event())  # only "cancelled" comes now
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not collect.done():
            collect.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collect
            await self.resp.aclose()
            self._end("cancelled")
            return None
        try:
            out = collect.result()
        except BaseException:
            self._end("failed")
            raise
        self._end("completed")
        return out

    async def _stream(self) -> AsyncIterator[bytes]:
        writer, tracker = self.writer, self.tracker
        try:
            async for choice, p in self._events():
                out = writer.event(tracker, choice, p)
                if out is not None:
                    yield sse(out)
            self._outcome = "completed"
        except UpstreamError as e:
            self._outcome = "failed"
            yield sse({"error": {"message": str(e), "type": "upstream_error"}})
        yield b"data: [DONE]\n\n"

    def __aiter__(self) -> _Answer:
        return self

    async def __anext__(self) -> bytes:
        """The next SSE event; the end as soon as the client hangs up (the job's
        "cancelled"), even while the upstream sends nothing."""
        if self._gone is None:
            self._gone = asyncio.ensure_future(self.job.next_event())  # only "cancelled"
        step = asyncio.ensure_future(anext(self._body))
        await asyncio.wait({step, self._gone}, return_when=asyncio.FIRST_COMPLETED)
        if not step.done():
            step.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await step
            raise StopAsyncIteration
        try:
            return step.result()
        except StopAsyncIteration:
            raise
        except Exception:
            self._outcome = "failed"
            raise

    async def aclose(self) -> None:
        try:
            if self._gone is not None:
                self._gone.cancel()
            await self._body.aclose()
            await self.resp.aclose()
        finally:  # a client dropped for not reading (`Job.drop`) counts as on the main path
            dropped = self.job.dropped and self._outcome == "cancelled"
            self._end("dropped" if dropped else self._outcome)
