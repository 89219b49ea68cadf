"""What the engines read from a model's configuration, in one place.

The MLX, torch and vLLM engines (and the GGUF loaders) all need the same few facts: is a
model argument a Hugging Face hub id, how long is the model's context, how large its
vocabulary, and which tokens end generation. This module answers them one way for all
of them. It imports nothing from tokentrail and no model runtime.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "CONTEXT_KEYS",
    "HUB_ID",
    "PREFILL_STEP_SIZE",
    "as_ids",
    "attach_eos_ids",
    "config_eos_ids",
    "config_int",
    "continue_last",
    "is_hub_id",
    "model_eos_ids",
]

#: Prompt tokens processed per forward pass while filling the cache (as mlx-lm).
PREFILL_STEP_SIZE = 2048
#: Config keys that hold a model's context length, in order of preference.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")
#: A bare Hugging Face hub repository id, ``org/name``.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(path: Any) -> bool:
    """Whether a model argument that is not a local path is a hub id (``org/name``),
    which the engine's own loader may download: the only case that touches the network."""
    return isinstance(path, str) and bool(HUB_ID.match(path)) and not path.startswith(".")


def _positive_int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def config_int(config: Any, keys: Sequence[str]) -> int | None:
    """The first positive int under `keys` (in order) in a model's configuration.

    `config` is a mapping (a config.json: its own keys first, then its ``text_config``'s)
    or a transformers config object (its text config's attributes first, then its own).
    None when no key holds one."""
    if isinstance(config, Mapping):
        for source in (config, config.get("text_config") or {}):
            for key in keys:
                value = _positive_int(source.get(key))
                if value is not None:
                    return value
        return None
    sources = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        with contextlib.suppress(Exception):  # some need arguments; the top level will do
            sources.insert(0, get_text())
    for source in sources:
        for key in keys:
            value = _positive_int(getattr(source, key, None))
            if value is not None:
                return value
    return None


def as_ids(value: Any) -> list[int]:
    """A config's ``eos_token_id`` (an int, a list of ints or None) as a list of ids."""
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list | tuple | set | frozenset):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def config_eos_ids(*configs: Any) -> list[int]:
    """The end-of-sequence ids of the first of `configs` that names any (its
    ``eos_token_id``); pass the generation config before the model config, as mlx-lm
    reads them. None entries are skipped."""
    for config in configs:
        ids = as_ids(getattr(config, "eos_token_id", None))
        if ids:
            return ids
    return []


def model_eos_ids(model: Any) -> list[int]:
    """End-of-sequence ids of a transformers model: its generation config's, else its
    model config's (as mlx-lm)."""
    return config_eos_ids(getattr(model, "generation_config", None), getattr(model, "config", None))


def attach_eos_ids(tokenizer: Any, eos_token_ids: Iterable[int]) -> Any:
    """Set `tokenizer.eos_token_ids` to `eos_token_ids` plus the tokenizer's own
    `eos_token_id`, as a frozenset; return the tokenizer.

    `stream_generate` stops on any id in `tokenizer.eos_token_ids` (as with mlx-lm's
    TokenizerWrapper), so a chat model whose generation config ends turns with a token
    other than `eos_token` (e.g. ``<|im_end|>``) stops where it should."""
    eos = set(eos_token_ids)
    own = getattr(tokenizer, "eos_token_id", None)
    if own is not None:
        eos.add(int(own))
    try:
        # transformers' __setattr__ treats any `*_ids` name as a special-token setter.
        object.__setattr__(tokenizer, "eos_token_ids", frozenset(eos))
    except AttributeError:  # a future transformers may define it read-only
        log.warning("cannot attach eos_token_ids %s to %s", sorted(eos), type(tokenizer).__name__)
    return tokenizer


def continue_last(rendered: str, content: str) -> str:
    """A rendered chat cut right after its last message's `content`, so that the reply
    continues that message (``continue_final_message``, with the meaning transformers
    gives it): the content's last occurrence, kept with its leading and trailing
    whitespace where the template rendered them, without where it stripped them.
    ValueError where the content is empty or not in the rendering."""
    core = content.strip()
    at = rendered.rfind(core) if core else -1
    if at < 0:
        raise ValueError(
            "continue_final_message: the last message's content is empty or the chat "
            "template does not render it as given"
        )
    kept = content.lstrip()
    return rendered[: at + (len(kept) if rendered.startswith(kept, at) else len(core))]
