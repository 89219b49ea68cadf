"""OpenAI-compatible HTTP server whose every chunk says which tokens made its text.

``tokentrail serve`` (or ``create_app()`` for an ASGI app) serves one model with:

- ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` in the
  OpenAI shape, streamed (server-sent events ending with ``data: [DONE]``) or not;
- ``GET /health``: queue and generation counters (also the proof that a client who
  hangs up stops its generation);
- ``GET /``: a page that streams an answer and shades each segment by confidence.

Streaming emits one chunk per generated token, in order, including tokens whose text
is not final yet (their chunk has empty content) and the end-of-sequence token. Each
chunk's content is exactly the text that became final with that token, so the
concatenated content equals the non-streamed content for the same seed. Standard
``logprobs`` carry each token's text, logprob and *raw* ``bytes`` (never U+FFFD
stand-ins) with ``top_logprobs`` alternatives.

The extension field
-------------------
Every chunk (and every non-streamed response) has a top-level ``"tokentrail"`` object::

    "tokentrail": {
      "token": {"index": 3, "id": 318, "text": " is", "bytes": [32, 105, 115],
                "logprob": -0.41},                 # streamed chunks: this step's token
      "segments": [                                # text that became final, with the
        {"text": " is",                            # tokens behind it (0 or 1 per chunk;
         "tokens": [{"index": 3, "id": 318,        # all of them when not streamed)
                     "start": 0, "end": 3,         # byte range of the token used here
                     "logprob": -0.41,
                     "text": " is", "bytes": [32, 105, 115],
                     "top_logprobs": [{"id": 318, "logprob": -0.41,
                                       "bytes": [32, 105, 115], "text": " is"}, ...]}],
         "confidence": {"mean_logprob": -0.41, "min_logprob": -0.41,
                        "perplexity": 1.5, "probability": 0.66,
                        "entropy": 0.9, "n_tokens": 1}}],
      "stop": {"string": "\\n\\n", "tokens": [...]}    # only when a stop string ended it
    }

A token whose bytes are split between segments (a multi-byte character cut between
tokens) is listed in each, with the byte range it gave to that one. ``top_logprobs`` in
the extension appear only when the request asked for alternatives. Logprobs of
``-inf`` are sent as ``-9999.0`` (as OpenAI does) and non-finite confidence figures as
``null``, so that the JSON stays standard.

Completions ``logprobs.text_offset`` gives, for each token, the length of the
completion text that was final when the token was generated: where its text starts
when it is final at once, where the held-back text starts when it is not.

Concurrency: one worker thread owns the model and runs one generation at a time;
requests wait in a FIFO queue (``max_queue`` waiting at most, more are answered 429
with ``Retry-After``). A client that disconnects cancels its request, queued or
running; the running generation stops before its next model step.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import queue
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .segment import Alternative, Confidence, TokenSpan
from .vocab import Vocab

if TYPE_CHECKING:  # Starlette is imported only when an app is built (the server extra)
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.types import Receive, Scope, Send

logger = logging.getLogger("tokentrail.server")

STATIC_DIR = Path(__file__).resolve().parent / "static"

DEFAULT_MAX_QUEUE = 16
DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_TOKENS = 256
#: Most alternatives per token (OpenAI's limit for chat `top_logprobs`).
MAX_TOP_LOGPROBS = 20
#: Most steps a job may run ahead of its reader before the worker waits for it.
STEP_WINDOW = 256
MAX_STOP_STRINGS = 16
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
#: How many finished jobs /health remembers.
RECENT_JOBS = 32

Kind = Literal["chat", "completion"]


# -- errors -----------------------------------------------------------------------------


class APIError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Response:
        return _json_response(self.body(), self.status, self.headers)


class QueueFull(APIError):
    """Raised by `Engine.submit` when `max_queue` requests are already waiting."""

    def __init__(self, waiting: int, retry_after: int) -> None:
        super().__init__(
            429,
            f"the server is busy: {waiting} requests are already waiting; retry after "
            f"{retry_after} s",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(retry_after)},
        )


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# -- request validation -------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }.get(type(value), type(value).__name__)


def _opt_int(body: Mapping[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise _bad(name, f"'{name}' must be an integer, got {_type_name(value)}", "invalid_type")
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise _bad(name, f"'{name}' must be {bound}, got {value}")
    return int(value)


def _opt_number(
    body: Mapping[str, Any],
    name: str,
    lo: float,
    hi: float,
    *,
    lo_open: bool = False,
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_number(value):
        raise _bad(
            name, f"'{name}' must be a finite number, got {_type_name(value)}", "invalid_type"
        )
    if value < lo or value > hi or (lo_open and value == lo):
        left = "(" if lo_open else "["
        raise _bad(name, f"'{name}' must be in {left}{lo:g}, {hi:g}], got {value}")
    return float(value)


def _opt_bool(body: Mapping[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise _bad(name, f"'{name}' must be a boolean, got {_type_name(value)}", "invalid_type")
    return value


@dataclass
class GenRequest:
    """A validated request, in the terms `stream_generate` takes."""

    kind: Kind
    prompt: str | list[int] | list[dict[str, str]]
    model: str
    stream: bool = False
    include_usage: bool = False
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    logit_bias: dict[int, float] | None = None
    #: Whether OpenAI `logprobs` are returned, and how many alternatives per token.
    logprobs: bool = False
    top_logprobs: int = 0

    def generate_kwargs(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "temp": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "logit_bias": self.logit_bias,
            "top_logprobs": self.top_logprobs,
            "stop": self.stop,
        }


def _parse_common(body: Mapping[str, Any], kind: Kind, model: str, vocab_size: int) -> GenRequest:
    """Check the fields chat and completions share; raise APIError naming the field."""
    req = GenRequest(kind=kind, prompt="", model=model)
    n = _opt_int(body, "n", 1)
    if n is not None and n != 1:
        raise _bad("n", f"only n=1 is supported, got n={n}", "unsupported_value")
    best_of = _opt_int(body, "best_of", 1)
    if best_of is not None and best_of != 1:
        raise _bad("best_of", f"only best_of=1 is supported, got {best_of}", "unsupported_value")
    stream = _opt_bool(body, "stream")
    req.stream = bool(stream)
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise _bad(
                "stream_options",
                f"'stream_options' must be an object, got {_type_name(opts)}",
                "invalid_type",
            )
        if not req.stream:
            raise _bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
        include = _opt_bool(opts, "include_usage")
        req.include_usage = bool(include)
    max_tokens = _opt_int(body, "max_tokens", 1, 2**31 - 1)
    if kind == "chat":
        mct = _opt_int(body, "max_completion_tokens", 1, 2**31 - 1)
        if mct is not None:
            if max_tokens is not None and max_tokens != mct:
                raise _bad(
                    "max_completion_tokens",
                    "'max_tokens' and 'max_completion_tokens' disagree; give one of them",
                )
            max_tokens = mct
    if max_tokens is not None:
        req.max_tokens = max_tokens
    temperature = _opt_number(body, "temperature", 0.0, 2.0)
    if temperature is not None:
        req.temperature = temperature
    top_p = _opt_number(body, "top_p", 0.0, 1.0, lo_open=True)
    if top_p is not None:
        req.top_p = top_p
    top_k = _opt_int(body, "top_k", -1)
    if top_k is not None:
        req.top_k = max(top_k, 0)  # -1 means off, as in vLLM
    min_p = _opt_number(body, "min_p", 0.0, 1.0)
    if min_p is not None:
        req.min_p = min_p
    rep = _opt_number(body, "repetition_penalty", 0.0, 100.0, lo_open=True)
    req.repetition_penalty = rep
    for name in ("presence_penalty", "frequency_penalty"):
        value = _opt_number(body, name, -2.0, 2.0)
        if value:
            raise _bad(
                name,
                f"'{name}' is not supported (use 'repetition_penalty'); send 0 or leave it out",
                "unsupported_parameter",
            )
    req.seed = _opt_int(body, "seed", 0, 2**63 - 1)
    req.stop = _parse_stop(body.get("stop"))
    req.logit_bias = _parse_logit_bias(body.get("logit_bias"), vocab_size)
    return req


def _parse_stop(value: Any) -> list[str] | None:
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        raise _bad(
            "stop",
            f"'stop' must be a string or an array of strings, got {_type_name(value)}",
            "invalid_type",
        )
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad("stop", f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    for i, s in enumerate(stops):
        if not isinstance(s, str):
            raise _bad("stop", f"'stop[{i}]' must be a string, got {_type_name(s)}", "invalid_type")
        if not s:
            raise _bad("stop", f"'stop[{i}]' must not be empty")
    return list(stops) or None


def _parse_logit_bias(value: Any, vocab_size: int) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad(
            "logit_bias",
            f"'logit_bias' must be an object of token id to bias, got {_type_name(value)}",
            "invalid_type",
        )
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            tid = int(key)
        except ValueError:
            raise _bad("logit_bias", f"'logit_bias' key {key!r} is not a token id") from None
        if not 0 <= tid < vocab_size:
            raise _bad(
                "logit_bias",
                f"'logit_bias' token id {tid} is outside the vocabulary (0..{vocab_size - 1})",
            )
        if not _is_number(bias) or not -100 <= bias <= 100:
            raise _bad(
                "logit_bias",
                f"'logit_bias' value for token {tid} must be a number in [-100, 100], got {bias!r}",
            )
        out[tid] = float(bias)
    return out or None


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _bad(
                    "messages",
                    f"'messages[{i}].content[{j}]' must be a text part "
                    '({"type": "text", "text": ...}); only text is supported',
                    "invalid_type",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad(
                    "messages",
                    f"'messages[{i}].content[{j}].text' must be a string",
                    "invalid_type",
                )
            parts.append(text)
        return "".join(parts)
    raise _bad(
        "messages",
        f"'messages[{i}].content' must be a string or an array of text parts, "
        f"got {_type_name(content)}",
        "invalid_type",
    )


def parse_chat(body: Mapping[str, Any], model: str, vocab_size: int) -> GenRequest:
    """Validate a /v1/chat/completions body."""
    req = _parse_common(body, "chat", model, vocab_size)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        what = "missing" if messages is None else _type_name(messages)
        raise _bad(
            "messages",
            f"'messages' must be a non-empty array of messages, got {what}",
            "invalid_type" if messages is not None else "missing_required_parameter",
        )
    out: list[dict[str, str]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise _bad(
                "messages",
                f"'messages[{i}]' must be an object, got {_type_name(msg)}",
                "invalid_type",
            )
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise _bad(
                "messages",
                f"'messages[{i}].role' must be one of {sorted(CHAT_ROLES)}, got {role!r}",
            )
        content = msg.get("content")
        if content is None and role == "assistant":
            content = ""
        out.append(
            {
                "role": "system" if role == "developer" else role,
                "content": _message_text(content, i),
            }
        )
    req.prompt = out
    for name in ("tools", "functions"):
        if body.get(name):
            raise _bad(name, f"'{name}' (tool calling) is not supported", "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise _bad(
            "response_format",
            'only \'response_format\' {"type": "text"} is supported',
            "unsupported_parameter",
        )
    logprobs = _opt_bool(body, "logprobs")
    top = _opt_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise _bad("top_logprobs", "'top_logprobs' needs 'logprobs' set to true")
    req.logprobs = bool(logprobs)
    req.top_logprobs = top or 0
    return req


def parse_completion(body: Mapping[str, Any], model: str, vocab_size: int) -> GenRequest:
    """Validate a /v1/completions body."""
    req = _parse_common(body, "completion", model, vocab_size)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt", "'prompt' must not be empty")
        req.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise _bad(
                "prompt", f"'prompt' token id {bad} is outside the vocabulary (0..{vocab_size - 1})"
            )
        req.prompt = [int(t) for t in prompt]
    elif (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, str | list) for p in prompt)
    ):
        raise _bad("prompt", "only one prompt per request is supported", "unsupported_value")
    else:
        what = "missing" if prompt is None else _type_name(prompt)
        raise _bad(
            "prompt",
            f"'prompt' must be a string or a non-empty array of token ids, got {what}",
            "invalid_type" if prompt is not None else "missing_required_parameter",
        )
    if body.get("echo"):
        raise _bad("echo", "'echo' is not supported", "unsupported_parameter")
    if body.get("suffix") is not None:
        raise _bad("suffix", "'suffix' is not supported", "unsupported_parameter")
    logprobs = _opt_int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    req.logprobs = logprobs is not None
    req.top_logprobs = logprobs or 0
    return req


# -- the generation worker ------------------------------------------------------------------


@dataclass(slots=True)
class Step:
    """One generated token and what it finalised, without engine arrays (thread-safe)."""

    index: int
    token: int
    text: str
    logprob: float
    top: tuple[Alternative, ...]
    segment_tokens: tuple[TokenSpan, ...]
    confidence: Confidence | None
    finish_reason: str | None
    stop_string: str | None
    stop_tokens: tuple[TokenSpan, ...]
    prompt_tokens: int
    #: Tokens the engine did not identify (an upstream's lossy data): index, id, reason.
    refused: tuple[dict[str, Any], ...] = ()


EventKind = Literal["step", "done", "error", "cancelled"]


@dataclass(eq=False)
class Job:
    """One request's generation: filled by the worker thread, read on the event loop."""

    id: str
    request: GenRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[tuple[EventKind, Any]] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    window: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(STEP_WINDOW))
    generated: int = 0
    outcome: str = "queued"
    submitted: float = field(default_factory=time.monotonic)

    def post(self, kind: EventKind, value: Any = None) -> None:
        """Hand an event to the reader (called from the worker thread)."""
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is reading
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def cancel(self, reason: str) -> None:
        """Stop this job (called on the event loop); wakes a reader waiting on it."""
        if not self.cancelled.is_set():
            logger.debug("cancelling %s: %s", self.id, reason)
            self.cancelled.set()
            self.events.put_nowait(("cancelled", reason))

    async def next_event(self) -> tuple[EventKind, Any]:
        kind, value = await self.events.get()
        if kind == "step":
            self.window.release()
        return kind, value


def _served_name(model_path: str | os.PathLike[str] | None) -> str:
    if model_path is None:
        return "tokentrail-demo"
    return Path(model_path).resolve().name or str(model_path)


class Engine:
    """Owns the model; runs queued jobs one at a time, in order, on one thread.

    One thread does all model work (loading included, when given a path), so engine
    state such as MLX streams never crosses threads and two requests never interleave.
    """

    def __init__(
        self,
        model: Any = None,
        tokenizer: Any = None,
        model_path: str | os.PathLike[str] | None = None,
        *,
        max_queue: int = DEFAULT_MAX_QUEUE,
        model_name: str | None = None,
        generate_fn: Callable[..., Iterator[Any]] | None = None,
        engine: str = "mlx",
        load_options: dict[str, Any] | None = None,
    ) -> None:
        if (model is None) != (tokenizer is None):
            raise ValueError("pass both model and tokenizer, or neither (to load model_path)")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.model = model
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.engine_name = engine
        self.load_options = dict(load_options or {})
        self.max_queue = max_queue
        self.model_name = model_name or _served_name(model_path)
        self.created = int(time.time())
        self.vocab: Vocab | None = None
        self._generate_fn = generate_fn
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._active: Job | None = None
        self._waiting = 0
        self._counts = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0}
        self._generated_tokens = 0
        self._recent: deque[dict[str, Any]] = deque(maxlen=RECENT_JOBS)
        self._step_seconds: deque[float] = deque(maxlen=64)
        self._job_tokens: deque[int] = deque(maxlen=64)

    # -- lifecycle --

    def start(self, timeout: float | None = None) -> None:
        """Start the worker and wait until the model is loaded; re-raise a load error."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="tokentrail-generate", daemon=True
                )
                self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the model did not load within {timeout} s")
        if self._load_error is not None:
            raise self._load_error

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the running job, drop the queue and join the worker."""
        thread = self._thread
        if thread is None:
            return
        with self._lock:
            active = self._active
        if active is not None:
            active.cancelled.set()
        self._queue.put(None)
        thread.join(timeout)
        self._thread = None

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._load_error is None

    # -- API used by the HTTP layer --

    def submit(self, job: Job) -> None:
        """Queue `job` (FIFO); raise QueueFull when `max_queue` jobs already wait."""
        with self._lock:
            in_system = self._waiting + (self._active is not None)
            if in_system > self.max_queue:  # one may run, max_queue may wait
                self._counts["rejected"] += 1
                raise QueueFull(self._waiting, self._retry_after())
            self._waiting += 1
        self._queue.put(job)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            active = self._active
            return {
                "status": "ok" if self.ready else ("error" if self._load_error else "loading"),
                "model": self.model_name,
                "active": 0 if active is None else 1,
                "queued": self._waiting,
                "max_queue": self.max_queue,
                **self._counts,
                "generated_tokens": self._generated_tokens,
                "running": None
                if active is None
                else {"id": active.id, "generated_tokens": active.generated},
                "recent": list(self._recent),
            }

    def _retry_after(self) -> int:
        """Seconds until a queue slot is likely free, from recent job durations."""
        if not self._step_seconds or not self._job_tokens:
            return 1
        per_step = sum(self._step_seconds) / len(self._step_seconds)
        per_job = sum(self._job_tokens) / len(self._job_tokens)
        return max(1, min(60, math.ceil(per_step * per_job)))

    # -- worker thread --

    def _run(self) -> None:
        try:
            self._load()
        except BaseException as e:  # re-raised by start(); the worker has nothing to do
            logger.debug("loading the model failed", exc_info=True)
            self._load_error = e
            self._ready.set()
            return
        self._ready.set()
        while True:
            job = self._queue.get()
            if job is None:
                break
            with self._lock:
                self._waiting -= 1
                if job.cancelled.is_set():
                    self._finish(job, "cancelled")
                    continue
                self._active = job
            try:
                self._generate(job)
            except (ValueError, TypeError) as e:  # the request did not suit the model
                logger.info("generation %s refused: %s", job.id, e)
                job.post("error", e)
                with self._lock:
                    self._finish(job, "failed")
            except Exception as e:
                logger.exception("generation %s failed", job.id)
                job.post("error", e)
                with self._lock:
                    self._finish(job, "failed")
            finally:
                with self._lock:
                    self._active = None
        # Drain: nobody will run what is still queued.
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.post("cancelled", "server shutting down")

    def _load(self) -> None:
        if self.model is None:
            from . import generate

            logger.debug("loading model %s", self.model_path or "(built-in demo model)")
            self.model, self.tokenizer = generate.load(
                self.model_path, engine=self.engine_name, **self.load_options
            )
        if self._generate_fn is None:
            from . import generate

            self._generate_fn = generate.stream_generate
        self.vocab = _vocab_of(self.tokenizer)

    def _finish(self, job: Job, outcome: str) -> None:
        """Record a finished job (caller holds the lock)."""
        job.outcome = outcome
        self._counts[outcome] += 1
        self._recent.append({"id": job.id, "outcome": outcome, "generated_tokens": job.generated})

    def _generate(self, job: Job) -> None:
        assert self._generate_fn is not None and self.vocab is not None
        req = job.request
        gen = self._generate_fn(self.model, self.tokenizer, req.prompt, **req.generate_kwargs())
        started = time.perf_counter()
        index = 0
        outcome = "completed"
        try:
            while True:
                # Back-pressure: never run more than STEP_WINDOW steps ahead of the reader.
                while not job.window.acquire(timeout=0.05):
                    if job.cancelled.is_set():
                        break
                if job.cancelled.is_set():
                    outcome = "cancelled"
                    break
                try:
                    response = next(gen)
                except StopIteration:
                    break
                step = _step_of(response, index)
                index += 1
                with self._lock:
                    job.generated = index
                    self._generated_tokens += 1
                job.post("step", step)
                if step.finish_reason is not None:
                    break
        finally:
            gen.close()  # no further model steps
        if index:
            self._step_seconds.append((time.perf_counter() - started) / index)
            self._job_tokens.append(index)
        if outcome == "cancelled":
            job.post("cancelled", "cancelled")
        else:
            job.post("done", None)
        with self._lock:
            self._finish(job, outcome)


def _vocab_of(tokenizer: Any) -> Vocab:
    """The tokenizer's `Vocab` (for each token's raw bytes and text)."""
    from .loaders import load_vocab

    for owner in (tokenizer, getattr(tokenizer, "_tokenizer", None)):
        found = getattr(owner, "__dict__", {}).get("vocab") if owner is not None else None
        if isinstance(found, Vocab):
            return found
    return load_vocab(tokenizer)


def _step_of(response: Any, index: int) -> Step:
    """Copy what the HTTP layer needs out of a GenerationResponse."""
    return Step(
        index=index,
        token=int(response.token),
        text=response.text or "",
        logprob=float(response.token_logprob),
        top=tuple(response.top_logprobs or ()),
        segment_tokens=tuple(response.last_segment_tokens or ()),
        confidence=response.confidence,
        finish_reason=response.finish_reason,
        stop_string=getattr(response, "stop_string", None),
        stop_tokens=tuple(getattr(response, "stop_tokens", None) or ()),
        prompt_tokens=int(getattr(response, "prompt_tokens", 0) or 0),
        refused=tuple(getattr(response, "refused", None) or ()),
    )


# -- response formatting ----------------------------------------------------------------------


def _lp(value: float | None) -> float | None:
    """A logprob JSON can carry: -inf becomes -9999.0 as in OpenAI's API."""
    if value is None:
        return None
    if math.isnan(value):
        return None
    return value if math.isfinite(value) else -9999.0


def _finite(value: Any) -> Any:
    return value if not isinstance(value, float) or math.isfinite(value) else None


class Formatter:
    """Turns one job's steps into OpenAI chunks/responses with the tokentrail extension."""

    def __init__(self, job: Job, vocab: Vocab) -> None:
        self.job = job
        self.req = job.request
        self.vocab = vocab
        self.created = int(time.time())
        self.chars = 0  # completion characters final so far
        self.first = True
        self.finish_reason: str | None = None
        self.n_tokens = 0
        self.prompt_tokens = 0

    # -- pieces --

    def _token_text(self, token_id: int) -> str:
        try:
            return self.vocab.token_text(token_id)
        except ValueError:  # an id the model has but the tokenizer lacks (padding rows)
            return ""

    def _completion_token(self, token_id: int, raw: bytes | None = None) -> str:
        """A completions-API token string: its text, or OpenAI's `bytes:\\xNN` form when
        its bytes are not valid UTF-8 on their own (so no information is lost)."""
        if raw is None:
            try:
                raw = self.vocab.token_bytes(token_id)
            except ValueError:
                return ""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text if raw else self._token_text(token_id)

    def _token_bytes(self, token_id: int) -> list[int]:
        try:
            return list(self.vocab.token_bytes(token_id))
        except ValueError:
            return []

    def _alternatives(self, alts: tuple[Alternative, ...]) -> list[Alternative]:
        return list(alts[: self.req.top_logprobs])

    def _span(self, span: TokenSpan) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": span.index,
            "id": span.id,
            "start": span.start,
            "end": span.end,
            "logprob": _lp(span.logprob),
            "text": self._token_text(span.id),
            "bytes": self._token_bytes(span.id),
        }
        if self.req.top_logprobs and span.top_logprobs:
            out["top_logprobs"] = [
                {"id": a.id, "logprob": _lp(a.logprob), "bytes": list(a.bytes), "text": a.text}
                for a in span.top_logprobs[: self.req.top_logprobs]
            ]
        return out

    def segment(self, step: Step) -> dict[str, Any] | None:
        if not step.text and not step.segment_tokens:
            return None
        conf = step.confidence
        out = {
            "text": step.text,
            "tokens": [self._span(s) for s in step.segment_tokens],
            "confidence": None
            if conf is None
            else {k: _finite(v) for k, v in conf.to_dict().items()},
        }
        if step.refused:
            out["refused"] = list(step.refused)
        return out

    def _stop(self, step: Step) -> dict[str, Any] | None:
        if step.stop_string is None:
            return None
        return {"string": step.stop_string, "tokens": [self._span(s) for s in step.stop_tokens]}

    def chat_logprob(self, step: Step) -> dict[str, Any]:
        return {
            "token": self._token_text(step.token),
            "logprob": _lp(step.logprob),
            "bytes": self._token_bytes(step.token),
            "top_logprobs": [
                {"token": a.text, "logprob": _lp(a.logprob), "bytes": list(a.bytes)}
                for a in self._alternatives(step.top)
            ],
        }

    def _completion_top(self, step: Step) -> dict[str, float | None]:
        top: dict[str, float | None] = {}
        for a in self._alternatives(step.top):
            top.setdefault(self._completion_token(a.id, a.bytes), _lp(a.logprob))
        return top

    def _note(self, step: Step) -> int:
        """Account for a step; return the text offset of its token (see module doc)."""
        offset = self.chars
        self.chars += len(step.text)
        self.n_tokens += 1
        self.prompt_tokens = step.prompt_tokens or self.prompt_tokens
        if step.finish_reason is not None:
            self.finish_reason = step.finish_reason
        return offset

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.n_tokens,
            "total_tokens": self.prompt_tokens + self.n_tokens,
        }

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.job.id,
            "object": obj,
            "created": self.created,
            "model": self.req.model,
            "system_fingerprint": None,
        }

    # -- streamed --

    def chunk(self, step: Step) -> dict[str, Any]:
        offset = self._note(step)
        ext: dict[str, Any] = {
            "token": {
                "index": step.index,
                "id": step.token,
                "text": self._token_text(step.token),
                "bytes": self._token_bytes(step.token),
                "logprob": _lp(step.logprob),
            },
            "segments": [s for s in (self.segment(step),) if s is not None],
        }
        stop = self._stop(step)
        if stop is not None:
            ext["stop"] = stop
        if self.req.kind == "chat":
            delta: dict[str, Any] = {"content": step.text}
            if self.first:
                delta = {"role": "assistant", **delta}
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": {"content": [self.chat_logprob(step)]} if self.req.logprobs else None,
                "finish_reason": step.finish_reason,
            }
            out = self._envelope("chat.completion.chunk")
        else:
            choice = {
                "index": 0,
                "text": step.text,
                "logprobs": {
                    "tokens": [self._completion_token(step.token)],
                    "token_logprobs": [_lp(step.logprob)],
                    "top_logprobs": [self._completion_top(step)],
                    "text_offset": [offset],
                }
                if self.req.logprobs
                else None,
                "finish_reason": step.finish_reason,
            }
            out = self._envelope("text_completion")
        self.first = False
        out["choices"] = [choice]
        out["tokentrail"] = ext
        return out

    def usage_chunk(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        out = self._envelope(obj)
        out["choices"] = []
        out["usage"] = self.usage()
        return out

    # -- whole --

    def response(self, steps: list[Step]) -> dict[str, Any]:
        text_parts: list[str] = []
        segments: list[dict[str, Any]] = []
        chat_lps: list[dict[str, Any]] = []
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float | None]] = []
        offsets: list[int] = []
        stop = None
        for step in steps:
            offsets.append(self._note(step))
            text_parts.append(step.text)
            seg = self.segment(step)
            if seg is not None:
                segments.append(seg)
            stop = self._stop(step) or stop
            if self.req.logprobs:
                if self.req.kind == "chat":
                    chat_lps.append(self.chat_logprob(step))
                else:
                    tokens.append(self._completion_token(step.token))
                    token_lps.append(_lp(step.logprob))
                    tops.append(self._completion_top(step))
        text = "".join(text_parts)
        ext: dict[str, Any] = {"segments": segments}
        if stop is not None:
            ext["stop"] = stop
        finish = self.finish_reason or "stop"
        if self.req.kind == "chat":
            out = self._envelope("chat.completion")
            out["choices"] = [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": {"content": chat_lps} if self.req.logprobs else None,
                    "finish_reason": finish,
                }
            ]
        else:
            out = self._envelope("text_completion")
            out["choices"] = [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": {
                        "tokens": tokens,
                        "token_logprobs": token_lps,
                        "top_logprobs": tops,
                        "text_offset": offsets,
                    }
                    if self.req.logprobs
                    else None,
                    "finish_reason": finish,
                }
            ]
        out["usage"] = self.usage()
        out["tokentrail"] = ext
        return out


def _json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _sse(obj: Any) -> bytes:
    return f"data: {_json(obj)}\n\n".encode()


# -- HTTP -----------------------------------------------------------------------------------------


def _json_response(
    obj: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    from starlette.responses import JSONResponse

    return JSONResponse(obj, status_code=status, headers=dict(headers or {}))


def _empty_response(status: int) -> Response:
    from starlette.responses import Response

    return Response(status_code=status)


async def _watch_disconnect(receive: Receive, job: Job) -> None:
    """Cancel `job` as soon as the client hangs up (the request body is already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            job.cancel("client disconnected")
            return


class _SSEResponse:
    """An ASGI server-sent-events response that cancels its job however it ends.

    Done, failed or hung up: the job is cancelled (a no-op once finished) and the
    disconnect watcher stopped, so no generation outlives its response.
    """

    def __init__(self, body: AsyncIterator[bytes], job: Job, watcher: asyncio.Task[None]) -> None:
        self._body = body
        self._job = job
        self._watcher = watcher

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no"),
                    ],
                }
            )
            async for chunk in self._body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while we were writing
            logger.info("client of %s went away mid-stream", self._job.id)
        finally:
            self._watcher.cancel()
            self._job.cancel("response ended")
            await self._body.aclose()  # type: ignore[attr-defined]


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    """Read at most `limit` bytes of body and parse a JSON object, or raise APIError."""
    too_big = APIError(
        413,
        f"request body is larger than {limit} bytes",
        param=None,
        code="request_too_large",
    )
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise too_big
        except ValueError:
            raise APIError(400, "invalid Content-Length header", code="invalid_header") from None
    chunks = bytearray()
    async for chunk in request.stream():
        chunks += chunk
        if len(chunks) > limit:
            raise too_big
    if not chunks:
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        body = json.loads(chunks)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(body, dict):
        raise APIError(
            400,
            f"the request body must be a JSON object, got {_type_name(body)}",
            code="invalid_json",
        )
    return body


class _Server:
    """The routes, bound to one Engine."""

    def __init__(self, engine: Engine, max_body_bytes: int) -> None:
        self.engine = engine
        self.max_body_bytes = max_body_bytes

    def _check_model(self, body: Mapping[str, Any]) -> str:
        model = body.get("model")
        if model is None:
            return self.engine.model_name
        if not isinstance(model, str):
            raise _bad(
                "model", f"'model' must be a string, got {_type_name(model)}", "invalid_type"
            )
        if model != self.engine.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves "
                f"{self.engine.model_name!r}",
                param="model",
                code="model_not_found",
            )
        return model

    def _vocab(self) -> Vocab:
        if not self.engine.ready or self.engine.vocab is None:
            raise APIError(
                503,
                "the model is not loaded",
                type="server_error",
                code="model_not_ready",
                headers={"Retry-After": "5"},
            )
        return self.engine.vocab

    async def models(self, request: Request) -> Response:
        name = self.engine.model_name
        return _json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": self.engine.created,
                        "owned_by": "tokentrail",
                    },
                ],
            }
        )

    async def health(self, request: Request) -> Response:
        stats = self.engine.stats()
        return _json_response(stats, 200 if stats["status"] == "ok" else 503)

    async def index(self, request: Request) -> Response:
        page = STATIC_DIR / "index.html"
        if not page.is_file():
            raise APIError(404, "the page is not installed", code="not_found")
        from starlette.responses import FileResponse

        return FileResponse(page, media_type="text/html")

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "completion")

    async def _complete(self, request: Request, kind: Kind) -> Response:
        body = await _read_json(request, self.max_body_bytes)
        model = self._check_model(body)
        vocab = self._vocab()
        parse = parse_chat if kind == "chat" else parse_completion
        req = parse(body, model, vocab.size)
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        job = Job(id=prefix + uuid.uuid4().hex[:24], request=req, loop=asyncio.get_running_loop())
        self.engine.submit(job)
        watcher = asyncio.create_task(_watch_disconnect(request.receive, job))
        handed_over = False
        try:
            # Wait for the first token before answering, so that a prompt the model
            # rejects still gets a proper HTTP error status.
            kind_, value = await job.next_event()
            if kind_ == "error":
                raise _generation_error(value)
            if kind_ == "cancelled":
                return _empty_response(499)
            fmt = Formatter(job, vocab)
            if req.stream:
                handed_over = True
                return _SSEResponse(self._stream(job, fmt, (kind_, value)), job, watcher)
            return await self._collect(job, fmt, (kind_, value))
        finally:
            if not handed_over:
                watcher.cancel()
                job.cancel("request ended")

    async def _collect(self, job: Job, fmt: Formatter, event: tuple[EventKind, Any]) -> Response:
        steps: list[Step] = []
        kind, value = event
        while True:
            if kind == "step":
                steps.append(value)
                if value.finish_reason is not None:
                    break
            elif kind == "error":
                raise _generation_error(value)
            elif kind == "cancelled":
                return _empty_response(499)
            else:  # done without a finish reason: the engine ran out of steps
                break
            kind, value = await job.next_event()
        return _json_response(fmt.response(steps))

    async def _stream(
        self, job: Job, fmt: Formatter, event: tuple[EventKind, Any]
    ) -> AsyncIterator[bytes]:
        kind, value = event
        while True:
            if kind == "step":
                yield _sse(fmt.chunk(value))
                if value.finish_reason is not None:
                    break
            elif kind == "error":
                logger.error("generation %s failed mid-stream: %s", job.id, value)
                yield _sse(_generation_error(value).body())
                return
            elif kind == "cancelled":
                return
            else:
                break
            kind, value = await job.next_event()
        if fmt.req.include_usage:
            yield _sse(fmt.usage_chunk())
        yield b"data: [DONE]\n\n"


def _generation_error(exc: BaseException) -> APIError:
    """Map an engine exception to a client error (bad prompt/value) or a server error."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError | TypeError):
        return APIError(400, f"the model rejected the request: {exc}", code="invalid_request")
    return APIError(
        500,
        f"generation failed: {type(exc).__name__}: {exc}",
        type="server_error",
        code="internal_error",
    )


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    from starlette.exceptions import HTTPException

    assert isinstance(exc, HTTPException)
    codes = {404: "not_found", 405: "method_not_allowed"}
    return APIError(
        exc.status_code,
        f"{request.method} {request.url.path}: {exc.detail}",
        code=codes.get(exc.status_code),
        headers=exc.headers,
    ).response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return APIError(
        500,
        f"internal server error: {type(exc).__name__}",
        type="server_error",
        code="internal_error",
    ).response()


def create_app(
    model: Any = None,
    tokenizer: Any = None,
    model_path: str | os.PathLike[str] | None = None,
    *,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    model_name: str | None = None,
    engine: str = "mlx",
    load_options: dict[str, Any] | None = None,
) -> Starlette:
    """Build the ASGI app serving one model.

    Pass `model` and `tokenizer` (as `tokentrail.load` returns them), or `model_path`
    (None: the built-in demo model), which is then loaded on the worker thread when the
    app starts (or earlier through ``app.state.engine.start()``). `max_queue` requests
    may wait behind the running one; more are answered 429. Bodies over
    `max_body_bytes` are answered 413. `engine` ("mlx", "torch" or "vllm") and
    `load_options` (that engine's loader keywords) apply when loading `model_path`.
    """
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    engine = Engine(
        model,
        tokenizer,
        model_path,
        max_queue=max_queue,
        model_name=model_name,
        engine=engine,
        load_options=load_options,
    )
    server = _Server(engine, max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await asyncio.to_thread(engine.start)
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    routes = [
        Route("/", server.index, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
    ]
    if STATIC_DIR.is_dir():
        routes.append(Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"))
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            Exception: _internal_error,
        },
    )
    app.state.engine = engine
    return app


# -- command line -------------------------------------------------------------------------------


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="model folder in Hugging Face layout (default: the built-in demo model)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on")
    parser.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        metavar="N",
        help="requests that may wait behind the running one; more get 429 "
        f"(default {DEFAULT_MAX_QUEUE})",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="N",
        help=f"largest accepted request body (default {DEFAULT_MAX_BODY_BYTES})",
    )
    parser.add_argument(
        "--model-name",
        default=None,
        help="id the model is served under (default: the folder name, or tokentrail-demo)",
    )
    parser.add_argument(
        "--engine",
        default="mlx",
        choices=["mlx", "torch", "vllm"],
        help="model runtime (default mlx; torch runs transformers, vllm a vLLM deployment)",
    )
    parser.add_argument("--device", help="torch engine: cuda, mps or cpu (default: best)")
    parser.add_argument("--dtype", help="torch/vllm engines: float32, bfloat16, float16, auto")
    parser.add_argument("--tensor-parallel-size", type=int, metavar="N", help="vllm engine")
    parser.add_argument("--pipeline-parallel-size", type=int, metavar="N", help="vllm engine")
    parser.add_argument("--gpu-memory-utilization", type=float, metavar="F", help="vllm engine")
    parser.add_argument("--max-model-len", type=int, metavar="N", help="vllm engine")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
    )
    from .proxy import add_arguments as add_upstream_arguments

    add_upstream_arguments(parser)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to a `tokentrail` argparse subparsers object."""
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API with segment confidence",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health) with per-segment token attribution, "
        "and a live confidence page at /.",
    )
    _add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted; return the exit status."""
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ModuleNotFoundError as e:
        sys.stderr.write(
            f"tokentrail serve: error: needs {e.name or 'uvicorn'}: "
            "pip install 'tokentrail[server]'\n"
        )
        return 2

    level = args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("tokentrail").setLevel(level)  # also under `tokentrail -v serve`
    if args.max_queue < 0:
        sys.stderr.write(
            f"tokentrail serve: error: --max-queue must be >= 0, got {args.max_queue}\n"
        )
        return 2
    if args.max_body_bytes < 1:
        sys.stderr.write(
            f"tokentrail serve: error: --max-body-bytes must be >= 1, got {args.max_body_bytes}\n"
        )
        return 2
    if getattr(args, "upstream", None):
        from .proxy import run as run_upstream

        return run_upstream(args)
    options: dict[str, Any] = {}
    allowed = {
        "mlx": (),
        "torch": ("device", "dtype"),
        "vllm": (
            "dtype",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "gpu_memory_utilization",
            "max_model_len",
        ),
    }[args.engine]
    for key in (
        "device",
        "dtype",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "gpu_memory_utilization",
        "max_model_len",
    ):
        value = getattr(args, key, None)
        if value is None:
            continue
        if key not in allowed:
            flag = "--" + key.replace("_", "-")
            sys.stderr.write(
                f"tokentrail serve: error: {flag} does not apply to --engine {args.engine}\n"
            )
            return 2
        options[key] = value
    app = create_app(
        model_path=args.model,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        model_name=args.model_name,
        engine=args.engine,
        load_options=options,
    )
    try:
        app.state.engine.start()
    except (OSError, ValueError, ImportError, TypeError) as e:
        sys.stderr.write(
            f"tokentrail serve: error: cannot load the model: {' '.join(str(e).split())}\n"
        )
        return 2
    logger.info("serving %s on http://%s:%d", app.state.engine.model_name, args.host, args.port)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m tokentrail.server ...`: the same options as `tokentrail serve`."""
    parser = argparse.ArgumentParser(prog="python -m tokentrail.server")
    _add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
