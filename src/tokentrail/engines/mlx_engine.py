"""The MLX engine: mlx-lm's model zoo, its own generation loop and samplers, plus
on-device logprobs.

Generation is mlx-lm's `generate_step` with a wrapped sampler (`mlx_steps`): each step
computes, in one lazy graph, the next token, its logprob and (when asked) the top-k
alternatives, evaluated together with `mx.async_eval` while the host handles the
previous step. The host reads a few scalars per step, never the whole vocabulary.
Batches run on mlx-lm's `BatchGenerator` (`mlx_batch`).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..sampling import SamplingParams
from .base import Step, read_model_config

log = logging.getLogger(__name__)

#: Prompt tokens processed per forward pass while filling the cache (as mlx-lm).
PREFILL_STEP_SIZE = 2048
#: Config keys that hold a model's context length, in order of preference.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
#: Block size of the two-stage top-k, and the vocabulary size from which it pays off
#: (below it one partition of the whole row takes fewer device ops).
_TOPK_BLOCK = 256
_TOPK_TWO_STAGE_FROM = 16384


@dataclass(frozen=True)
class ModelInfo:
    """What `load` learned about a model folder, kept on the model object."""

    path: str
    config: dict[str, Any] = field(repr=False)


def _config_int(config: dict[str, Any], keys: Sequence[str]) -> int | None:
    for source in (config, config.get("text_config") or {}):
        for key in keys:
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def top_k_ids(x: mx.array, k: int, block: int = _TOPK_BLOCK) -> mx.array:
    """Ids of the `k` largest entries of each row of `x` (unordered), on the device.

    Two stages instead of one partition of the whole vocabulary, which on large
    vocabularies costs several times an argmax: take the max of each block of
    `block` entries, keep the `k` blocks with the largest maxima, and partition only
    their entries (plus the ragged tail). Every entry larger than the k-th largest
    value lies in one of those blocks, so the values found are exactly the top k.
    """
    rows, size = x.shape
    n_blocks = size // block
    if size < _TOPK_TWO_STAGE_FROM or n_blocks <= k:
        return mx.argpartition(x, kth=size - k, axis=-1)[:, size - k :]
    head = x if size % block == 0 else x[:, : n_blocks * block]
    blocked = head.reshape(rows, n_blocks, block)
    best = mx.argpartition(blocked.max(axis=-1), kth=n_blocks - k, axis=-1)[:, n_blocks - k :]
    cand = (best[:, :, None] * block + mx.arange(block, dtype=best.dtype)).reshape(rows, -1)
    if size % block:
        tail = mx.arange(n_blocks * block, size, dtype=cand.dtype)
        cand = mx.concatenate([cand, mx.broadcast_to(tail, (rows, tail.size))], axis=-1)
    n = cand.shape[-1]
    pick = mx.argpartition(mx.take_along_axis(x, cand, axis=-1), kth=n - k, axis=-1)[:, n - k :]
    return mx.take_along_axis(cand, pick, axis=-1)


def load(path: str | os.PathLike[str]) -> tuple[nn.Module, Any]:
    """Load a Hugging Face-layout folder with mlx-lm; return (model, TokenizerWrapper).

    A path that does not exist is an error, except a bare ``org/name`` Hugging Face
    repository id, which mlx-lm downloads (the only case that touches the network).
    A `.gguf` file (or a named model such as ``smollm2``) is converted once to a cached
    folder (see `gguf_models.mlx_folder_from_gguf`).
    """
    from .gguf_models import gguf_source, mlx_folder_from_gguf

    gguf = gguf_source(path)
    if gguf is not None:
        path = mlx_folder_from_gguf(gguf)
    p = Path(path).expanduser()
    if not p.exists():
        if isinstance(path, str) and _HUB_ID.match(path) and not path.startswith("."):
            log.info("%s is not a local folder; asking mlx-lm to fetch it from the hub", path)
            from mlx_lm.utils import load as mlx_load

            try:
                model, tokenizer, config = mlx_load(path, return_config=True)
            except Exception as e:
                raise FileNotFoundError(
                    f"model {path!r} is not a local folder and could not be fetched from the "
                    f"Hugging Face hub: {e}"
                ) from e
            _remember(model, path, config)
            return model, tokenizer
        raise FileNotFoundError(f"model folder not found: {p}")
    config = read_model_config(p)
    if not any(p.glob("model*.safetensors")):
        raise FileNotFoundError(f"no model*.safetensors weights in model folder {p}")
    from mlx_lm.utils import load as mlx_load  # imports transformers: after the cheap checks

    try:
        model, tokenizer, config = mlx_load(str(p), return_config=True)
    except ValueError as e:
        if "not supported" in str(e):
            raise ValueError(
                f"{p}: model architecture {config['model_type']!r} is not supported by mlx-lm"
            ) from e
        raise ValueError(f"cannot load model from {p}: {e}") from e
    except (OSError, KeyError, TypeError) as e:
        raise ValueError(f"cannot load model from {p}: {e}") from e
    _remember(model, str(p), config)
    return model, tokenizer


def _remember(model: nn.Module, path: str, config: dict[str, Any]) -> None:
    # nn.Module stores dicts as parameter trees; a non-container object stays an attribute.
    object.__setattr__(model, "_tokentrail_info", ModelInfo(path, config))


def accepts(model: Any) -> bool:
    """Whether `model` is an MLX module this engine can run."""
    return isinstance(model, nn.Module) and callable(model)


def wrap(model: nn.Module) -> MLXEngine:
    return MLXEngine(model)


class MLXEngine:
    """Runs an mlx-lm model; see `tokentrail.engines.Engine`."""

    name = "mlx"
    #: Runs mlx-lm's step functions, so `stream_generate` passes their options through.
    mlx_options = True

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        info = getattr(model, "_tokentrail_info", None)
        config: dict[str, Any] = dict(info.config) if isinstance(info, ModelInfo) else {}
        args = getattr(model, "args", None)
        if args is not None:
            for key in ("vocab_size", *_CONTEXT_KEYS):
                value = getattr(args, key, None)
                if key not in config and value is not None:
                    config[key] = value
        self.vocab_size: int | None = _config_int(config, ("vocab_size",))
        self.context_length: int | None = _config_int(config, _CONTEXT_KEYS)

    def peak_memory(self) -> float:
        return mx.get_peak_memory() / 1e9

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_tokens: int | None,
        **options: Any,
    ) -> Iterator[Step]:
        """Yield Steps; see `Engine.generate`. Prompt ids must already be validated.

        Runs mlx-lm's own `generate_step` (see `mlx_steps`); `options` are its keywords
        (e.g. `prompt_cache`, `kv_bits`, `draft_model` for speculative decoding)."""
        from .mlx_steps import mlx_steps

        sampler, processors = sampling_for(params, self.vocab_size)
        if options.get("logits_processors"):
            processors = [*options.pop("logits_processors"), *processors]
        options["logits_processors"] = processors or None
        if params.seed is not None:
            mx.random.seed(params.seed)
        draft = options.pop("draft_model", None)
        yield from mlx_steps(
            self.model, prompt_ids, sampler, params.top_logprobs, max_tokens, draft, **options
        )

    def open_batch(self, max_batch: int, prompt_cache_bytes: int | None = None) -> Any:
        """A `Batch` on mlx-lm's `BatchGenerator` (see `tokentrail.engines.mlx_batch`)."""
        from .mlx_batch import MLXBatch

        return MLXBatch(
            self.model, max_batch, prompt_cache_bytes=prompt_cache_bytes,
            vocab_size=self.vocab_size,
        )


def sampling_for(
    params: SamplingParams, vocab_size: int | None
) -> tuple[Callable[[mx.array], mx.array], list[Callable[[mx.array, mx.array], mx.array]]]:
    """mlx-lm's sampler and logits processors for `params` (as `mlx_lm.generate` makes
    them from its command-line flags)."""
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    top_k = params.top_k if vocab_size is None or params.top_k < vocab_size else 0
    sampler = make_sampler(params.temp, params.top_p, params.min_p, 1, top_k=top_k)
    processors = make_logits_processors(params.logit_bias, params.repetition_penalty)
    return sampler, processors
