"""The PyTorch engine: any transformers causal LM, a KV cache, and on-device logprobs.

Each step runs the model on one token with the KV cache, applies mlx-lm's logits
processors and samplers (the same settings mean the same thing as on the MLX engine),
and packs the sampled token, its logprob and the top-k alternatives into one small
vector, so the host reads one vector per step and never the whole vocabulary. On CUDA
the next step is queued before that vector is read, so the GPU works while the host
turns the token into text (as the MLX engine does); on the CPU there is nothing to
overlap and each step runs only when asked for.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..sampling import SamplingParams
from .base import RewindableBase, Step, check_generate_args, read_model_config
from .config import (
    CONTEXT_KEYS,
    PREFILL_STEP_SIZE,
    attach_eos_ids,
    config_int,
    is_hub_id,
    model_eos_ids,
)
from .torch_sampling import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    guide_mask,
    make_processors,
    make_sampler,
    processed_logprobs,
)

log = logging.getLogger(__name__)

#: How many recent tokens the repetition penalty looks at (mlx-lm's default).
REPETITION_CONTEXT_SIZE = 20
#: float32 holds every integer below 2**24 exactly, so token ids travel packed as floats.
_EXACT_FLOAT_IDS = 2**24

__all__ = [
    "PREFILL_STEP_SIZE",
    "TorchEngine",
    "TorchRewindable",
    "accepts",
    "apply_min_p",
    "apply_top_k",
    "apply_top_p",
    "default_device",
    "load",
    "load_tokenizer",
    "wrap",
]


def default_device() -> torch.device:
    """CUDA when available, else Apple's MPS when available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def _transformers_major_minor() -> tuple[int, int]:
    import transformers

    parts = re.findall(r"\d+", transformers.__version__)[:2]
    return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0


def _check_folder(p: Path) -> None:
    read_model_config(p)
    if not (any(p.glob("*.safetensors")) or any(p.glob("pytorch_model*.bin"))):
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {p}")


def load(
    path: str | os.PathLike[str],
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
) -> tuple[Any, Any]:
    """Load a Hugging Face-layout folder with transformers; return (model, tokenizer).

    A `.gguf` file (or a named model such as ``smollm2``) is loaded with transformers'
    GGUF support, dequantized (see `gguf_models.transformers_from_gguf`).

    The model is an `AutoModelForCausalLM` in eval mode on `device` (default: CUDA, MPS or
    CPU, in that order), in `dtype` (default: float32 on the CPU, the checkpoint's own
    dtype elsewhere). The tokenizer is transformers' `AutoTokenizer` with an added
    `eos_token_ids` set that includes the generation config's end tokens. A path that
    does not exist is an error, except a bare ``org/name`` hub id, which transformers
    downloads (the only case that touches the network).
    """
    from transformers import AutoModelForCausalLM

    from .gguf_models import gguf_source, transformers_from_gguf

    gguf = gguf_source(path)
    if gguf is not None:  # a .gguf file or a named model: transformers dequantizes it
        dev = torch.device(device) if device is not None else default_device()
        key = "dtype" if _transformers_major_minor() >= (4, 56) else "torch_dtype"
        model, tokenizer = transformers_from_gguf(gguf, **{key: dtype or torch.float32})
        return model.to(dev).eval(), tokenizer
    p = Path(path).expanduser()
    local = p.exists()
    if local:
        _check_folder(p)
        source = str(p)
    elif is_hub_id(path):
        log.info("%s is not a local folder; asking transformers to fetch it from the hub", path)
        source = path
    else:
        raise FileNotFoundError(f"model folder not found: {p}")
    dev = torch.device(device) if device is not None else default_device()
    if dtype is None:
        dtype = torch.float32 if dev.type == "cpu" else "auto"
    dtype_key = "dtype" if _transformers_major_minor() >= (4, 56) else "torch_dtype"
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, local_files_only=local, **{dtype_key: dtype}
        )
    except (ValueError, KeyError) as e:
        model_type = _model_type(p) if local else None
        if model_type is not None and (
            model_type in str(e) or "Unrecognized configuration class" in str(e)
        ):
            raise ValueError(
                f"{source}: model architecture {model_type!r} is not a causal language model "
                f"that transformers can load ({e})"
            ) from e
        raise ValueError(f"cannot load model from {source}: {e}") from e
    except OSError as e:
        kind = ValueError if local else FileNotFoundError
        raise kind(f"cannot load model from {source}: {e}") from e
    model.to(dev)
    model.eval()
    tokenizer = load_tokenizer(source, eos_token_ids=model_eos_ids(model), local=local)
    return model, tokenizer


def _model_type(p: Path) -> str | None:
    import json

    try:
        value = json.loads((p / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, str) else None


def load_tokenizer(
    path: str | os.PathLike[str], *, eos_token_ids: Sequence[int] = (), local: bool = True
) -> Any:
    """transformers' `AutoTokenizer` for `path`, with `eos_token_ids` (a frozenset) added
    (see `tokentrail.engines.config.attach_eos_ids`)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=local)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the tokenizer from {path}: {e}") from e
    return attach_eos_ids(tokenizer, eos_token_ids)


def accepts(model: Any) -> bool:
    """Whether `model` is a transformers model that can generate text."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return False
    try:
        return bool(model.can_generate())
    except Exception:  # can_generate is a heuristic; a failure means "no"
        return False


def wrap(model: Any) -> TorchEngine:
    return TorchEngine(model)


class TorchEngine:
    """Runs a transformers causal LM with a KV cache; see `tokentrail.engines.Engine`.

    Sampling follows mlx-lm exactly: logit bias, then the repetition penalty over the
    last 20 tokens (prompt included), give the processed logits; `logprobs` is their
    log_softmax; top-p, then min-p, then top-k filter it, and the token is drawn with
    temperature `temp` (argmax when `temp == 0`). Logits are processed in float32.
    A seed gives a reproducible stream on a given device, but not the same tokens as
    MLX, whose random generator differs.
    """

    name = "torch"

    def __init__(self, model: Any, *, prefill_step_size: int = PREFILL_STEP_SIZE) -> None:
        if not callable(model) or not hasattr(model, "config"):
            raise TypeError(
                f"TorchEngine needs a transformers causal LM, got {type(model).__name__}"
            )
        if prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be >= 1, got {prefill_step_size}")
        if getattr(model, "training", False):
            log.warning("the model is in training mode (dropout on); call model.eval() first")
        self.model = model
        self.prefill_step_size = prefill_step_size
        config = model.config
        self.vocab_size: int | None = config_int(config, ("vocab_size",))
        if self.vocab_size is None:
            out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
            weight = getattr(out, "weight", None)
            self.vocab_size = int(weight.shape[0]) if weight is not None else None
        self.context_length: int | None = config_int(config, CONTEXT_KEYS)
        self.eos_token_ids = frozenset(model_eos_ids(model))
        param = next(iter(model.parameters()), None)
        self.device: torch.device = param.device if param is not None else torch.device("cpu")
        names = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values to cache; earlier versions only know the old name.
        self._cache_arg = "cache" if "cache" in names else "past_key_values"
        self._keep_arg = next(
            (k for k in ("logits_to_keep", "num_logits_to_keep") if k in names), None
        )
        # Queue the next step before reading this one where the device runs asynchronously.
        self._pipelined = self.device.type == "cuda"

    def peak_memory(self) -> float:
        """Peak CUDA memory allocated by torch, in GB; 0.0 on other devices."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 1e9
        return 0.0

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None
    ) -> Iterator[Step]:
        """Yield Steps; see `Engine.generate`. Arguments are checked here, at the call."""
        vocab = self.vocab_size
        ids = check_generate_args(prompt_ids, params, max_tokens, vocab)
        if vocab is not None and params.top_logprobs > vocab:
            raise ValueError(
                f"top_logprobs={params.top_logprobs} exceeds the vocabulary size {vocab}"
            )
        return self._steps(ids, params, max_tokens)

    def generate_rewindable(
        self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None
    ) -> TorchRewindable:
        """A step stream that can take tokens back (`engines.base.RewindableSteps`, for
        field retry; see `TorchRewindable`)."""
        ids = check_generate_args(prompt_ids, params, max_tokens, self.vocab_size)
        return TorchRewindable(self, ids, params, max_tokens)

    # -- internals --

    def _forward(self, ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        """Run the model on `ids` (1-D) after `cache`; return last-position logits, cache."""
        kwargs: dict[str, Any] = {self._cache_arg: cache, "use_cache": True}
        if self._keep_arg is not None:
            kwargs[self._keep_arg] = 1
        out = self.model(input_ids=ids[None], **kwargs)
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = getattr(out, "past_key_values", None)
        return out.logits[0, -1], new_cache

    # long: one generation loop with its step and read closures (the pipelined order)
    def _steps(
        self, ids: list[int], params: SamplingParams, max_tokens: int | None
    ) -> Iterator[Step]:
        device = self.device
        k = params.top_logprobs
        generator: torch.Generator | None = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed)
        process = make_processors(params, device)
        sample = make_sampler(params, generator)
        guide = params.constraint.guide() if params.constraint is not None else None
        processed = params.logprobs_mode == "processed"
        dist = params.logprobs_mode
        cache: Any = None
        history: torch.Tensor | None = None
        vocab = self.vocab_size
        pack = torch.float32 if vocab is not None and vocab <= _EXACT_FLOAT_IDS else torch.float64

        with torch.inference_mode():
            prompt = torch.tensor(ids, dtype=torch.long, device=device)
            if process is not None:
                history = prompt[-REPETITION_CONTEXT_SIZE:]
            rest = prompt
            while rest.numel() > 1:
                n = min(self.prefill_step_size, rest.numel() - 1)
                _, cache = self._forward(rest[:n], cache)
                rest = rest[n:]

        def step(inputs: torch.Tensor, first: bool) -> tuple[torch.Tensor, torch.Tensor, Any]:
            nonlocal cache, history
            with torch.inference_mode():
                logits, cache = self._forward(inputs, cache)
                logits = logits.float()
                if process is not None:
                    if not first:
                        history = torch.cat([history, inputs])[-REPETITION_CONTEXT_SIZE:]
                    logits = process(history, logits)
                logprobs = torch.log_softmax(logits, dim=-1)
                masked, log_mass = logprobs, None
                if guide is not None:
                    masked, log_mass = guide_mask(guide, logprobs, None if first else inputs)
                token = sample(masked)
                source = processed_logprobs(masked, params) if processed else logprobs
                # One vector: [token, logprob, top ids..., top logprobs..., (log mass)].
                # float32 holds every id below 2**24 exactly.
                parts = [token.to(pack), source.gather(0, token).to(pack)]
                if k:
                    top = torch.topk(source, k)
                    parts += [top.indices.to(pack), top.values.to(pack)]
                if log_mass is not None:
                    parts.append(log_mass.reshape(1).to(pack))
                return token, torch.cat(parts), logprobs

        def read(info: torch.Tensor) -> tuple[int, float, list[tuple[int, float]], float | None]:
            values = info.tolist()
            top = list(zip(map(int, values[2 : 2 + k]), values[2 + k : 2 + 2 * k], strict=True))
            if processed:  # ids the processed distribution rules out are no alternatives
                top = [(i, lp) for i, lp in top if lp > -math.inf]
            # The log mass is packed last only while the guide masks (not while reasoning).
            mass = math.exp(values[2 + 2 * k]) if len(values) > 2 + 2 * k else None
            return int(values[0]), values[1], top, mass

        token, info, logprobs = step(rest, True)
        n = 0
        while True:
            n += 1
            more = max_tokens is None or n < max_tokens
            if self._pipelined:
                host, ready = _copy_to_host(info)
                if more:
                    upcoming = step(token, False)
                ready.synchronize()
                tid, lp, top, mass = read(host)
            else:
                tid, lp, top, mass = read(info)
            yield Step(tid, lp, top, logprobs, False, dist, mass)
            if not more:
                return
            if not self._pipelined:
                upcoming = step(token, False)
            token, info, logprobs = upcoming


class TorchRewindable(RewindableBase):
    """`engines.base.RewindableSteps` on a transformers model: one token per forward
    pass (not pipelined), able to go back: the KV cache is cut with `DynamicCache.crop`
    and the guide rolls back (`Guide.rollback`). Draws use the engine's samplers at the
    current `temperature`, from one generator (seeded with the request's seed)."""

    def __init__(
        self, engine: TorchEngine, ids: list[int], params: SamplingParams,
        max_tokens: int | None,
    ) -> None:  # fmt: skip
        super().__init__(ids, params, max_tokens)
        self.engine = engine
        self.cache: Any = None
        self.cached = 0  # ids the cache holds
        self.guide = params.constraint.guide() if params.constraint is not None else None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device=engine.device)
            self.generator.manual_seed(params.seed)
        self.process = make_processors(params, engine.device)

    def __next__(self) -> Step:
        engine, p = self.engine, self.params
        if self._exhausted():
            raise StopIteration
        params = p if self.temp == p.temp else replace(p, temp=self.temp)
        with torch.inference_mode():
            pending = torch.tensor(self.ids[self.cached :], dtype=torch.long, device=engine.device)
            while pending.numel() > engine.prefill_step_size:
                _, self.cache = engine._forward(pending[: engine.prefill_step_size], self.cache)
                pending = pending[engine.prefill_step_size :]
            logits, self.cache = engine._forward(pending, self.cache)
            self.cached = len(self.ids)
            logits = logits.float()
            if self.process is not None:
                history = torch.tensor(self.ids[-REPETITION_CONTEXT_SIZE:], device=engine.device)
                logits = self.process(history, logits)
            logprobs = torch.log_softmax(logits, dim=-1)
            masked, log_mass = logprobs, None
            if self.guide is not None:
                masked, log_mass = guide_mask(self.guide, logprobs, None)
            token = int(make_sampler(params, self.generator)(masked).item())
            processed = p.logprobs_mode == "processed"
            source = processed_logprobs(masked, params) if processed else logprobs
            lp = float(source[token])
            top: list[tuple[int, float]] = []
            if p.top_logprobs:
                best = torch.topk(source, p.top_logprobs)
                top = [(int(i), float(v)) for i, v in zip(best.indices, best.values, strict=True)
                       if float(v) > -math.inf or p.logprobs_mode == "raw"]  # fmt: skip
        if self.guide is not None:
            self.guide.advance(token)
        self.ids.append(token)
        mass = None if log_mass is None else math.exp(float(log_mass))
        return Step(token, lp, top, logprobs, False, p.logprobs_mode, mass)

    def rewind(self, n: int) -> None:
        self._check_rewind(n)
        keep = len(self.ids) - n - 1  # the cache holds all but the last id standing
        if self.cached > keep and not hasattr(self.cache, "crop"):
            raise ValueError(f"this model's cache ({type(self.cache).__name__}) cannot be cut")
        if self.guide is not None:
            self.guide.rollback(n)
        del self.ids[len(self.ids) - n :]
        if self.cached > keep:
            self.cache.crop(keep - self.cached)  # negative: tokens to drop (every version)
            self.cached = keep

    def force(self, ids: Sequence[int]) -> None:
        ids = [int(i) for i in ids]
        if self.guide is not None:
            for i in ids:
                self.guide.advance(i)
        self.ids += ids  # run with the next step

    def close(self) -> None:
        self.cache = None
        self.limit = 0


def _copy_to_host(info: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Start copying `info` into pinned host memory; return it and an event to wait on."""
    host = torch.empty(info.shape, dtype=info.dtype, pin_memory=True)
    host.copy_(info, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event
