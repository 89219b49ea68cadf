"""vLLM's tokenizer endpoints on the served model's own tokenizer: ``POST /tokenize``,
``POST /detokenize`` and ``GET /tokenizer_info``, in vLLM's shapes.

lm-evaluation-harness's ``local-completions`` looks for ``/tokenizer_info`` and
``/tokenize`` and, where both answer, tokenizes through the server (its "remote"
tokenizer backend, chosen by default): the contexts and continuations it scores are
then split into the served model's own tokens (llama.cpp's for a GGUF on ``--engine
llamacpp``, the upstream's tokenizer on the proxy) with no Hugging Face tokenizer to
find.

- ``/tokenize``: ``{"prompt": str}`` (``add_special_tokens``, default true, adds what
  the tokenizer adds, a BOS say) or ``{"messages": [...]}`` (rendered by the chat
  template with a generation prompt unless ``add_generation_prompt`` is false, checked
  and rendered as the chat endpoint renders them, ``tools``, ``continue_final_message``
  and ``chat_template_kwargs`` included);
  ``return_token_strs`` adds each token's string as the completions API spells it.
  Answers ``{"count", "max_model_len", "tokens", "token_strs"}``.
- ``/detokenize``: ``{"tokens": [ids]}`` answers ``{"prompt": text}``, the ids' text
  as the tokenizer decodes it.
- ``/tokenizer_info``: the tokenizer's special tokens (``eos_token``, ``bos_token``,
  ``pad_token``), ``chat_template``, ``model_max_length`` and its class.

``model``, where given, must be the served one. Bad input is a 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import APIError
from .answers import json_response
from .body import read_json
from .protocol import is_int
from .wire_errors import bad_request, json_type_name
from .wire_tokens import spellings

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

__all__ = ["detokenize", "routes", "tokenize", "tokenizer_info"]

_PROMPT_KEYS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_CHAT_KEYS = {"model", "messages", "add_generation_prompt", "return_token_strs", "tools",
              "continue_final_message", "chat_template_kwargs"}  # fmt: skip
#: Those that parse as the chat endpoint parses them (`server.vllm_fields`).
_TEMPLATE_KEYS = ("messages", "tools", "add_generation_prompt", "continue_final_message",
                  "chat_template_kwargs")  # fmt: skip


def routes(server: Any) -> list[Any]:
    """The three routes, bound to the app's routes object (`app._Server`: its scheduler,
    body limit, model check and loaded vocabulary)."""
    from starlette.routing import Route

    def bound(handler: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            return await handler(request, server)

        return endpoint

    return [
        Route("/tokenize", bound(tokenize), methods=["POST"]),
        Route("/detokenize", bound(detokenize), methods=["POST"]),
        Route("/tokenizer_info", bound(tokenizer_info), methods=["GET"]),
    ]


async def tokenize(request: Request, server: Any) -> Response:
    body = await _body(request, server)
    vocab = server.loaded_vocab()
    strs = _flag(body, "return_token_strs", False)
    if "messages" in body:
        _known(body, _CHAT_KEYS)
        ids = _chat(body, server, vocab.size)
    else:
        _known(body, _PROMPT_KEYS)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request(
                "prompt", f"'prompt' must be a string, got {json_type_name(prompt)}",
                "invalid_type",
            )  # fmt: skip
        special = _flag(body, "add_special_tokens", True)
        tokenizer = server.scheduler.tokenizer
        ids = tokenizer.encode(prompt, add_special_tokens=special) if prompt else []
        ids = [int(i) for i in ids]
    out: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": server.scheduler.context_length,
        "tokens": ids,
        "token_strs": None,
    }
    if strs:
        name = spellings(vocab).completion_token
        out["token_strs"] = [name(i) for i in ids]
    return json_response(out)


async def detokenize(request: Request, server: Any) -> Response:
    body = await _body(request, server)
    vocab = server.loaded_vocab()
    _known(body, {"model", "tokens"})
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(is_int(i) for i in ids):
        raise bad_request(
            "tokens", f"'tokens' must be an array of token ids, got {json_type_name(ids)}",
            "invalid_type",
        )  # fmt: skip
    bad = next((i for i in ids if not 0 <= i < vocab.size), None)
    if bad is not None:
        span = f"0..{vocab.size - 1}"
        raise bad_request("tokens", f"token id {bad} is outside the vocabulary ({span})")
    text = server.scheduler.tokenizer.decode([int(i) for i in ids]) if ids else ""
    return json_response({"prompt": text})


async def tokenizer_info(request: Request, server: Any) -> Response:
    server.loaded_vocab()  # 503 until the model is loaded
    tokenizer = server.scheduler.tokenizer
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        value = getattr(tokenizer, name, None)
        info[name] = value if isinstance(value, str) else None
    template = getattr(tokenizer, "chat_template", None)
    info["chat_template"] = template if isinstance(template, str) else None
    info["model_max_length"] = server.scheduler.context_length
    return json_response(info)


async def _body(request: Request, server: Any) -> dict[str, Any]:
    body = await read_json(request, server.max_body_bytes)
    server.check_model(body)
    return body


def _known(body: Mapping[str, Any], keys: set[str]) -> None:
    extra = sorted(set(body) - keys)
    if extra:
        raise bad_request(extra[0], f"unknown field {extra[0]!r}", "unknown_parameter")


def _flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise bad_request(key, f"'{key}' must be a boolean, got {json_type_name(value)}",
                          "invalid_type")  # fmt: skip
    return value


def _chat(body: Mapping[str, Any], server: Any, vocab_size: int) -> list[int]:
    """The messages checked and rendered as the chat endpoint renders them (with a
    generation prompt unless ``add_generation_prompt`` is false; vLLM's
    ``continue_final_message`` and ``chat_template_kwargs``)."""
    from ..prompting import chat_ids
    from .protocol import parse_chat

    _flag(body, "add_generation_prompt", True)
    wire = {k: body[k] for k in _TEMPLATE_KEYS if body.get(k) is not None}
    req = parse_chat(wire, server.scheduler.model_name, vocab_size)
    try:
        return chat_ids(server.scheduler.tokenizer, req.prompt, vocab_size, req.tools,
                        req.template)  # fmt: skip
    except (TypeError, ValueError) as e:
        raise APIError(400, f"the chat template failed: {e}", param="messages") from None
