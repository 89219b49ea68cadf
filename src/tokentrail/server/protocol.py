"""Requests: validation of chat and completion bodies, with OpenAI-shaped errors.

Every check names the offending field in `error.param` and says what was expected, so a
client sees a 400 it can act on instead of a 500 or a silent default. The body reader
also turns the JSON parser's own failures (integers of thousands of digits, lone
surrogates, deep nesting) into such errors.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..errors import APIError, ClientGone, QueueFull  # noqa: F401  (QueueFull: old home)

if TYPE_CHECKING:
    from starlette.requests import Request

DEFAULT_MAX_QUEUE = 16
DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_TOKENS = 256
#: Most alternatives per token (OpenAI's limit for chat `top_logprobs`).
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
#: Most choices one request may ask for (`n`); each is one sequence of the batch.
MAX_N = 16
#: Longest integer literal accepted in a body (Python refuses > 4300 digits anyway).
MAX_INT_DIGITS = 64
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

Kind = Literal["chat", "completion"]


# -- errors -----------------------------------------------------------------------------


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
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    max_tokens: int = DEFAULT_MAX_TOKENS
    #: Whether the client set `max_tokens`: a default is cut to the room the context has
    #: left, an explicit value beyond it is an error (as in vLLM and OpenAI).
    max_tokens_given: bool = False
    temperature: float = 0.0
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


def _parse_common(
    body: Mapping[str, Any], kind: Kind, model: str, vocab_size: int, temperature: float
) -> GenRequest:
    """Check the fields chat and completions share; raise APIError naming the field."""
    req = GenRequest(kind=kind, prompt="", model=model, temperature=temperature)
    n = _opt_int(body, "n", 1, MAX_N)
    req.n = n or 1
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
        req.max_tokens_given = True
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


def _check_unicode(text: str, param: str, where: str) -> None:
    """Refuse text the tokenizer cannot encode: a lone UTF-16 surrogate (JSON allows
    ``"\\ud800"``, UTF-8 does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(
            param,
            f"'{where}' holds a lone surrogate {text[e.start]!r} at character {e.start}, "
            "which is not valid Unicode text",
            "invalid_unicode",
        ) from None


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
        _check_unicode(s, "stop", f"stop[{i}]")
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


def parse_chat(
    body: Mapping[str, Any], model: str, vocab_size: int, temperature: float = 0.0
) -> GenRequest:
    """Validate a /v1/chat/completions body (`temperature`: the default when it has none)."""
    req = _parse_common(body, "chat", model, vocab_size, temperature)
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
        text = _message_text(content, i)
        _check_unicode(text, "messages", f"messages[{i}].content")
        out.append({"role": "system" if role == "developer" else role, "content": text})
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


def parse_completion(
    body: Mapping[str, Any], model: str, vocab_size: int, temperature: float = 0.0
) -> GenRequest:
    """Validate a /v1/completions body (`temperature`: the default when it has none)."""
    req = _parse_common(body, "completion", model, vocab_size, temperature)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt", "'prompt' must not be empty")
        _check_unicode(prompt, "prompt", "prompt")
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


async def read_json(request: Request, limit: int) -> dict[str, Any]:
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
    from starlette.requests import ClientDisconnect

    chunks = bytearray()
    try:
        async for chunk in request.stream():
            chunks += chunk
            if len(chunks) > limit:
                raise too_big
    except ClientDisconnect:
        raise ClientGone(f"the client hung up after {len(chunks)} bytes of body") from None
    if not chunks:
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        body = json.loads(chunks, parse_int=_parse_int)
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
    try:
        where = _find_huge_int(body, "")
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    if where is not None:
        path, digits = where
        raise APIError(
            400,
            f"'{path}' is an integer of {digits} digits; integers may have at most "
            f"{MAX_INT_DIGITS} digits",
            param=path.split(".")[0].split("[")[0],
            code="invalid_value",
        )
    return body


@dataclass(frozen=True)
class _HugeInt:
    """Stands in for an integer literal too long to be any valid field's value."""

    digits: int


def _parse_int(text: str) -> int | _HugeInt:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:  # never call int() on it: 4300+ digits raise ValueError
        return _HugeInt(digits)
    return int(text)


def _find_huge_int(value: Any, path: str) -> tuple[str, int] | None:
    """The path (e.g. ``logit_bias.5``) and length of the first oversized integer."""
    if isinstance(value, _HugeInt):
        return path or "(body)", value.digits
    if isinstance(value, dict):
        for key, item in value.items():
            found = _find_huge_int(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _find_huge_int(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None

