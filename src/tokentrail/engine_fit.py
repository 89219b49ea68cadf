"""What one generation may ask of its engine: which options the engine takes
(`check_engine_options`: mlx-lm's keywords only where mlx-lm's step functions run), and
how many tokens fit (`capped`: `max_tokens` cut to the room the model's positions
leave, where going past them breaks it). `tokentrail.generate.stream_generate` checks
its arguments with these before generation starts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .engines import Engine
from .prompting import room

__all__ = ["cache_offset", "capped", "check_engine_options", "position_limit", "takes_mlx_options"]


def takes_mlx_options(engine: Engine) -> bool:
    """Whether the engine runs mlx-lm's step functions and so takes their options (an
    engine says so with a true `mlx_options` attribute)."""
    return bool(getattr(engine, "mlx_options", False))


def check_engine_options(
    engine: Engine,
    mlx: bool,
    mlx_options: Mapping[str, Any],
    sampler: Any,
    logits_processors: Any,
    draft_model: Any,
    stream: Any,
    filters: tuple[float, float, int, float],
) -> list[Callable[[Any, Any], Any]] | None:
    """Check the mlx-lm keywords against the engine; return `logits_processors` as a list.

    mlx-lm options on another engine, an unknown step option, a sampler given together
    with temp/top_p/top_k/min_p, or something not callable are errors naming the keyword.
    """
    if not mlx:
        extra = dict(mlx_options, sampler=sampler, logits_processors=logits_processors)
        extra.update(draft_model=draft_model, stream=stream)
        given = sorted(k for k, v in extra.items() if v is not None)
        if given:
            raise TypeError(
                f"{', '.join(given)}: mlx-lm options, which the {engine.name} engine does "
                "not take (they work with MLX models)"
            )
    else:
        from .engines.mlx.steps import STEP_OPTIONS

        unknown = sorted(set(mlx_options) - STEP_OPTIONS)
        if unknown:
            raise TypeError(
                f"stream_generate() got unexpected keyword argument(s) {', '.join(unknown)}; "
                f"mlx-lm's step options are {', '.join(sorted(STEP_OPTIONS))}"
            )
    if sampler is not None:
        if not callable(sampler):
            raise TypeError(f"sampler must be callable, got {type(sampler).__name__}")
        if filters != (0.0, 1.0, 0, 0.0):
            raise ValueError("give either sampler or temp/top_p/top_k/min_p, not both")
    if logits_processors is None:
        return None
    processors = list(logits_processors)
    if not all(callable(p) for p in processors):
        raise TypeError("logits_processors must be a list of callables")
    return processors


def cache_offset(prompt_cache: Any) -> int | None:
    """Tokens already in an mlx-lm prompt cache (0 if it cannot tell; None for a
    rotating cache, which never runs out of room)."""
    try:
        first = prompt_cache[0]
        offset = first.offset
    except (TypeError, IndexError, AttributeError, KeyError):
        return 0
    if "Rotating" in type(first).__name__:
        return None
    return offset if isinstance(offset, int) else 0


#: Names mlx-lm (and Hugging Face) models give a learned table of absolute positions.
_POSITION_TABLES = frozenset(
    {"wpe", "embed_positions", "position_embeddings", "position_embedding", "pos_emb"}
)


def position_limit(engine: Engine, mlx: bool) -> int | None:
    """The most positions the model can take, where going past them breaks it; None when
    nothing does.

    mlx-lm's caches grow as needed and rotary positions have no end, so an MLX model
    runs past `max_position_embeddings` (as `mlx_lm.stream_generate` does) unless it
    looks positions up in a learned table (GPT-2's `wpe`): its size is the limit. Other
    engines' runtimes refuse or fail past their context (llama.cpp's `n_ctx`, vLLM's
    `max_model_len`), so their `context_length` is."""
    if not mlx:
        return engine.context_length
    model = getattr(engine, "model", None)
    named = getattr(model, "named_modules", None)
    if named is None:
        return None
    for name, module in named():
        if name.rsplit(".", 1)[-1] in _POSITION_TABLES and type(module).__name__ == "Embedding":
            return int(module.weight.shape[0])
    return None


def capped(
    engine: Engine, mlx: bool, n_prompt: int, limit: int | None, options: Mapping[str, Any]
) -> int | None:
    """`limit` cut to the room the model's positions leave (no cap with a KV size limit
    or a rotating cache, which never run out of room)."""
    cached = cache_offset(options.get("prompt_cache"))
    if options.get("max_kv_size") is not None or cached is None:
        return limit
    return room(position_limit(engine, mlx), n_prompt, limit, cached)
