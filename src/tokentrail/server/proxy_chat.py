"""``serve --upstream URL --upstream-chat``: chat requests go to the upstream's own chat
endpoint, so its reasoning parser, tool-call parser and constrained decoding run there,
and come back attributed per token with their channel.

`UpstreamChat` is the app's `ChatRunner` in this mode: a chat request is read, checked
(body cap, Guard, pydantic) and queued as every request is, and once the scheduler
admits it (it holds a place in the batch, so a full queue is a 429) it goes to the
upstream instead of the engine's batch, on one `httpx.AsyncClient` kept for the app's
life; the upstream's SSE is read with `httpx-sse`. The upstream's answer is read by
`tokentrail.realign.chat.ChannelTracker` and written by `server.chat_writer.ChatWriter`;
what the client gets is
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
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from ..engines.upstream.chat import chat_body
from ..engines.upstream.wire import status_error
from ..errors import APIError, UpstreamError
from ..realign.chat import ChannelPart, ChannelTracker
from .chat_writer import ChatWriter, read_chunk
from .formatting import sse
from .jobs import Job
from .protocol import GenRequest
from .wire_errors import bad_request

__all__ = ["UpstreamChat"]

#: `Scheduler.release`: frees a job's place in the batch and counts its outcome.
Release = Callable[[Job, str, "float | None"], None]


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
