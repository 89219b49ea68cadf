"""Request preparation shared by `stream_generate`, the batch functions, the server and
the proxy: a tokenizer's compiled vocabulary and EOS ids, a prompt turned into checked
token ids, stop strings turned into a matcher, the aligner that continues a prompt, and
the room a prompt leaves in the model's context.

This module sits below the engines: it knows tokenizers, the aligner and stop strings,
never a model runtime. Every entry point (library, CLI, server, proxy) prepares a
request through these functions, so a prompt or a stop list means the same everywhere.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from .align import Aligner
from .errors import ContextOverflow
from .stops import StopMatcher
from .vocab import Vocab, load_vocab

log = logging.getLogger(__name__)

__all__ = [
    "aligner_for",
    "check_ids",
    "eos_ids",
    "prompt_ids",
    "room",
    "stop_matcher",
    "vocab_for",
]

_VOCABS: weakref.WeakKeyDictionary[Any, Vocab] = weakref.WeakKeyDictionary()


def vocab_for(tokenizer: Any) -> Vocab:
    """The tokenizer compiled for the aligner, cached per tokenizer object (compiling a
    large vocabulary takes a while; a tokenizer is reused across many requests)."""
    try:
        hit = _VOCABS.get(tokenizer)
    except TypeError:  # not weak-referenceable or not hashable
        return load_vocab(tokenizer)
    if hit is None:
        hit = load_vocab(tokenizer)
        _VOCABS[tokenizer] = hit
    return hit


def eos_ids(tokenizer: Any) -> frozenset[int]:
    """End-of-sequence ids: mlx-lm's `eos_token_ids` (which merges the model config's),
    else a transformers tokenizer's own `eos_token_id`."""
    for name in ("eos_token_ids", "eos_token_id"):
        ids = getattr(tokenizer, name, None)
        if ids is None:
            continue
        if isinstance(ids, int):
            return frozenset((ids,))
        return frozenset(int(i) for i in ids)
    return frozenset()


def check_ids(ids: Sequence[Any], vocab_size: int | None, what: str) -> list[int]:
    """`ids` as a list of ints inside the vocabulary; errors name `what` and the id.

    Integral numbers of other types (numpy ints, `mx.array` items) are accepted; bools,
    floats with a fraction and anything else are a TypeError."""
    out = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            try:
                j = int(i)
            except (TypeError, ValueError):
                raise TypeError(f"{what} must be token ids (ints), got {i!r}") from None
            if isinstance(i, bool) or j != i:
                raise TypeError(f"{what} must be token ids (ints), got {i!r}")
            i = j
        if i < 0 or (vocab_size is not None and i >= vocab_size):
            limit = "" if vocab_size is None else f" (valid ids are 0..{vocab_size - 1})"
            raise ValueError(f"{what} contains token id {i}, outside the vocabulary{limit}")
        out.append(i)
    return out


def prompt_ids(
    tokenizer: Any,
    prompt: Any,
    vocab_size: int | None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    template: Mapping[str, Any] | None = None,
    add_special_tokens: bool | None = None,
) -> list[int]:
    """Token ids for a str, a list of ids, an array of ids or a list of chat messages
    (rendered with the tokenizer's chat template and a generation prompt; `tools`, in
    OpenAI's shape, go to the template too, and `template`'s variables: see `chat_ids`).
    `tools` with a prompt that is not chat messages is a ValueError. A str is encoded
    with the tokenizer's special tokens (BOS) unless it starts with them or
    `add_special_tokens` is False."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        if add_special_tokens is not None:
            add_special = add_special_tokens
        ids = tokenizer.encode(prompt, add_special_tokens=add_special)
        return check_ids(list(ids), vocab_size, "encoded prompt")
    if hasattr(prompt, "tolist") and not isinstance(prompt, list):
        prompt = prompt.tolist()  # mx.array / numpy array of ids
    if not isinstance(prompt, Sequence) or isinstance(prompt, bytes | bytearray):
        raise TypeError(
            "prompt must be a str, a list of token ids or a list of chat messages, "
            f"got {type(prompt).__name__}"
        )
    if len(prompt) == 0:
        raise ValueError("prompt is empty")
    if all(isinstance(m, Mapping) for m in prompt):
        return chat_ids(tokenizer, prompt, vocab_size, tools, template)
    if tools:
        raise ValueError("tools are rendered by the chat template: give chat messages")
    return check_ids(prompt, vocab_size, "prompt")


def chat_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    vocab_size: int | None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    template: Mapping[str, Any] | None = None,
) -> list[int]:
    """Chat messages rendered by the tokenizer's chat template, with a generation prompt
    (and `tools`, OpenAI's tool definitions, when given: the template renders them).

    `template`: more variables for the template (vLLM's ``chat_template_kwargs``, e.g.
    ``enable_thinking``), and ``add_generation_prompt`` False, or
    ``continue_final_message`` True: the last message (an assistant's) is left open
    for the reply to continue, as transformers renders it (every tokenizer here takes
    it: transformers', mlx-lm's and the GGUF's)."""
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(
                f"prompt message {i} must have a 'role' (str) and 'content', got {dict(m)!r}"
            )
    has_template = getattr(tokenizer, "has_chat_template", None)
    if has_template is None:
        has_template = getattr(tokenizer, "chat_template", None) is not None
    if not has_template:
        raise ValueError(
            "prompt is a list of chat messages but the tokenizer has no chat template; "
            "pass the prompt as a str or token ids"
        )
    kwargs: dict[str, Any] = {"add_generation_prompt": True, "tokenize": True}
    kwargs.update(template or {})
    if kwargs.get("continue_final_message") and messages[-1].get("role") != "assistant":
        raise ValueError(
            "continue_final_message continues the last message, which must be the "
            f"assistant's, not the {messages[-1].get('role')!r} one"
        )
    if tools:
        kwargs["tools"] = [dict(t) for t in tools]
    if not type(tokenizer).__module__.startswith("mlx_lm"):
        kwargs["return_dict"] = False  # transformers 5 returns a BatchEncoding otherwise
    try:
        ids = tokenizer.apply_chat_template([dict(m) for m in messages], **kwargs)
    except Exception as e:  # the template's own raise_exception, or a variable it refuses
        if type(e).__module__.split(".")[0] != "jinja2":
            raise
        raise ValueError(f"the chat template failed: {e}") from None
    if isinstance(ids, Mapping):  # some tokenizers return a BatchEncoding regardless
        ids = ids["input_ids"]
    return check_ids(list(ids), vocab_size, "chat template output")


def stop_matcher(stop: Any) -> StopMatcher | None:
    """A matcher for `stop` (a str or a list of str), or None when there is nothing to
    match. Bad input is a TypeError/ValueError naming `stop`."""
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, Sequence):
        raise TypeError(f"stop must be a str or a list of str, got {type(stop).__name__}")
    if not stop:
        return None
    return StopMatcher(stop)


_ALIGNERS: weakref.WeakKeyDictionary[Any, dict[bool, Aligner]] = weakref.WeakKeyDictionary()


def aligner_for(
    tokenizer: Any, prompt_ids: Sequence[int] | None, skip_special_tokens: bool
) -> Aligner:
    """An aligner continuing `prompt_ids`, built from a per-tokenizer template (cheap).

    A prompt the tokenizer cannot decode (ids past its vocabulary, which padded models
    accept) is left out as context rather than refused."""
    try:
        templates = _ALIGNERS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable or not hashable
        templates = {}
    template = templates.get(skip_special_tokens)
    if template is None:
        template = templates[skip_special_tokens] = Aligner(
            vocab_for(tokenizer), skip_special_tokens=skip_special_tokens
        )
    if prompt_ids:
        try:
            return template.fresh(prompt_ids=prompt_ids)
        except (TypeError, ValueError) as e:
            log.debug("prompt not usable as alignment context: %s", e)
    return template.fresh(prompt_ids=None)


def room(
    context_length: int | None,
    n_prompt: int,
    limit: int | None,
    cached: int = 0,
    *,
    overflow: Literal["cap", "raise"] = "cap",
) -> int | None:
    """How many tokens may be generated after an `n_prompt`-token prompt (`cached` more
    already in the model's cache) in a context of `context_length` (None: unknown).

    A prompt that leaves no room is a `ContextOverflow` (a ValueError). With
    `overflow="cap"` (the library's rule) a `limit` past the room is lowered to it, so
    generation ends with "length" where the model would otherwise fail; with
    `overflow="raise"` (the server's rule, as OpenAI answers) such a request is a
    `ContextOverflow` naming both numbers."""
    if context_length is None:
        return limit
    left = context_length - cached - n_prompt
    if left < 1:
        raise ContextOverflow(
            f"prompt is {n_prompt} tokens{f' after {cached} cached ones' if cached else ''}, "
            f"which leaves no room in the model's context of {context_length} tokens "
            "(max_position_embeddings)",
            "prompt",
        )
    if limit is None or limit <= left:
        return left if limit is None else limit
    if overflow == "raise":
        raise ContextOverflow(
            f"max_tokens is {limit}, but the prompt's {n_prompt} tokens leave room for "
            f"{left} in the model's context of {context_length} tokens",
            "max_tokens",
        )
    return left
