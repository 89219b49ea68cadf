"""A request's answer from its job's events: collected into one response (`collect`,
`gather`) or streamed as server-sent events (`stream_events`), and the plain responses
and the error mapping the routes share."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import APIError, EngineError
from .formatting import Formatter, merge_responses, sse, usage
from .jobs import Job
from .voting import VoteBox

if TYPE_CHECKING:
    from starlette.responses import Response
    from starlette.types import Receive

logger = logging.getLogger("tokentrail.server")

__all__ = [
    "collect",
    "empty_response",
    "gather",
    "generation_error",
    "json_response",
    "stream_events",
    "watch_disconnect",
]


def json_response(
    obj: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    from starlette.responses import JSONResponse

    return JSONResponse(obj, status_code=status, headers=dict(headers or {}))


def empty_response(status: int) -> Response:
    from starlette.responses import Response

    return Response(status_code=status)


async def watch_disconnect(receive: Receive, job: Job) -> None:
    """Cancel `job` as soon as the client hangs up (the request body is already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            job.cancel("client disconnected")
            return


async def collect(
    job: Job, fmts: list[Formatter], event: Any, box: VoteBox | None = None
) -> Response:
    responses = await gather(job, fmts, event, box)
    if responses is None:
        return empty_response(499)
    merged = merge_responses(responses)
    if box is not None:
        merged["tokentrail"]["vote"] = box.result()
        if job.early_stop is not None:
            merged["usage"]["tokentrail"] = job.early_stop.usage()
    return json_response(merged)

async def gather(
    job: Job, fmts: list[Formatter], event: Any, box: VoteBox | None = None
) -> list[dict[str, Any]] | None:
    """Each choice's whole response once every choice has ended (None: cancelled)."""
    steps: list[list[Any]] = [[] for _ in fmts]
    open_choices = len(fmts)
    while True:
        kind, choice, value = event
        if kind == "step":
            steps[choice].append(value)
            if box is not None:
                box.add(choice, value)
        elif kind == "done":
            open_choices -= 1
            if open_choices == 0:
                break
        elif kind == "error":
            raise generation_error(value)
        else:  # cancelled
            return None
        event = await job.next_event()
    responses = [f.response(s) for f, s in zip(fmts, steps, strict=True)]
    if box is not None:
        for choice, r in enumerate(responses):
            r["tokentrail"]["ballot"] = box.ballot(choice)
    return responses

async def stream_events(
    job: Job, fmts: list[Formatter], event: Any, box: VoteBox | None = None,
    ended: list[str] | None = None,
) -> AsyncIterator[bytes]:
    """The SSE body: each event's chunk, and every event that had arrived with it in
    the same item (one send, not one per token, when the client's tokens come
    faster than they are written). With `ended` (one prompt of several,
    `server.prompts`): no usage chunk and no ``[DONE]``; how it ended ("done",
    "error", "cancelled") is appended to `ended`."""
    open_choices = len(fmts)
    parts: list[bytes] = []
    while True:
        kind, choice, value = event
        if kind == "step":
            chunk = fmts[choice].chunk(value)
            if box is not None:
                box.add(choice, value)
                if value.finish_reason is not None:
                    chunk["tokentrail"]["ballot"] = box.ballot(choice)
            parts.append(sse(chunk))
        elif kind == "done":
            if fmts[choice].req.prompt_only:
                parts.append(sse(fmts[choice].prompt_chunk()))
            open_choices -= 1
            if open_choices == 0:
                break
        elif kind == "error":
            logger.error("generation %s failed mid-stream: %s", job.id, value)
            parts.append(sse(generation_error(value).body()))
            if ended is not None:
                ended.append("error")
            yield b"".join(parts)
            return
        else:  # cancelled
            if ended is not None:
                ended.append("cancelled")
            if parts:
                yield b"".join(parts)
            return
        ready = job.ready_event()
        if ready is None:
            if parts:
                yield parts[0] if len(parts) == 1 else b"".join(parts)
                parts = []
            ready = await job.next_event()
        event = ready
    if ended is not None:
        ended.append("done")
        if parts:
            yield b"".join(parts)
        return
    if box is not None:  # the vote, once every choice has ended: a chunk of its own
        chunk = fmts[0].usage_chunk()
        del chunk["usage"]
        chunk["tokentrail"] = {"vote": box.result()}
        parts.append(sse(chunk))
    if fmts[0].req.include_usage:
        chunk = fmts[0].usage_chunk()
        chunk["usage"] = usage(
            fmts[0].prompt_tokens, sum(f.n_tokens for f in fmts), fmts[0].cached_tokens
        )
        if job.early_stop is not None:
            chunk["usage"]["tokentrail"] = job.early_stop.usage()
        parts.append(sse(chunk))
    parts.append(b"data: [DONE]\n\n")
    yield b"".join(parts)


def generation_error(exc: BaseException) -> APIError:
    """Map an engine exception to a client error (bad prompt/value) or a server error."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineError):  # e.g. an upstream that is gone (502) or slow (504)
        kind = "invalid_request_error" if 400 <= exc.status < 500 else "upstream_error"
        return APIError(exc.status, str(exc), type=kind, code=exc.code)
    if isinstance(exc, ValueError | TypeError):
        # A ConstraintError (e.g. a constraint the upstream cannot serve) names its field.
        param = getattr(exc, "param", None)
        return APIError(
            400, f"the model rejected the request: {exc}", code="invalid_request", param=param
        )
    return APIError(
        500,
        f"generation failed: {type(exc).__name__}: {exc}",
        type="server_error",
        code="internal_error",
    )
