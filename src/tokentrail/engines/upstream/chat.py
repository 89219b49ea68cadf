"""The body an upstream's own chat endpoint is asked with (``serve --upstream-chat``).

In this mode the proxy forwards a chat request to the upstream's
``/v1/chat/completions`` (its chat template, its reasoning parser, its tool-call parser,
its constrained decoding), asking for logprobs (and what its dialect adds: its
``chat_fields``, `tokentrail.engines.upstream.dialects`);
`tokentrail.realign.chat.ChannelTracker` reads the answer back into tokens labelled
with their channel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .dialects import UpstreamDialect, dialect_named

__all__ = ["chat_body"]

#: Client fields not forwarded: this proxy's own, and those it sets itself.
_OWN = ("tokentrail", "stream", "stream_options", "logprobs", "top_logprobs", "model")


def chat_body(
    payload: Mapping[str, Any], dialect: str | UpstreamDialect, model: str | None
) -> dict[str, Any]:
    """The body sent to the upstream's /v1/chat/completions for the client's `payload`:
    every field of the client's as given (messages, tools, tool_choice,
    response_format, reasoning settings, sampling), streamed, with logprobs (at least
    one alternative) and what the `dialect` (its name or object) adds (vLLM:
    ``return_token_ids``). A request the dialect sends whole (llama-server refuses
    logprobs on a streamed request with tools) goes with ``stream`` false and its answer
    is read as one chunk."""
    spec = dialect_named(dialect)
    body = {k: v for k, v in payload.items() if k not in _OWN}
    top = payload.get("top_logprobs")
    body["logprobs"] = True
    body["top_logprobs"] = (
        top if isinstance(top, int) and not isinstance(top, bool) and top > 0 else 1
    )
    if model is not None:
        body["model"] = model
    whole = spec.whole_chat(payload)
    body["stream"] = not whole
    if not whole:
        body["stream_options"] = {"include_usage": True}
    body.update(spec.chat_fields())
    return body
