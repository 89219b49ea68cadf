"""Several prompts in one ``/v1/completions`` request, as OpenAI's API allows: ``prompt``
as an array of strings or an array of token-id arrays (lm-evaluation-harness's
``local-completions`` sends its batches so; vLLM and llama-server answer them too).

Each prompt becomes a job of its own in the scheduler (so they are batched with every
other request, admitted and limited like any other), and the answers are put together
as OpenAI does: choice ``index`` = prompt index × ``n`` + choice, one response ``id``,
``usage`` summed over the prompts (their prompt tokens and every choice's completion
tokens). Streamed, the prompts' chunks interleave as they are made, each with its own
index, then one usage chunk (``stream_options.include_usage``) and ``[DONE]``. A prompt
the model rejects before any output fails the whole request with that prompt's error;
one that fails mid-stream ends the stream with its error event and stops the others.
A hang-up or a client that stops reading stops every prompt's generation.

``tokentrail.vote`` counts the choices of one prompt, so it is refused with several.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ..sampling import is_int
from .answers import (
    empty_response,
    gather,
    generation_error,
    json_response,
    stream_events,
    watch_disconnect,
)
from .formatting import Formatter, merge_responses, sse, usage
from .jobs import Job
from .protocol import GenRequest
from .sse import EventStream
from .wire_errors import bad_request

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

logger = logging.getLogger("tokentrail.server")

__all__ = [
    "MAX_PROMPTS",
    "JobGroup",
    "answer_several",
    "merge_answers",
    "merge_streams",
    "split_prompts",
]

#: The most prompts one request may hold.
MAX_PROMPTS = 64


def split_prompts(body: Any) -> list[dict[str, Any]] | None:
    """The request body once per prompt when its ``prompt`` holds several (an array of
    strings or of token-id arrays), else None (one prompt: validated as usual)."""
    if not isinstance(body, dict):
        return None
    prompt = body.get("prompt")
    if not (isinstance(prompt, list) and len(prompt) > 1):
        return None
    if not all(map(_one_prompt, prompt)):
        return None  # token ids (one prompt), or a shape the usual check names
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(
            "prompt", f"holds {len(prompt)} prompts; at most {MAX_PROMPTS} per request"
        )
    tail = body.get("tokentrail")
    if isinstance(tail, dict) and tail.get("vote") is not None:
        raise bad_request(
            "tokentrail.vote",
            "counts the choices of one prompt; send one prompt per request to vote",
            code="unsupported_value",
        )
    return [{**body, "prompt": p} for p in prompt]


def _one_prompt(value: Any) -> bool:
    """A string, or a non-empty array of token ids (each checked later, as one prompt)."""
    if isinstance(value, str):
        return True
    return isinstance(value, list) and bool(value) and all(map(is_int, value))


class JobGroup:
    """The jobs of one request's prompts, stopped together (what `EventStream` and the
    disconnect watcher need of a `Job`)."""

    def __init__(self, request_id: str, jobs: list[Job]) -> None:
        self.id = request_id
        self.jobs = jobs

    def cancel(self, reason: str) -> None:
        for job in self.jobs:
            job.cancel(reason)

    def drop(self, reason: str) -> None:
        for job in self.jobs:
            job.drop(reason)


def merge_answers(answers: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One response from each prompt's choices' responses (in prompt order): every
    choice, usage summed over the prompts and their choices."""
    flat = [r for rs in answers for r in rs]
    out = merge_responses(flat)
    firsts = [rs[0]["usage"] for rs in answers]
    out["usage"] = usage(
        sum(u["prompt_tokens"] for u in firsts),
        sum(r["usage"]["completion_tokens"] for r in flat),
        sum(u["prompt_tokens_details"]["cached_tokens"] for u in firsts),
    )
    return out


async def merge_streams(
    streams: list[AsyncIterator[bytes]],
    ended: list[list[str]],
    fmts: list[list[Formatter]],
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """The SSE body of several prompts: each prompt's items as they come (`streams`,
    each appending how it ended to its `ended` list), then the usage chunk and
    ``[DONE]`` once all have ended; an error or a cancellation ends it at once."""
    queue: asyncio.Queue[tuple[int, bytes | None]] = asyncio.Queue(maxsize=len(streams))

    async def pump(i: int, stream: AsyncIterator[bytes]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except Exception:  # (not expected: a prompt's stream ends with its own error event)
            logger.exception("the stream of prompt %d failed", i)
            ended[i].append("error")
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is not None:
                yield item
                continue
            left -= 1
            if ended[i] != ["done"]:  # an error or a cancellation: the answer ends here
                return
        if include_usage:
            chunk = fmts[0][0].usage_chunk()
            chunk["usage"] = usage(
                sum(f[0].prompt_tokens for f in fmts),
                sum(c.n_tokens for f in fmts for c in f),
                sum(f[0].cached_tokens for f in fmts),
            )
            yield sse(chunk)
        yield b"data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):  # (wait never raises the tasks')
            await asyncio.wait(tasks)
        for stream in streams:
            with contextlib.suppress(BaseException):
                await stream.aclose()  # type: ignore[attr-defined]


async def answer_several(
    request: Request, reqs: list[GenRequest], scheduler: Any, vocab: Any
) -> Response:
    """The answer to a completions request with several prompts (`reqs`, one each): a
    job per prompt on `scheduler`, answered together (see the module)."""
    rid = "cmpl-" + uuid.uuid4().hex[:24]
    loop = asyncio.get_running_loop()
    group = JobGroup(rid, [])
    try:
        for i, req in enumerate(reqs):
            job = Job(id=f"{rid}-{i}", request=req, loop=loop)
            scheduler.submit(job)  # QueueFull: the request is refused whole
            group.jobs.append(job)
    except BaseException:
        group.cancel("request refused")
        raise
    watcher = asyncio.create_task(watch_disconnect(request.receive, group))  # type: ignore[arg-type]
    handed_over = False
    try:
        firsts = [await job.next_event() for job in group.jobs]
        for event in firsts:
            if event[0] == "error":
                raise generation_error(event[2])
            if event[0] == "cancelled":
                return empty_response(499)
        fmts = [[Formatter(rid, req, vocab, i * req.n + c, several=True) for c in range(req.n)]
                for i, req in enumerate(reqs)]  # fmt: skip
        jobs = group.jobs
        if reqs[0].stream:
            ended: list[list[str]] = [[] for _ in jobs]
            streams = [stream_events(job, f, e, ended=d)
                       for job, f, e, d in zip(jobs, fmts, firsts, ended, strict=True)]  # fmt: skip
            body = merge_streams(streams, ended, fmts, reqs[0].include_usage)
            handed_over = True
            return EventStream(body, group, watcher, scheduler.client_timeout)  # type: ignore[arg-type,return-value]
        answers = await asyncio.gather(
            *(gather(job, f, e) for job, f, e in zip(jobs, fmts, firsts, strict=True))
        )
        if any(a is None for a in answers):
            return empty_response(499)
        return json_response(merge_answers(answers))  # type: ignore[arg-type]
    finally:
        if not handed_over:
            watcher.cancel()
            group.cancel("request ended")
