"""The engine protocol: the one thing `stream_generate` needs from a model runtime.

An engine turns prompt ids into a stream of `Step`s: the sampled token, its logprob,
the top-k alternatives and the full logprob vector, computed on the engine's device.
Everything above it (alignment, stop strings, responses) is shared by all engines.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..errors import EngineError
from ..prompting import check_ids
from ..sampling import SamplingParams

__all__ = [
    "Engine",
    "EngineError",
    "RewindableBase",
    "RewindableSteps",
    "Row",
    "Step",
    "check_generate_args",
    "read_model_config",
    "rewinder",
]


#: The distributions a step's logprobs may come from (`Step.distribution`).
DISTRIBUTIONS = ("raw", "processed", "masked")


#: One position of a sequence scored teacher-forced (`engines.scoring.position_logprobs`):
#: the logprob of the token there and the k most likely (id, logprob), most likely first.
Row = tuple[float, list[tuple[int, float]]]


@dataclass(slots=True)
class Step:
    """One generated token.

    `logprob` is log p(token) under the engine's distribution for this step (after
    logits processors such as repetition penalty and logit bias, before temperature
    and the top-p/top-k/min-p filters, as in mlx-lm). `top_logprobs` holds the k most
    likely (id, logprob) pairs, most likely first. `logprobs` is the full vector in the
    engine's native array type. `from_draft` says a draft model proposed the token and
    the target model accepted it (speculative decoding).

    Provenance, for constrained decoding (`SamplingParams.constraint`) and
    `SamplingParams.logprobs_mode`: `distribution` names the distribution `logprob` and
    `top_logprobs` come from: "raw" (the one described above: the model's own, before
    the grammar mask), "processed" (the one the token was drawn from: after the mask,
    the top-p/min-p/top-k filters and temperature) or "masked" (a runtime that applies
    the grammar mask before it reports anything, as vLLM does: the model's own
    renormalised over the tokens the grammar allows, before temperature and the
    filters; `allowed_mass` is then unknown). `logprobs` stays the raw vector.
    `allowed_mass` is the raw probability of all the tokens the grammar allowed at this
    step (None without a constraint): near 1 where model and schema agree, small where
    the schema forces the model off its own choice.
    """

    token: int
    logprob: float
    top_logprobs: list[tuple[int, float]]
    logprobs: Any
    from_draft: bool = False
    distribution: str = "raw"  # "raw", "processed" or "masked"
    allowed_mass: float | None = None


@runtime_checkable
class Engine(Protocol):
    """A model runtime that generates tokens.

    `vocab_size` is the number of ids the model can read and emit (None if unknown);
    `context_length` is the longest sequence it supports (None if unknown).

    An engine whose `generate` also takes mlx-lm's step keywords (`**options`, as
    `MLXEngine` does) says so with a class attribute ``mlx_options = True``; test it
    with ``getattr(engine, "mlx_options", False)`` (it is not a required member).
    """

    name: str
    vocab_size: int | None
    context_length: int | None

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None
    ) -> Iterator[Step]:
        """Yield one Step per generated token: exactly `max_tokens` of them (None:
        without end) unless the consumer stops first. The caller, not the engine,
        watches for EOS and stop strings.

        Closing the iterator stops generation: no model step is started after that.
        """
        ...

    def peak_memory(self) -> float:
        """Peak device memory in use so far, in GB (0.0 if the engine cannot tell)."""
        ...


class RewindableSteps(Protocol):
    """A step stream that can take tokens back (field retry, issue #31).

    An engine offers one with a method ``generate_rewindable(prompt_ids, params,
    max_tokens, **options)`` (not a required member of `Engine`: find it with
    `rewinder`). Besides yielding `Step`s as `Engine.generate` does:

    - `rewind(n)` takes back the last `n` generated tokens: the KV cache, the grammar's
      state (`constrain.guide.Guide.rollback`) and the ids are as they were before them,
      so the next step samples where the first of them stood;
    - `force(ids)` appends tokens as if they had been sampled, yielding no step (the
      cache and the grammar move past them), to restore an earlier attempt;
    - `temperature` can be set between steps (None: the request's own again);
    - `generated` is how many generated tokens stand now; `close()` ends it.
    """

    generated: int
    temperature: float | None

    def __iter__(self) -> Iterator[Step]: ...

    def __next__(self) -> Step: ...

    def rewind(self, n: int) -> None: ...

    def force(self, ids: Sequence[int]) -> None: ...

    def close(self) -> None: ...


class RewindableBase:
    """What every `RewindableSteps` shares: the ids standing (`ids`: the prompt, then
    each token generated and not taken back), the token limit, the temperature (the
    request's own `params.temp` unless set), and `_check_rewind`."""

    def __init__(self, ids: Sequence[int], params: SamplingParams, max_tokens: int | None) -> None:
        self.params = params
        self.ids = list(ids)
        self.n_prompt = len(self.ids)
        self.limit = max_tokens
        self.temp = params.temp

    @property
    def generated(self) -> int:
        """How many generated tokens stand now."""
        return len(self.ids) - self.n_prompt

    @property
    def temperature(self) -> float:
        return self.temp

    @temperature.setter
    def temperature(self, value: float | None) -> None:
        self.temp = self.params.temp if value is None else float(value)

    def __iter__(self) -> Any:
        return self

    def _exhausted(self) -> bool:
        return self.limit is not None and self.generated >= self.limit

    def _check_rewind(self, n: int) -> None:
        if n < 0 or n > self.generated:
            raise ValueError(f"cannot rewind {n} tokens: {self.generated} were generated")


def rewinder(engine: Any) -> Any:
    """The engine's ``generate_rewindable`` method (see `RewindableSteps`), or None when
    it cannot take tokens back."""
    return getattr(engine, "generate_rewindable", None)


def read_model_config(p: Path) -> dict[str, Any]:
    """Check that `p` is a Hugging Face-layout model folder; return its config.json.

    Raises FileNotFoundError or ValueError naming what is missing or unreadable, so
    every engine reports a bad model path the same way.
    """
    if not p.is_dir():
        raise ValueError(f"model path must be a folder with config.json and weights, got file {p}")
    config_file = p / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in model folder {p}")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {config_file}: {e}") from e
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"{config_file} has no model_type; is this a Hugging Face model folder?")
    return config


def check_generate_args(
    prompt_ids: Sequence[Any], params: Any, max_tokens: Any, vocab_size: int | None
) -> list[int]:
    """Validate `Engine.generate`'s arguments (for engines called directly, without
    `stream_generate`); return the prompt ids as a list. Errors name the argument."""
    ids = check_ids(prompt_ids, vocab_size, "prompt_ids")
    if not ids:
        raise ValueError("prompt_ids is empty; the model needs at least one token")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise ValueError(f"max_tokens must be None or an int >= 1, got {max_tokens!r}")
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a tokentrail SamplingParams, got {type(params).__name__}")
    return ids
