"""Anthropic's Messages API (``POST /v1/messages``) on the chat pipeline.

Clients written for Anthropic's API (its `anthropic` SDK, and the tools built on it)
can point at llama-server and vLLM, which serve this endpoint; here too. A request is
read into the chat request it means (`chat_body`), runs as any chat request (the same
output pipeline, segments and confidence), and its answer is reshaped:

- whole: a ``message`` whose `content` holds a ``thinking`` block (with a reasoning
  format), a ``text`` block, and a ``tool_use`` block per tool call; `stop_reason`
  "end_turn", "max_tokens", "stop_sequence" (with `stop_sequence`, the string that
  matched) or "tool_use"; `usage` in the API's names; the ``tokentrail`` extension as on
  chat;
- streamed: the API's events (``message_start``, ``content_block_start``,
  ``content_block_delta`` ... ``message_delta``, ``message_stop``), each text or thinking
  delta carrying its token's ``tokentrail`` extension.

Read: `messages` (text blocks, an assistant's ``tool_use`` blocks and the user's
``tool_result`` blocks; ``thinking`` blocks sent back are left out, as chat templates
leave out earlier reasoning), `system`, `max_tokens`, `temperature`, `top_p`, `top_k`,
`stop_sequences`, `stream`, `tools` (client tools: `name`, `description`,
`input_schema`) and `tool_choice` (auto, any, tool, none), and the ``tokentrail`` options
and other engines' fields as on chat. Refused by name (400): image and document blocks,
server tools, `thinking` enabled (a budget this server cannot keep), `mcp_servers`.
Errors on this route come in Anthropic's shape (``{"type": "error", "error": {type,
message}}``), and the API key may come as Anthropic's ``x-api-key`` header.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ..errors import APIError
from ..fastjson import dumps
from .formatting import Formatter
from .jobs import Job
from .responses import add_call, events_of, function_specs, reshaped, text_of
from .wire_errors import bad_request

__all__ = ["ID_PREFIX", "PATH", "MessageShape", "anthropic_error", "chat_body", "shape_of",
           "stream_answer", "whole_answer"]  # fmt: skip

PATH = "/v1/messages"
ID_PREFIX = "msg_"
#: The fields this module reads or answers; the rest goes to the chat parse.
_OWN = {"messages", "system", "max_tokens", "stop_sequences", "tools", "tool_choice",
        "thinking", "metadata", "service_tier", "mcp_servers", "container",
        "context_management"}  # fmt: skip
_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
#: Anthropic's error type for each status.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}  # fmt: skip


def anthropic_error(exc: APIError) -> Any:
    """`exc` answered in Anthropic's shape (its status and headers kept; `param` added
    where it names the field)."""
    from starlette.responses import JSONResponse

    kind = _ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else
                            "invalid_request_error")  # fmt: skip
    error: dict[str, Any] = {"type": kind, "message": exc.message}
    if exc.param is not None:
        error["param"] = exc.param
    return JSONResponse({"type": "error", "error": error}, status_code=exc.status,
                        headers=exc.headers)  # fmt: skip


def _turn(message: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results first (each a tool
    message), then the text with the assistant's tool calls."""
    if not isinstance(message, Mapping) or message.get("role") not in ("user", "assistant"):
        raise bad_request(where, f"'{where}' must be a message with role user or assistant")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content", f"'{where}.content' must be a string or an array")
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for k, block in enumerate(content):
        at = f"{where}.content[{k}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind in ("thinking", "redacted_thinking"):
            continue  # earlier reasoning sent back: templates leave it out
        elif kind == "tool_use" and role == "assistant":
            args = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append({"id": str(block.get("id")), "type": "function",
                          "function": {"name": block.get("name"), "arguments": args}})  # fmt: skip
        elif kind == "tool_result" and role == "user":
            result = block.get("content")
            text = "" if result is None else text_of(result, f"{at}.content")
            out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id")),
                        "content": text})  # fmt: skip
        else:
            raise bad_request(at, f"'{at}' is of type {kind!r}: only text, tool_use "
                       "(assistant) and tool_result (user) blocks are served here",
                       "unsupported_value")  # fmt: skip
    if texts or calls or not out:
        turn: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def _client_tool(t: Mapping[str, Any]) -> dict[str, Any] | None:
    if t.get("type", "custom") != "custom" or "input_schema" not in t:
        return None
    fn = {"name": t.get("name"), "parameters": t["input_schema"]}
    if t.get("description"):
        fn["description"] = t["description"]
    return fn


def _tools(body: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if body.get("tools"):
        out["tools"] = function_specs(body["tools"], _client_tool, "is not a client tool "
                                      "(name, input_schema): server tools are not served "
                                      "here")  # fmt: skip
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, Mapping) else None
        named = {"type": "function", "function": {"name": choice.get("name")}} if (
            kind == "tool") else None  # fmt: skip
        mapped = {"auto": "auto", "any": "required", "none": "none", "tool": named}
        if kind not in mapped:
            raise bad_request("tool_choice", "'tool_choice' must have type auto, any, tool or none")
        out["tool_choice"] = mapped[kind]
    return out


def chat_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completions body an Anthropic Messages request means (APIError 400
    naming the field it cannot serve)."""
    thinking = body.get("thinking")
    if isinstance(thinking, Mapping) and thinking.get("type") not in (None, "disabled"):
        raise bad_request("thinking", "'thinking' is not supported: the model reasons as its "
                   "template says ('tokentrail': {'reasoning': ...} splits it), with no "
                   "budget", "unsupported_value")  # fmt: skip
    if body.get("mcp_servers"):
        raise bad_request("mcp_servers", "'mcp_servers' is not supported", "unsupported_value")
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise bad_request("messages", "'messages' must be a non-empty array")
    chat = {k: v for k, v in body.items() if k not in _OWN}
    messages = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": text_of(body["system"], "system")})
    for k, message in enumerate(given):
        messages += _turn(message, f"messages[{k}]")
    chat["messages"] = messages
    if body.get("max_tokens") is not None:
        chat["max_tokens"] = body["max_tokens"]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    chat.update(_tools(body))
    return chat


def shape_of(job_id: str, body: Mapping[str, Any], req: Any) -> MessageShape:
    """The shape of the answer to `body` (run as `req`, its `GenRequest`)."""
    return MessageShape(job_id, req.model)


class MessageShape:
    """A message's id, model and the blocks it is made of."""

    def __init__(self, job_id: str, model: str) -> None:
        self.id = job_id
        self.model = model

    def envelope(self, content: list[dict[str, Any]], stop_reason: str | None,
                 stop_sequence: str | None, usage: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": usage}  # fmt: skip

    @staticmethod
    def usage(chat_usage: Mapping[str, Any], output: int | None = None) -> dict[str, Any]:
        details = chat_usage.get("prompt_tokens_details") or {}
        return {"input_tokens": chat_usage["prompt_tokens"],
                "output_tokens": chat_usage["completion_tokens"] if output is None else output,
                "cache_read_input_tokens": details.get("cached_tokens", 0),
                "cache_creation_input_tokens": 0}  # fmt: skip

    @staticmethod
    def stop(finish: str | None, ext: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
        """(stop_reason, stop_sequence) for a chat finish reason and the extension's
        ``stop`` (the stop string that matched, if one did)."""
        string = ((ext or {}).get("stop") or {}).get("string")
        if finish == "stop" and string is not None:
            return "stop_sequence", string
        return _STOP.get(finish or "", finish), None

    def whole(self, chat: Mapping[str, Any], choice: Mapping[str, Any],
              msg: Mapping[str, Any]) -> dict[str, Any]:  # fmt: skip
        """The ``message`` of a whole chat answer."""
        content: list[dict[str, Any]] = []
        if msg.get("reasoning"):
            content.append({"type": "thinking", "thinking": msg["reasoning"], "signature": ""})
        calls = msg.get("tool_calls") or []
        if msg.get("content") or not calls:
            content.append({"type": "text", "text": msg.get("content") or ""})
        content += [self.tool_use(c) for c in calls]
        reason, sequence = self.stop(choice["finish_reason"], chat["tokentrail"])
        out = self.envelope(content, reason, sequence, self.usage(chat["usage"]))
        out["tokentrail"] = chat["tokentrail"]
        return out

    @staticmethod
    def tool_use(call: Mapping[str, Any]) -> dict[str, Any]:
        fn = call.get("function") or {}
        try:
            given = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            given = {}
        own = str(call.get("id") or "").removeprefix("call_") or uuid.uuid4().hex[:24]
        return {"type": "tool_use", "id": "toolu_" + own, "name": fn.get("name"),
                "input": given}  # fmt: skip


async def whole_answer(job: Job, fmt: Formatter, event: Any,
                       shape: MessageShape) -> dict[str, Any] | None:  # fmt: skip
    """The whole ``message`` (None: the client went away)."""
    return await reshaped(job, fmt, event, shape.whole)


class _Stream:
    """The state of one streamed message: its events, the block open now and the tool
    calls gathered."""

    def __init__(self, shape: MessageShape, fmt: Formatter) -> None:
        self.shape, self.fmt = shape, fmt
        self.index = -1
        self.open: str | None = None  # "thinking" or "text"
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish: str | None = None
        self.stop_ext: Mapping[str, Any] | None = None
        self.started = False

    @staticmethod
    def ev(kind: str, **fields: Any) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + dumps({"type": kind, **fields}) + (
            b"\n\n")  # fmt: skip

    def start(self) -> bytes:
        return b""  # message_start goes with the first step, which knows the prompt's size

    def error(self, err: APIError) -> bytes:
        kind = _ERROR_TYPES.get(err.status, "api_error")
        return self.ev("error", error={"type": kind, "message": err.message,
                                       "param": err.param})  # fmt: skip

    def _block(self, kind: str) -> bytes:
        out = self._close()
        self.index += 1
        self.open = kind
        block = {"type": "text", "text": ""} if kind == "text" else {
            "type": "thinking", "thinking": "", "signature": ""}  # fmt: skip
        return out + self.ev("content_block_start", index=self.index, content_block=block)

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return self.ev("content_block_stop", index=self.index)

    def step(self, value: Any) -> bytes:
        chunk = self.fmt.chunk(value)
        parts: list[bytes] = []
        if not self.started:
            self.started = True
            usage = self.shape.usage(self.fmt.usage(), output=0)
            parts.append(self.ev("message_start", message=self.shape.envelope(
                [], None, None, usage)))  # fmt: skip
        choice = chunk["choices"][0]
        delta, ext = choice["delta"], chunk["tokentrail"]
        self.finish = choice["finish_reason"] or self.finish
        if ext.get("stop") is not None:
            self.stop_ext = ext
        for piece in delta.get("tool_calls") or []:
            add_call(self.calls, piece)
        reasoning, text = delta.get("reasoning") or "", delta.get("content") or ""
        if reasoning or (self.open == "thinking" and not text and not self.calls):
            if self.open != "thinking":
                parts.append(self._block("thinking"))
            parts.append(self.ev("content_block_delta", index=self.index,
                                 delta={"type": "thinking_delta", "thinking": reasoning},
                                 tokentrail=ext))  # fmt: skip
            ext = None
        if text or (ext is not None and not self.calls):
            if self.open != "text":
                parts.append(self._block("text"))
            fields = {} if ext is None else {"tokentrail": ext}
            parts.append(self.ev("content_block_delta", index=self.index,
                                 delta={"type": "text_delta", "text": text}, **fields))  # fmt: skip
        return b"".join(parts)

    def end(self) -> bytes:
        parts = [self._close()]
        for call in self.calls.values():
            block = self.shape.tool_use(call)
            self.index += 1
            parts += [
                self.ev("content_block_start", index=self.index,
                        content_block={**block, "input": {}}),
                self.ev("content_block_delta", index=self.index, delta={
                    "type": "input_json_delta",
                    "partial_json": json.dumps(block["input"], ensure_ascii=False)}),
                self.ev("content_block_stop", index=self.index),
            ]  # fmt: skip
        reason, sequence = self.shape.stop(self.finish, self.stop_ext)
        parts.append(self.ev("message_delta", delta={"stop_reason": reason,
                                                     "stop_sequence": sequence},
                             usage={"output_tokens": self.fmt.n_tokens}))  # fmt: skip
        parts.append(self.ev("message_stop"))
        return b"".join(parts)


def stream_answer(job: Job, fmt: Formatter, event: Any,
                  shape: MessageShape) -> AsyncIterator[bytes]:  # fmt: skip
    """The streamed answer: the API's events, each delta with its token's
    ``tokentrail`` extension."""
    return events_of(job, event, _Stream(shape, fmt))
