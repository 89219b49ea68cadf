"""What the scheduler's loop thread does before its first pass: load the model (given,
from a loader, or `tokentrail.load` on the config's folder), open the engine's batch,
check the calibration against the model, and settle the context one request may hold.

`open_model` returns the `LoadedModel` and the open batch; the scheduler
(`tokentrail.server.scheduler`) wires the batch's hooks to its outbox and runs it.
"""

from __future__ import annotations

import logging
from typing import Any

from ..prompting import eos_ids, vocab_for
from .config import LoadedModel, Loader, ServerConfig

logger = logging.getLogger("tokentrail.server")

__all__ = ["open_model"]


def open_model(
    config: ServerConfig,
    model: Any,
    tokenizer: Any,
    loader: Loader | None,
    capacity: int | None,
) -> tuple[LoadedModel, Any]:
    """(what was loaded, the engine's open batch) for `config`: `model` and `tokenizer`
    as given, else `loader`'s, else `tokentrail.load(config.model_path, ...)`; the batch
    holds `capacity` sequences (None: the engine batch's own capacity)."""
    from .. import generate
    from ..engines import engine_for
    from ..engines.batch import open_batch

    if model is None:
        if loader is not None:
            model, tokenizer = loader()
        else:
            logger.debug("loading model %s", config.model_path or "(built-in demo model)")
            model, tokenizer = generate.load(
                config.model_path, engine=config.engine, **dict(config.load_options)
            )
    engine = engine_for(model)
    vocab = vocab_for(tokenizer)
    options = {}
    if config.prompt_cache_bytes is not None:
        options["prompt_cache_bytes"] = config.prompt_cache_bytes
    batch = open_batch(engine, capacity, **options)
    calibration = None
    if config.calibration is not None:
        from ..calibrate.fingerprint import calibration_for

        calibration = calibration_for(config.calibration, model, tokenizer)
    loaded = LoadedModel(
        model, tokenizer, engine, vocab, eos_ids(tokenizer), type(batch).__name__,
        calibration, _context_length(batch, engine),
    )  # fmt: skip
    return loaded, batch


def _context_length(batch: Any, engine: Any) -> int | None:
    """The most tokens one request may hold: the batch's per-sequence context where it
    has one (a split KV cache), no more than the engine's; else the engine's."""
    context = getattr(batch, "context_length", None)
    if not isinstance(context, int) or context < 1:
        return engine.context_length
    if engine.context_length is not None:
        return min(context, engine.context_length)
    return context
