"""The MLX engine: mlx-lm's model zoo, its own generation loop and samplers, plus
on-device logprobs.

Generation is mlx-lm's `generate_step` with a wrapped sampler (`mlx.steps`): each step
computes, in one lazy graph, the next token, its logprob and (when asked) the top-k
alternatives, evaluated together with `mx.async_eval` while the host handles the
previous step. The host reads a few scalars per step, never the whole vocabulary.
Batches run on mlx-lm's `BatchGenerator` (`mlx.batch`). The samplers and the top-k
live in `mlx.sampling`, which all three modules import; this module imports `mlx.steps`
and `mlx.batch` (when first used), never the reverse.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ...sampling import SamplingParams
from ...weakid import IdWeakMap
from ..base import Step, read_model_config

# PREFILL_STEP_SIZE, top_k_ids (and sampling_for) stay importable from here, where they
# used to live; their homes are `engines.config` and `engines.mlx.sampling`.
from ..config import (
    CONTEXT_KEYS,
    PREFILL_STEP_SIZE,  # noqa: F401
    config_int,
    is_hub_id,
)
from .sampling import sampling_for, top_k_ids  # noqa: F401

log = logging.getLogger(__name__)

__all__ = ["MLXEngine", "ModelInfo", "accepts", "load", "model_info", "wrap"]


@dataclass(frozen=True)
class ModelInfo:
    """What `load` learned about a model folder, kept for the model (see `model_info`)."""

    path: str
    config: dict[str, Any] = field(repr=False)


def load(path: str | os.PathLike[str]) -> tuple[nn.Module, Any]:
    """Load a Hugging Face-layout folder with mlx-lm; return (model, TokenizerWrapper).

    A path that does not exist is an error, except a bare ``org/name`` Hugging Face
    repository id, which mlx-lm downloads (the only case that touches the network).
    A `.gguf` file (or a named model such as ``smollm2``) is converted once to a cached
    folder (see `gguf_models.mlx_folder_from_gguf`).
    """
    from ..gguf_models import gguf_source, mlx_folder_from_gguf

    gguf = gguf_source(path)
    if gguf is not None:
        path = mlx_folder_from_gguf(gguf)
    p = Path(path).expanduser()
    if not p.exists():
        if is_hub_id(path):
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


#: What `load` learned about each model it loaded, by identity: an `nn.Module` is a
#: dict, so it cannot be a weak dictionary's key, and an attribute written onto it would
#: patch an object mlx-lm owns.
_INFO: IdWeakMap[ModelInfo] = IdWeakMap()


def _remember(model: nn.Module, path: str, config: dict[str, Any]) -> None:
    _INFO.put(model, ModelInfo(path, config))


def model_info(model: Any) -> ModelInfo | None:
    """What `load` learned about `model` (its folder and config), or None when `load`
    did not load it."""
    return _INFO.get(model)


def accepts(model: Any) -> bool:
    """Whether `model` is an MLX module this engine can run."""
    return isinstance(model, nn.Module) and callable(model)


def wrap(model: nn.Module) -> MLXEngine:
    return MLXEngine(model)


class MLXEngine:
    """Runs an mlx-lm model; see `tokentrail.engines.Engine`.

    `mlx_options` is True: `generate` takes mlx-lm's step keywords (see
    `tokentrail.engines.mlx.steps.step_options`)."""

    name = "mlx"
    mlx_options = True

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        info = model_info(model)
        config: dict[str, Any] = dict(info.config) if info is not None else {}
        args = getattr(model, "args", None)
        if args is not None:
            for key in ("vocab_size", *CONTEXT_KEYS):
                value = getattr(args, key, None)
                if key not in config and value is not None:
                    config[key] = value
        self.vocab_size: int | None = config_int(config, ("vocab_size",))
        self.context_length: int | None = config_int(config, CONTEXT_KEYS)

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

        Runs mlx-lm's own `generate_step` (see `mlx.steps`); `options` are its keywords
        (e.g. `prompt_cache`, `kv_bits`, `draft_model` for speculative decoding)."""
        from .guided import guided_recorder
        from .steps import mlx_steps

        sampler, processors = sampling_for(params, self.vocab_size)
        if options.get("logits_processors"):
            processors = [*options.pop("logits_processors"), *processors]
        options["logits_processors"] = processors or None
        if params.seed is not None:
            mx.random.seed(params.seed)
        draft = options.pop("draft_model", None)
        guided = guided_recorder(params, self.vocab_size, params.top_logprobs)
        if guided is not None:
            if draft is not None:
                raise ValueError(
                    "speculative decoding (draft_model) does not take a constraint or "
                    "logprobs_mode='processed'"
                )
            sampler = guided
        yield from mlx_steps(
            self.model, prompt_ids, sampler, params.top_logprobs, max_tokens, draft, **options
        )

    def generate_rewindable(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_tokens: int | None,
        **options: Any,
    ) -> Any:
        """A step stream that can take tokens back (`engines.base.RewindableSteps`, for
        field retry): the model one token at a time on a cache of its own (see
        `mlx.rewind`). Of mlx-lm's step options it takes `logits_processors` and
        `prefill_step_size`; the others (a prompt cache, KV quantization, a draft
        model...) are refused: a ValueError naming them."""
        from .rewind import MLXRewindable

        processors = list(options.pop("logits_processors", None) or [])
        step = options.pop("prefill_step_size", None) or 2048
        unused = sorted(k for k, v in options.items() if v is not None)
        if unused:
            raise ValueError(f"field retry does not take {', '.join(unused)} on MLX")
        _, own = sampling_for(params, self.vocab_size)
        return MLXRewindable(
            self.model, prompt_ids, params, self.vocab_size, max_tokens, [*processors, *own],
            step,
        )

    def open_batch(self, max_batch: int, prompt_cache_bytes: int | None = None) -> Any:
        """A `Batch` on mlx-lm's `BatchGenerator` (see `tokentrail.engines.mlx.batch`)."""
        from .batch import MLXBatch

        return MLXBatch(
            self.model, max_batch, prompt_cache_bytes=prompt_cache_bytes,
            vocab_size=self.vocab_size,
        )

