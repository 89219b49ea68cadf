"""OpenAI-compatible HTTP server whose every chunk says which tokens made its text.

``tokentrail serve`` (or ``create_app()`` for an ASGI app) serves one model with:

- ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` in the
  OpenAI shape, streamed (server-sent events ending with ``data: [DONE]``) or not;
- ``POST /v1/responses``: OpenAI's Responses API on the chat pipeline
  (`server.responses`), its typed events when streamed; ``POST /v1/messages``:
  Anthropic's Messages API the same way (`server.messages`);
- ``GET /v1/models/{id}``: the one model's card;
- ``GET /health``: queue, batch and generation counters (also the proof that a client
  who hangs up stops its generation); ``GET /metrics``: Prometheus metrics;
- ``GET /``: a page that streams an answer and shades each segment by confidence.

Streaming emits one chunk per generated token, in order, including tokens whose text
is not final yet (their chunk has empty content) and the end-of-sequence token. Each
chunk's content is exactly the text that became final with that token, so the
concatenated content equals the non-streamed content for the same seed. Standard
``logprobs`` carry each token's text, logprob and *raw* ``bytes`` (never U+FFFD
stand-ins) with ``top_logprobs`` alternatives, listed once the token's text is final and
agreeing with the content: a stop string's own tokens are not listed, a skipped special
token is listed with empty text and bytes (see `tokentrail.server.formatting`).

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

Completions ``logprobs.text_offset`` gives, for each listed token, where its text
starts in the completion text.

Concurrency: one thread owns the model and decodes up to ``max_batch`` sequences
together (a continuous batch: requests join and leave between steps); more requests
wait in a FIFO queue (``max_queue`` sequences at most, more are answered 429 with
``Retry-After``). A client that disconnects cancels its own request, queued or running;
a streaming client that leaves output unread for ``client_timeout`` seconds is dropped.

The package, in the order data flows: `protocol` (request validation and errors),
`scheduler` (queue, batch, prompt cache), `formatting` (chunks and responses),
`metrics`, `app` (routes and middleware), `cli` (``tokentrail serve``).
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..errors import APIError, QueueFull
    from .app import STATIC_DIR, create_app
    from .cli import main, register, run
    from .config import ServerConfig
    from .formatting import Formatter
    from .guard import Guard
    from .jobs import Job
    from .protocol import GenRequest, parse_chat, parse_completion
    from .scheduler import Scheduler

#: Public name -> the module that defines it. Loaded on first use (PEP 562), so that
#: `tokentrail serve`'s parser and `tokentrail.server.cli` load without the server
#: extra (starlette, pydantic, prometheus_client).
_EXPORTS = {
    "STATIC_DIR": ".app",
    "Guard": ".guard",
    "create_app": ".app",
    "main": ".cli",
    "register": ".cli",
    "run": ".cli",
    "ServerConfig": ".config",
    "Formatter": ".formatting",
    "GenRequest": ".protocol",
    "parse_chat": ".protocol",
    "parse_completion": ".protocol",
    "Job": ".jobs",
    "Scheduler": ".scheduler",
    "APIError": "..errors",
    "QueueFull": "..errors",
}

#: Old names, importable with a DeprecationWarning.
_DEPRECATED = {
    "Engine": (".scheduler", "Scheduler"),  # the class's name when it ran one request at a time
}

__all__ = [
    "STATIC_DIR",
    "APIError",
    "Formatter",
    "GenRequest",
    "Guard",
    "Job",
    "QueueFull",
    "Scheduler",
    "ServerConfig",
    "create_app",
    "main",
    "parse_chat",
    "parse_completion",
    "register",
    "run",
]


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        module, new = _DEPRECATED[name]
        warnings.warn(
            f"tokentrail.server.{name} is deprecated; use tokentrail.server.{new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module, __name__), new)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
