"""vLLM's request fields beyond OpenAI's, as a vLLM user sends them to this server.

vLLM's OpenAI server takes "extra parameters" in the same body (the ``extra_body`` of
the `openai` client). A client moving from vLLM sends them unchanged; ignoring one
would change the answer without a word (``ignore_eos`` ignored ends a benchmark's
requests early, ``stop_token_ids`` ignored runs past the stop). So each is honoured,
or refused with a 400 naming it unless it holds vLLM's default (clients that send
every field at its default are served as if they had sent none).

Honoured, with vLLM's meaning:

- ``ignore_eos``: the end-of-sequence tokens do not end the reply (they are sampled
  and reported like any token; an upstream is asked the same: vLLM samples them,
  llama-server never picks them);
- ``stop_token_ids``: the reply ends at any of these ids as at an end token: the id
  is listed, its text left out (vLLM leaves out a stop-terminated reply's last token's
  text), ``finish_reason`` "stop";
- ``skip_special_tokens``: false puts special tokens' text in the reply;
- ``return_token_ids``: each choice lists its ``token_ids`` (each chunk its own), and
  the prompt's ids come as ``prompt_token_ids`` (chat: at the top, in the first chunk;
  completions: in the choice);
- chat: ``chat_template_kwargs`` (variables for the chat template, e.g. Qwen3's
  ``enable_thinking``), ``add_generation_prompt`` and ``continue_final_message``
  (continue the last, assistant, message instead of starting a new one);
- completions: ``add_special_tokens`` (false: no BOS before a text prompt).

Refused unless at vLLM's default: ``min_tokens``, ``include_stop_str_in_output``,
``use_beam_search``, ``length_penalty``, ``spaces_between_special_tokens``,
``truncate_prompt_tokens``, ``allowed_token_ids``, ``bad_words``, ``prompt_logprobs``
(``echo`` with ``logprobs`` on /v1/completions gives the prompt's logprobs),
``logprob_token_ids``, ``return_tokens_as_token_ids``, ``prompt_embeds``, ``priority``,
``thinking_token_budget``, ``vllm_xargs``, and for chat ``chat_template``, ``documents``
and ``echo``. Fields about the request's bookkeeping (``request_id``, ``user``,
``cache_salt``...) do not change the answer and are ignored, as unknown fields are.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, Field, field_validator

from ..errors import APIError
from .wire_errors import custom_error

__all__ = ["MAX_STOP_TOKEN_IDS", "ChatFields", "CommonFields", "CompletionFields", "vllm_extras"]

#: Most ids one request may list in ``stop_token_ids``.
MAX_STOP_TOKEN_IDS = 64

#: Template variables the server sets itself: `chat_template_kwargs` may not replace them.
_RESERVED_TEMPLATE_KEYS = {
    "messages": "'messages'",
    "tools": "'tools'",
    "add_generation_prompt": "the request's 'add_generation_prompt'",
    "continue_final_message": "the request's 'continue_final_message'",
    "tokenize": None,
    "return_dict": None,
    "chat_template": None,
}

#: vLLM fields served only at vLLM's default: the values that count as the default
#: (null always does), and what to do instead.
_COMMON_DEFAULTS: dict[str, tuple[tuple[Any, ...], str]] = {
    "min_tokens": ((0,), "is not supported: a reply may end before that many tokens"),
    "include_stop_str_in_output": (
        (False,), "is not supported: the stop string is in the extension's 'stop'"),
    "use_beam_search": ((False,), "is not supported: this server samples"),
    "length_penalty": ((1, 1.0), "is not supported (it applies to beam search)"),
    "spaces_between_special_tokens": ((True,), "is not supported"),
    "truncate_prompt_tokens": ((), "is not supported: the prompt is never cut"),
    "allowed_token_ids": ((), "is not supported: use 'logit_bias' or a grammar"),
    "bad_words": (((),), "is not supported: use 'logit_bias'"),
    "prompt_logprobs": (
        (), "is not supported: 'echo' with 'logprobs' on /v1/completions gives the "
        "prompt's logprobs"),
    "logprob_token_ids": ((), "is not supported: 'top_logprobs' lists the alternatives"),
    "return_tokens_as_token_ids": (
        (False,), "is not supported: the extension's tokens carry each id"),
    "prompt_embeds": ((), "is not supported"),
    "priority": ((0,), "is not supported: requests are served first come, first served"),
    "thinking_token_budget": ((), "is not supported"),
    "vllm_xargs": ((), "is not supported"),
}  # fmt: skip
_CHAT_DEFAULTS: dict[str, tuple[tuple[Any, ...], str]] = {
    "chat_template": ((), "is not supported: the model's own template is used"),
    "documents": ((), "is not supported"),
    "echo": ((False,), "is not supported on chat"),
}


def _at_default(value: Any, defaults: tuple[Any, ...], why: str) -> Any:
    """`value` where it is null or one of `defaults` (an empty list counts as ``()``);
    otherwise the 400 saying why it is refused."""
    if value is None:
        return None
    plain = () if isinstance(value, list) and not value else value
    if any(plain == d and type(plain) is type(d) for d in defaults):
        return value
    first = defaults[0] if defaults else None
    shown = json.dumps(list(first) if isinstance(first, tuple) else first)
    raise custom_error("unsupported_value", f"{why} (only its default, {shown}, is accepted)")


def _at_defaults(table: dict[str, tuple[tuple[Any, ...], str]]) -> Any:
    """The field validator refusing `table`'s fields away from their defaults."""

    def check(cls: Any, value: Any, info: Any) -> Any:
        return _at_default(value, *table[info.field_name])

    return field_validator(*table)(classmethod(check))


class CommonFields(BaseModel):
    """vLLM's extra fields that chat and completions share."""

    ignore_eos: bool | None = None
    stop_token_ids: (
        Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None
    ) = None
    skip_special_tokens: bool | None = None
    return_token_ids: bool | None = None
    min_tokens: Any = None
    include_stop_str_in_output: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    spaces_between_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    prompt_logprobs: Any = None
    logprob_token_ids: Any = None
    return_tokens_as_token_ids: Any = None
    prompt_embeds: Any = None
    priority: Any = None
    thinking_token_budget: Any = None
    vllm_xargs: Any = None

    _common_default = _at_defaults(_COMMON_DEFAULTS)


class ChatFields(CommonFields):
    """vLLM's extra chat fields."""

    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: Any = None
    documents: Any = None
    echo: Any = None

    _chat_default = _at_defaults(_CHAT_DEFAULTS)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_keys(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        for key in value or {}:
            if key in _RESERVED_TEMPLATE_KEYS:
                instead = _RESERVED_TEMPLATE_KEYS[key]
                hint = f"; set {instead}" if instead else ""
                raise custom_error("invalid_value", f"may not set {key!r}: the server does{hint}")
        return value


class CompletionFields(CommonFields):
    """vLLM's extra completions fields."""

    add_special_tokens: bool | None = None


def vllm_extras(wire: CommonFields, req: Any, vocab_size: int | None) -> None:
    """Copy the honoured fields of `wire` onto `req` (a `GenRequest`); APIError 400
    naming the field for an id outside the vocabulary or flags that contradict."""
    req.ignore_eos = bool(wire.ignore_eos)
    ids = tuple(dict.fromkeys(wire.stop_token_ids or ()))
    if vocab_size is not None:
        for i in ids:
            if i >= vocab_size:
                raise APIError(
                    400,
                    f"'stop_token_ids' holds {i}, outside the vocabulary (0..{vocab_size - 1})",
                    param="stop_token_ids", code="invalid_value",
                )  # fmt: skip
    req.stop_token_ids = ids
    req.skip_special_tokens = wire.skip_special_tokens is not False
    req.return_token_ids = bool(wire.return_token_ids)
    if isinstance(wire, CompletionFields):
        req.add_special_tokens = wire.add_special_tokens
    if isinstance(wire, ChatFields):
        keep_going = bool(wire.continue_final_message)
        if keep_going and wire.add_generation_prompt:
            raise APIError(
                400, "'continue_final_message' continues the last message, so "
                "'add_generation_prompt' must be false with it",
                param="continue_final_message", code="invalid_value",
            )  # fmt: skip
        template = dict(wire.chat_template_kwargs or {})
        if wire.add_generation_prompt is False or keep_going:
            template["add_generation_prompt"] = False
        if keep_going:
            template["continue_final_message"] = True
        req.template = template or None
