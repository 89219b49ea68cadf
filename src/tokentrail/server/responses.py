"""OpenAI's Responses API (``POST /v1/responses``) on the chat pipeline.

The `openai` client's `client.responses.create` (its main API now) and the agents built
on it send these; vLLM and llama-server serve them too. A request is read into the chat
request it means (`chat_body`), runs as any chat request (one output pipeline: the
same `Formatter`, the same segments and confidence), and its answer is reshaped:

- whole: a ``response`` object whose `output` holds a ``reasoning`` item (with a
  reasoning format), a ``message`` item with one ``output_text`` part (with `logprobs`
  where ``include`` asks for ``message.output_text.logprobs``), and a ``function_call``
  item per tool call; `status` "incomplete" with `incomplete_details.reason`
  "max_output_tokens" where the limit ended it; `usage` in the API's names; the
  ``tokentrail`` extension as on chat;
- streamed: the API's typed events (``response.created``, ``response.output_item.added``,
  ``response.content_part.added``, ``response.output_text.delta`` ... ``response.completed``
  or ``response.incomplete``), each ``output_text.delta`` carrying its token's
  ``tokentrail`` extension (its segments, tokens and confidence) as chat chunks do.

Read: `input` (a string, or messages whose content is a string or ``input_text`` /
``output_text`` parts, ``function_call`` items and their ``function_call_output``, as an
agent sends a tool's result back; ``reasoning`` items sent back are left out, as chat
templates leave out earlier reasoning), `instructions` (a system message first),
`max_output_tokens`, `temperature`, `top_p`, `top_logprobs`, `include`, `text.format` (``text``,
``json_schema``, ``json_object``: the grammar library's constraint, as
``response_format``), `tools` (function tools) and `tool_choice`, `stream`, and the
``tokentrail`` options and other engines' fields as on chat. Refused by name (400):
`previous_response_id` and `conversation` (this server stores no responses: send the
whole conversation), `background`, `reasoning` (an effort), `truncation` "auto", other
input items and parts (images, files), tools other than functions.
`store`, `metadata`, `user` and the like are accepted and change nothing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ..errors import APIError
from ..fastjson import dumps
from .answers import gather, generation_error
from .formatting import Formatter
from .jobs import Job
from .wire_errors import bad_request

__all__ = ["ID_PREFIX", "PATH", "ResponseShape", "add_call", "chat_body", "events_of",
           "function_specs", "reshaped", "shape_of", "stream_answer", "text_of",
           "whole_answer"]

PATH = "/v1/responses"
ID_PREFIX = "resp_"

#: The Responses fields this module reads or answers; the rest goes to the chat parse.
_OWN = {"input", "instructions", "max_output_tokens", "top_logprobs", "include", "text",
        "tools", "tool_choice", "previous_response_id", "conversation", "background",
        "reasoning", "truncation", "store", "metadata", "user", "prompt_cache_key",
        "safety_identifier", "service_tier", "stream_options", "max_tool_calls",
        "parallel_tool_calls", "prompt"}  # fmt: skip
_LOGPROBS = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text", "text")


def text_of(value: Any, where: str) -> str:
    """A string, or text parts (``input_text``, ``output_text``, ``text``: Anthropic's
    text blocks too) joined; anything else a 400 naming it."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(where, f"'{where}' must be a string or an array of text parts")
    texts = []
    for k, part in enumerate(value):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{k}]", f"'{where}[{k}]' is of type {kind!r}: "
                       "only text (input_text, output_text, text) is served here",
                       "unsupported_value")  # fmt: skip
        texts.append(part["text"])
    return "".join(texts)


def _messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    out = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("instructions", "'instructions' must be a string")
        out.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        return [*out, {"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise bad_request("input", "'input' must be a string or a non-empty array of messages")
    for k, item in enumerate(given):
        where = f"input[{k}]"
        kind = item.get("type", "message") if isinstance(item, Mapping) else None
        if kind == "reasoning":
            continue  # an earlier reply's reasoning, sent back: templates leave it out
        if kind in ("function_call", "function_call_output"):
            out.append(_tool_turn(item, kind, where, out))
            continue
        if kind != "message" or not isinstance(item.get("role"), str):
            raise bad_request(where, f"'{where}' is of type {kind!r}: only messages, "
                       "function calls and their outputs are served here",
                       "unsupported_value")  # fmt: skip
        role = "system" if item["role"] == "developer" else item["role"]
        out.append({"role": role, "content": text_of(item.get("content"), f"{where}.content")})
    return [m for m in out if m]


def _tool_turn(item: Mapping[str, Any], kind: str, where: str,
               before: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """A ``function_call`` item as the assistant's tool call (joined to the assistant
    message of calls just before it: {} then), a ``function_call_output`` as the tool's
    message."""
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise bad_request(f"{where}.call_id", f"'{where}.call_id' must be a string")
    if kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else text_of(output, f"{where}.output")
        return {"role": "tool", "tool_call_id": call_id, "content": text}
    name, arguments = item.get("name"), item.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise bad_request(where, f"'{where}' needs 'name' and 'arguments' strings")
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = before[-1] if before else None
    if last and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
        last["tool_calls"].append(call)
        return {}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def _format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None: plain text)."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request("text.format", "'text.format.type' must be text, json_schema or json_object")


def function_specs(tools: Any, spec: Any, refusal: str) -> list[dict[str, Any]]:
    """Chat's function tools from another API's `tools`: `spec(tool)` is the chat
    ``function`` of a tool it serves, None for one it does not (a 400 naming it with
    `refusal`)."""
    if not isinstance(tools, list):
        raise bad_request("tools", "'tools' must be an array")
    specs = []
    for k, t in enumerate(tools):
        fn = spec(t) if isinstance(t, Mapping) else None
        if fn is None:
            raise bad_request(f"tools[{k}]", f"'tools[{k}]' {refusal}", "unsupported_value")
        specs.append({"type": "function", "function": fn})
    return specs


def _function(t: Mapping[str, Any]) -> dict[str, Any] | None:
    if t.get("type") != "function":
        return None
    return {key: t[key] for key in ("name", "description", "parameters", "strict") if key in t}


def _tools(body: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if body.get("tools"):
        out["tools"] = function_specs(body["tools"], _function, "is not a function tool: "
                                      "only function tools are served here")  # fmt: skip
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        out["tool_choice"] = choice
    return out


def chat_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completions body a Responses request means (APIError 400 naming the
    field it cannot serve)."""
    for name, why in (("previous_response_id", "this server stores no responses: send the "
                       "whole conversation in 'input'"),
                      ("conversation", "this server stores no conversations: send the whole "
                       "conversation in 'input'"),
                      ("prompt", "stored prompts are not served here")):  # fmt: skip
        if body.get(name) is not None:
            raise bad_request(name, f"'{name}' is not supported: {why}", "unsupported_value")
    if body.get("background"):
        raise bad_request("background", "'background' is not supported: ask with stream instead",
                   "unsupported_value")  # fmt: skip
    reasoning = body.get("reasoning")
    if reasoning is not None and not (
        isinstance(reasoning, Mapping) and all(v is None for v in reasoning.values())
    ):
        raise bad_request("reasoning", "'reasoning' is not supported: the model reasons as its "
                   "template says ('tokentrail': {'reasoning': ...} splits it)",
                   "unsupported_value")  # fmt: skip
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request("truncation", "'truncation' must be 'disabled': a prompt that does not "
                   "fit is refused, never cut", "unsupported_value")  # fmt: skip
    if body.get("n") not in (None, 1):
        raise bad_request("n", "'n' is not part of the Responses API: one output per response")
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        raise bad_request("include", "'include' must be an array of strings")
    chat = {k: v for k, v in body.items() if k not in _OWN}
    chat["messages"] = _messages(body)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    top = body.get("top_logprobs")
    if _LOGPROBS in include or top:
        chat["logprobs"] = True
        if top:
            chat["top_logprobs"] = top
    fmt = _format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    chat.update(_tools(body))
    return chat


def shape_of(job_id: str, body: Mapping[str, Any], req: Any) -> ResponseShape:
    """The shape of the answer to `body` (run as `req`, its `GenRequest`)."""
    return ResponseShape(job_id, body, req.model)


class ResponseShape:
    """What a response echoes of its request, and its ids."""

    def __init__(self, job_id: str, body: Mapping[str, Any], model: str) -> None:
        self.id = job_id
        self.created_at = int(time.time())
        self.model = model
        self.body = body
        self.msg_id = "msg_" + uuid.uuid4().hex[:24]
        self.rs_id = "rs_" + uuid.uuid4().hex[:24]

    def envelope(self, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "temperature": b.get("temperature"), "top_p": b.get("top_p"),
            "top_logprobs": b.get("top_logprobs"),
            "text": b.get("text") or {"format": {"type": "text"}},
            "tools": b.get("tools") or [], "tool_choice": b.get("tool_choice") or "auto",
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": None, "reasoning": None, "store": False,
            "truncation": "disabled", "metadata": b.get("metadata") or {},
            "usage": usage,
        }  # fmt: skip

    @staticmethod
    def usage(chat_usage: Mapping[str, Any]) -> dict[str, Any]:
        details = chat_usage.get("prompt_tokens_details") or {}
        return {
            "input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"],
        }

    @staticmethod
    def rows(choice: Mapping[str, Any]) -> list[Any]:
        """A chat choice's `logprobs.content` rows (none where the request asked none:
        `chat_body` asks chat's logprobs exactly where ``include`` or ``top_logprobs``
        does)."""
        return (choice.get("logprobs") or {}).get("content") or []

    def message(self, text: str, logprobs: list[Any], status: str) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [part]}  # fmt: skip

    def reasoning(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": self.rs_id, "status": status, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip

    def whole(self, chat: Mapping[str, Any], choice: Mapping[str, Any],
              msg: Mapping[str, Any]) -> dict[str, Any]:  # fmt: skip
        """The ``response`` object of a whole chat answer."""
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        output = []
        if msg.get("reasoning"):
            output.append(self.reasoning(msg["reasoning"], "completed"))
        calls = msg.get("tool_calls") or []
        if msg.get("content") or not calls:
            output.append(self.message(msg.get("content") or "", self.rows(choice), status))
        output += [self.call(c) for c in calls]
        out = self.envelope(status, output, self.usage(chat["usage"]))
        out["tokentrail"] = chat["tokentrail"]
        return out

    @staticmethod
    def call(call: Mapping[str, Any]) -> dict[str, Any]:
        fn = call.get("function") or {}
        own = "fc_" + str(call.get("id") or uuid.uuid4().hex[:24]).removeprefix("call_")
        return {"type": "function_call", "id": own, "call_id": call.get("id"),
                "name": fn.get("name"), "arguments": fn.get("arguments") or "",
                "status": "completed"}  # fmt: skip


async def reshaped(job: Job, fmt: Formatter, event: Any, build: Any) -> dict[str, Any] | None:
    """A one-choice job's whole chat answer in another API's shape: `build(response,
    choice, message)`; None where the client went away."""
    answers = await gather(job, [fmt], event)
    if answers is None:
        return None
    choice = answers[0]["choices"][0]
    return build(answers[0], choice, choice["message"])  # type: ignore[no-any-return]


async def whole_answer(job: Job, fmt: Formatter, event: Any,
                       shape: ResponseShape) -> dict[str, Any] | None:  # fmt: skip
    """The whole ``response`` object (None: the client went away)."""
    return await reshaped(job, fmt, event, shape.whole)


class _Stream:
    """The state of one streamed response: numbered events in the API's shape, the
    items opened so far (the reasoning, the message) and the tool calls gathered."""

    def __init__(self, shape: ResponseShape, fmt: Formatter) -> None:
        self.shape, self.fmt = shape, fmt
        self.n = 0
        self.opened: dict[str, int] = {}  # item kind -> output index
        self.texts: dict[str, list[str]] = {"message": [], "reasoning": []}
        self.rows: list[Any] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish: str | None = None

    def ev(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self.n, **fields}
        self.n += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(obj) + b"\n\n"

    def error(self, err: APIError) -> bytes:
        failed = self.shape.envelope("failed", [])
        failed["error"] = {"code": err.code or "server_error", "message": err.message}
        return self.ev("error", code=err.code, message=err.message, param=err.param) + (
            self.ev("response.failed", response=failed))  # fmt: skip

    def start(self) -> bytes:
        started = self.shape.envelope("in_progress", [])
        return self.ev("response.created", response=started) + self.ev(
            "response.in_progress", response=started
        )

    def _open(self, kind: str) -> bytes:
        index = self.opened[kind] = len(self.opened)
        shape = self.shape
        item = shape.message("", [], "in_progress") if kind == "message" else (
            shape.reasoning("", "in_progress"))  # fmt: skip
        item["content"] = []
        part = ({"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                if kind == "message" else {"type": "reasoning_text", "text": ""})  # fmt: skip
        return self.ev("response.output_item.added", output_index=index, item=item) + self.ev(
            "response.content_part.added", item_id=item["id"], output_index=index,
            content_index=0, part=part)  # fmt: skip

    def step(self, value: Any) -> bytes:
        """The events of one step: its chat chunk's reasoning, text and tool-call
        pieces; its ``tokentrail`` extension goes with the first event it makes."""
        chunk = self.fmt.chunk(value)
        choice = chunk["choices"][0]
        delta = choice["delta"]
        self.finish = choice["finish_reason"] or self.finish
        parts: list[bytes] = []
        ext = chunk["tokentrail"]
        reasoning = delta.get("reasoning") or ""
        for piece in delta.get("tool_calls") or []:
            add_call(self.calls, piece)
        text = delta.get("content") or ""
        if reasoning or ("reasoning" in self.opened and not text and not self.calls):
            if "reasoning" not in self.opened:
                parts.append(self._open("reasoning"))
            self.texts["reasoning"].append(reasoning)
            parts.append(self.ev("response.reasoning_text.delta", item_id=self.shape.rs_id,
                                 output_index=self.opened["reasoning"], content_index=0,
                                 delta=reasoning, tokentrail=ext))  # fmt: skip
            ext = None
        if text or (ext is not None and not self.calls):
            if "message" not in self.opened:
                parts.append(self._open("message"))
            mine = self.shape.rows(choice)
            self.rows += mine
            self.texts["message"].append(text)
            fields = {} if ext is None else {"tokentrail": ext}
            parts.append(self.ev("response.output_text.delta", item_id=self.shape.msg_id,
                                 output_index=self.opened["message"], content_index=0,
                                 delta=text, logprobs=mine, **fields))  # fmt: skip
        return b"".join(parts)

    def end(self) -> bytes:
        """The items' closing events, the tool calls' items, and the last event with the
        whole response."""
        status = "incomplete" if self.finish == "length" else "completed"
        output: list[dict[str, Any]] = [{}] * len(self.opened)
        parts = []
        for kind, index in self.opened.items():
            text = "".join(self.texts[kind])
            if kind == "reasoning":
                item = self.shape.reasoning(text, "completed")
                parts.append(self.ev("response.reasoning_text.done", item_id=item["id"],
                                     output_index=index, content_index=0, text=text))  # fmt: skip
            else:
                item = self.shape.message(text, self.rows, status)
                parts.append(self.ev("response.output_text.done", item_id=item["id"],
                                     output_index=index, content_index=0, text=text,
                                     logprobs=self.rows))  # fmt: skip
            parts.append(self.ev("response.content_part.done", item_id=item["id"],
                                 output_index=index, content_index=0,
                                 part=item["content"][0]))  # fmt: skip
            parts.append(self.ev("response.output_item.done", output_index=index, item=item))
            output[index] = item
        for call in self.calls.values():
            parts.append(self._call(self.shape.call(call), len(output)))
            output.append(self.shape.call(call))
        final = self.shape.envelope(status, output, self.shape.usage(self.fmt.usage()))
        parts.append(self.ev(f"response.{status}", response=final))
        return b"".join(parts)

    def _call(self, item: dict[str, Any], index: int) -> bytes:
        return b"".join([
            self.ev("response.output_item.added", output_index=index,
                    item={**item, "arguments": "", "status": "in_progress"}),
            self.ev("response.function_call_arguments.delta", item_id=item["id"],
                    output_index=index, delta=item["arguments"]),
            self.ev("response.function_call_arguments.done", item_id=item["id"],
                    output_index=index, arguments=item["arguments"]),
            self.ev("response.output_item.done", output_index=index, item=item),
        ])  # fmt: skip


async def events_of(job: Job, event: Any, stream: Any) -> AsyncIterator[bytes]:
    """A streamed answer in another API's events: `stream` turns the job's events into
    bytes (``start()``, ``step(value)``, ``error(APIError)``, ``end()``), from `event`,
    the job's first, until its last; nothing more once it is cancelled."""
    head = stream.start()
    if head:
        yield head
    while True:
        kind, _, value = event
        if kind == "step":
            out = stream.step(value)
            if out:
                yield out
        elif kind == "error":
            yield stream.error(generation_error(value))
            return
        elif kind == "done":
            break
        else:  # cancelled
            return
        event = await job.next_event()
    yield stream.end()


def stream_answer(job: Job, fmt: Formatter, event: Any,
                  shape: ResponseShape) -> AsyncIterator[bytes]:  # fmt: skip
    """The streamed answer: the API's events, each text delta with its token's
    ``tokentrail`` extension."""
    return events_of(job, event, _Stream(shape, fmt))


def add_call(calls: dict[int, dict[str, Any]], piece: Mapping[str, Any]) -> None:
    """Fold one chat `delta.tool_calls` piece into the call it continues."""
    call = calls.setdefault(piece.get("index", 0), {"id": None, "function": {"arguments": ""}})
    if piece.get("id"):
        call["id"] = piece["id"]
    fn = piece.get("function") or {}
    if fn.get("name"):
        call["function"]["name"] = fn["name"]
    call["function"]["arguments"] += fn.get("arguments") or ""
