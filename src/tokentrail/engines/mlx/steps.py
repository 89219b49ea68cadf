"""tokentrail's steps on mlx-lm's own step functions (`generate_step`,
`speculative_generate_step`), with each token's logprob and top-k computed on the device.

Rather than re-implementing mlx-lm's loop, `mlx.steps` runs it as is and wraps its
sampler: the wrapped sampler's graph also computes the sampled token's logprob and (when
asked) the top-k alternatives from the very `logprobs` mlx-lm hands it, so they come
out of the same lazy graph as the token. On the plain path they are scheduled with
`mx.async_eval` inside that step, so they overlap the device's work exactly as mlx-lm's
token does; with a draft model (whose loop evaluates synchronously once per round) they
are read with one small evaluation per round. Every other mlx-lm option (prompt cache,
KV quantization, rotating caches, processors, input embeddings, progress callbacks)
keeps its mlx-lm meaning because mlx-lm itself implements it.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx

from ..base import Step
from .guided import read_masses, shown_top
from .sampling import Recorder, Row, read_rows

log = logging.getLogger(__name__)

# `Recorder` and `read_rows` live in `mlx.sampling`; importable from here as before, and
# so is STEP_OPTIONS (the value of `step_options()`, made on first use by `__getattr__`).
__all__ = ["mlx_steps", "speculative_options", "step_options"]

_OWN = {"prompt", "model", "draft_model", "stream", "max_tokens"}


@functools.cache
def step_options() -> frozenset[str]:
    """The keyword options of mlx-lm's `generate_step` and `speculative_generate_step`
    (as installed), which `stream_generate` passes through unchanged. Read from their
    signatures on first use (importing `mlx_lm.generate`), then kept."""
    from mlx_lm.generate import generate_step

    return frozenset(set(inspect.signature(generate_step).parameters) - _OWN) | (
        speculative_options()
    )


@functools.cache
def speculative_options() -> frozenset[str]:
    """The keyword options of mlx-lm's `speculative_generate_step` (as installed)."""
    from mlx_lm.generate import speculative_generate_step

    return frozenset(set(inspect.signature(speculative_generate_step).parameters) - _OWN)


def __getattr__(name: str) -> Any:
    # STEP_OPTIONS (the same as `step_options()`) is computed when first asked for, not
    # at import: reading it imports mlx-lm's generate module.
    if name == "STEP_OPTIONS":
        return step_options()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _mismatch(got: int, want: int) -> RuntimeError:
    return RuntimeError(
        f"mlx-lm yielded token {got} but its sampler produced {want}: this mlx-lm version "
        "calls the sampler differently from the one tokentrail was built against"
    )


def mlx_steps(
    model: Any,
    prompt_ids: Sequence[int],
    sampler: Callable[[mx.array], mx.array],
    k: int,
    max_tokens: int | None,
    draft_model: Any = None,
    stream: Any = None,
    **options: Any,
) -> Iterator[Step]:
    """Yield a `Step` per token from mlx-lm's own `generate_step` (or, with
    `draft_model`, `speculative_generate_step`), with `from_draft` set.

    `options` are mlx-lm's step keywords, passed unchanged (see `STEP_OPTIONS`); as in
    `mlx_lm.stream_generate`, those speculative decoding does not take
    (`max_kv_size`, `prompt_progress_callback`) are dropped with a draft model, and
    `num_draft_tokens` without one. `max_tokens=None` generates without end.
    A `sampler` that is already a `Recorder` (e.g. `mlx.guided.GuidedRecorder`, for
    constrained decoding) records the steps itself; its `distribution` and recorded
    allowed mass go onto each Step.
    """
    from mlx_lm.generate import (
        generate_step,
        generation_stream,
        speculative_generate_step,
        wired_limit,
    )

    stream = generation_stream if stream is None else stream
    prompt = mx.array(list(prompt_ids), dtype=mx.uint32 if draft_model is not None else None)
    limit = -1 if max_tokens is None else max_tokens
    if draft_model is None:
        options.pop("num_draft_tokens", None)
        rec = sampler if isinstance(sampler, Recorder) else Recorder(sampler, k, schedule=True)
        gen = generate_step(prompt, model, stream, max_tokens=limit, sampler=rec, **options)
    else:
        options.pop("max_kv_size", None)
        options.pop("prompt_progress_callback", None)
        if options.pop("input_embeddings", None) is not None:
            raise ValueError("speculative decoding (draft_model) does not take input_embeddings")
        spec = speculative_options()
        unknown = sorted(set(options) - spec)
        if unknown:
            raise TypeError(f"speculative decoding does not take {', '.join(unknown)}")
        rec = Recorder(sampler, k, schedule=False)
        gen = speculative_generate_step(
            prompt, model, draft_model, stream, max_tokens=limit, sampler=rec, **options
        )
    with wired_limit(model, [stream]):
        try:
            if draft_model is None:
                yield from _plain(gen, rec, k)
            else:
                yield from _speculative(gen, rec, k, bool(options.get("logits_processors")))
        finally:
            gen.close()


def _plain(gen: Iterator[Any], rec: Recorder, k: int) -> Iterator[Step]:
    calls = rec.calls
    distribution = getattr(rec, "distribution", "raw")
    for token, logprobs in gen:
        call = calls.popleft()
        ((want, lp, top),) = read_rows(call, k)
        if want != token:
            raise _mismatch(token, want)
        (mass,) = read_masses(call, k)
        yield Step(token, lp, shown_top(top, distribution), logprobs, False, distribution, mass)


def _speculative(gen: Iterator[Any], rec: Recorder, k: int, processed: bool) -> Iterator[Step]:
    # Each round drafts K tokens (K sampler calls on the draft model), then verifies
    # them with one call on the target model (K + 1 rows), or, with logits processors,
    # K + 1 one-row calls. The yields of a round are rows 0, 1, ... of those calls.
    calls = rec.calls
    rows: list[Row] = []
    row = 0
    for token, logprobs, from_draft in gen:
        if calls:
            made = list(calls)
            calls.clear()
            target = made[-((len(made) + 1) // 2) :] if processed else made[-1:]
            flat = [a for call in target for a in call]
            mx.eval(*flat)  # one small evaluation per round; the logprobs are ready
            rows = [r for call in target for r in read_rows(call, k)]
            row = 0
        want, lp, top = rows[row]
        row += 1
        if want != token:
            raise _mismatch(token, want)
        yield Step(int(token), lp, top, logprobs, bool(from_draft))
