"""`load` and `stream_generate`: mlx-lm's streaming API, with every piece of text
carrying the exact tokens behind it, their logprobs, alternatives and a confidence.

On MLX, generation is mlx-lm's own `generate_step` / `speculative_generate_step` (see
`tokentrail.engines.mlx.steps`), so every mlx-lm option keeps its meaning; other engines
(torch, vLLM) yield `Step`s through the `Engine` protocol. Either way each step goes
through the sequence's output stage (`tokentrail.output.processor.OutputProcessor`:
aligner, stop strings, EOS, then any structure asked for) and becomes one
`GenerationResponse`. Text is aligned in the prompt's context, so it is exactly what the
continuation adds to the prompt's decoded text (or, with `align_to_prompt=False`, the
reply's own text, as mlx-lm's detokenizer gives it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .branching import BranchSpec, ReplyMemory, check_branch, plan_branch
from .detokenizer import mlx_lm_drops_first_space
from .engine_fit import capped, check_engine_options, takes_mlx_options
from .engines import Engine, engine_for, load_model
from .engines.base import Step, rewinder
from .errors import BranchError
from .output.alarm import Alarm, checked_alarm
from .output.processor import OutputProcessor
from .output.retry import FieldRetry, RetryPolicy, retry_policy
from .prompting import aligner_for, eos_ids, prompt_ids, stop_matcher, vocab_for
from .sampling import SamplingParams, check_max_tokens, make_params
from .sequence import GenerationResponse, SequenceState
from .structure.reasoning import ReasoningFormat, reasoning_format
from .structure.tool_choice import tools_for

if TYPE_CHECKING:
    from .constrain import Constraint

log = logging.getLogger(__name__)

#: The built-in demo model shipped as package data.
DEMO_MODEL = Path(__file__).resolve().parent / "demo_model"

__all__ = ["DEMO_MODEL", "GenerationResponse", "aligner_for", "load", "stream_generate"]


def load(
    path: str | os.PathLike[str] | None = None, *, engine: str = "mlx", **options: Any
) -> tuple[Any, Any]:
    """Load a model folder (Hugging Face layout) and its tokenizer with `engine`.

    `path=None` loads the built-in demo model. `engine` is "mlx" (default), "torch" or
    "vllm"; `options` go to that engine's loader (e.g. `device`, `dtype` for torch).
    Returns (model, tokenizer), ready for `stream_generate`.
    """
    if path is None:
        if not (DEMO_MODEL / "config.json").is_file():
            raise FileNotFoundError(
                f"the built-in demo model is missing from {DEMO_MODEL}; pass a model folder"
            )
        path = DEMO_MODEL
    model, tokenizer = load_model(path, engine=engine, **options)
    vocab_for(tokenizer)  # compile the tokenizer now, not on the first generation
    return model, tokenizer


# The signature and docstring are the public contract: mlx-lm's arguments, then
# long: tokentrail's keywords, each explained; the body itself is about 30 lines.
def stream_generate(
    model: Any,
    tokenizer: Any,
    prompt: str | Sequence[int] | Sequence[Mapping[str, Any]] | Any,
    max_tokens: int | None = 256,
    draft_model: Any = None,
    stream: Any = None,
    *,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float | None = None,
    seed: int | None = None,
    logit_bias: Mapping[int, float] | None = None,
    top_logprobs: int = 0,
    stop: str | Sequence[str] | None = None,
    skip_special_tokens: bool = True,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    sampler: Callable[[Any], Any] | None = None,
    logits_processors: Sequence[Callable[[Any, Any], Any]] | None = None,
    align_to_prompt: bool = True,
    whole_tokens: bool = False,
    cap_to_context: bool = True,
    reasoning: str | tuple[str, str] | ReasoningFormat | None = None,
    fields: bool = False,
    json_schema: Mapping[str, Any] | str | None = None,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
    logprobs_mode: str = "raw",
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    tool_parser: str | None = None,
    calibration: Any = None,
    alarm: Alarm | Mapping[str, Any] | None = None,
    branch: Mapping[str, Any] | None = None,
    retry: Any = None,
    **mlx_options: Any,
) -> Iterator[GenerationResponse]:
    """Generate from `prompt`, one `GenerationResponse` per token; the last has
    `finish_reason` "stop" (EOS or a stop string) or "length".

    The first six arguments are `mlx_lm.stream_generate`'s, in its order. On MLX every
    option of mlx-lm's `generate_step` / `speculative_generate_step` is taken with
    mlx-lm's meaning and passed to them unchanged (`sampler`, `logits_processors`,
    `prompt_cache` (updated in place), `max_kv_size`, `kv_bits`, `kv_group_size`,
    `quantized_kv_start`, `prefill_step_size`, `prompt_progress_callback`,
    `input_embeddings`, `num_draft_tokens`, ...), so for the same inputs and seed the
    tokens and `from_draft` flags are mlx-lm's. tokentrail's own keywords: `temp`,
    `top_p`, `top_k`, `min_p` build an mlx-lm sampler (give those or `sampler`, not
    both); `repetition_penalty`, `presence_penalty`, `frequency_penalty` (OpenAI's,
    over the engine's window of recent tokens: `SamplingParams`) and `logit_bias` add
    mlx-lm processors after `logits_processors`; `seed` seeds MLX's generator when
    generation starts; `top_logprobs` (0..20) alternatives per token; `stop` strings;
    `skip_special_tokens`.

    `prompt` is text, token ids, or chat messages (rendered with the tokenizer's chat
    template and a generation prompt). `max_tokens=None` (or -1) generates until EOS or
    the model's context is full. `align_to_prompt`: the texts are what the ids add to the
    prompt's decoded text; False: the reply's own text as mlx-lm's detokenizer gives it.
    `whole_tokens`: each token listed once, in the response that completes it.
    `cap_to_context`: where the model fails past its positions (`engine_fit.position_limit`),
    `max_tokens` is cut to the room left, ending with "length"; False turns that off.
    `reasoning` (a `structure.REASONING_PARSERS` name, (START, END), a `ReasoningFormat`)
    and `fields=True` add channels and JSON fields (`output.processor`). `json_schema`,
    `regex`, `choice` or `grammar` constrain the output through llguidance
    (`tokentrail.constrain`; a JSON schema turns `fields` on; with `reasoning`, the
    content after the reasoning, as in vLLM); `logprobs_mode` "raw" (the
    model's own distribution, before the mask) or "processed" (what the token was drawn
    from; vLLM, which masks before any logprobs, reports "masked" under a constraint:
    each response's `output.distribution`). `calibration` (a
    `tokentrail.calibrate.Calibration` or its file, refused for another model by
    fingerprint) sets `confidence.calibrated`, and `level` follows
    it. `alarm` (an `output.alarm.Alarm` or a mapping: `{"below": P, "on": "segment" |
    "field" | "both", "action": "flag" | "stop"}`) lists the segments / JSON fields whose
    confidence is below P on the response that completes them (`alarms`); "stop" ends
    generation right after the first (`stopped_by` "alarm").
    `branch` (``{"ids": [...], "at": N, "token": ID}``, `tokentrail.branching`)
    continues an earlier reply `ids` of this prompt: its first N tokens are re-emitted
    with their logprobs from one forward pass (MLX, torch), ID is forced at N (left out:
    sampled there), and generation goes on after it; `max_tokens` counts the kept tokens.
    `retry` (a `tokentrail.output.retry.RetryPolicy` or {"below", "max",
    "temperature"}), with a JSON constraint, samples again each leaf whose confidence is
    below `below` and keeps the most confident attempt (`output.retry`; the field's
    `attempts` list them). Arguments are checked here; generation starts on the first
    `next()`.
    """
    engine = engine_for(model)
    limit = check_max_tokens(max_tokens)
    constraint = _constraint(tokenizer, json_schema, regex, choice, grammar)
    fields = fields or (constraint is not None and constraint.kind == "json_schema")
    constraint, parser = tools_for(tokenizer, tools, tool_choice, tool_parser, constraint)
    fmt = _structure_format(reasoning, fields or parser is not None, whole_tokens)
    alarm = checked_alarm(alarm, fields or parser is not None)
    if constraint is not None and fmt is not None:  # the content after the reasoning
        constraint = constraint.after_reasoning(fmt.constraint_after)
    mlx = takes_mlx_options(engine)
    logits_processors = check_engine_options(
        engine, mlx, mlx_options, sampler, logits_processors, draft_model, stream,
        (temp, top_p, top_k, min_p),
    )
    params = make_params(
        temp=temp, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty, logit_bias=logit_bias, seed=seed,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        top_logprobs=top_logprobs, vocab_size=engine.vocab_size, constraint=constraint,
        logprobs_mode=logprobs_mode,
    )
    ids, n_prompt = _prompt(engine, tokenizer, prompt, mlx_options, tools)
    if cap_to_context:
        limit = capped(engine, mlx, n_prompt, limit, mlx_options)
    def seq() -> SequenceState:
        return _sequence(
            engine, tokenizer, ids, n_prompt, limit, stop, align_to_prompt,
            skip_special_tokens, whole_tokens,
        )

    replay, engine_ids, engine_limit = [], ids, limit
    if branch is not None:
        if retry is not None:
            raise BranchError("branch cannot be combined with retry yet", "branch")
        replay, engine_ids, engine_limit = _branch(
            engine, tokenizer, branch, ids, params, limit, mlx_options
        )
    if retry is None:
        steps = _steps(
            engine, mlx, engine_ids, params, engine_limit,
            (draft_model, stream, sampler, logits_processors), mlx_options,
        )  # fmt: skip
        if replay:
            steps = _replayed(replay, steps)
    else:
        retry = retry_policy(retry)
        steps = _rewindable(engine, ids, params, limit, (draft_model, sampler),
                            dict(mlx_options, logits_processors=logits_processors))
    schema = json_schema if isinstance(json_schema, Mapping) else None
    if calibration is not None:
        from .calibrate.fingerprint import calibration_for

        calibration = calibration_for(calibration, model, tokenizer)
    return _structured(
        engine, tokenizer, ids, (fmt, fields, schema, parser, tools, calibration, alarm),
        mlx_options, seq, steps, retry,
    )  # fmt: skip


def _branch(
    engine: Any,
    tokenizer: Any,
    branch: Mapping[str, Any],
    ids: list[int],
    params: SamplingParams,
    limit: int | None,
    options: Mapping[str, Any],
) -> tuple[list[Step], list[int], int | None]:
    """A checked branch: the replayed steps, the engine's prompt and its token limit
    (`tokentrail.branching`); `BranchError` (a ValueError) naming the key otherwise."""
    spec = BranchSpec.of(branch)
    if params.constraint is not None:
        raise BranchError("branch cannot be combined with a constraint yet", "branch")
    if options.get("input_embeddings") is not None or not ids:
        raise BranchError("branch needs the prompt's token ids, not input_embeddings", "branch")
    bos = getattr(tokenizer, "bos_token_id", None)
    check_branch(spec, vocab_for(tokenizer), engine.vocab_size, eos_ids(tokenizer), bos)
    kept = spec.at + (spec.token is not None)
    if limit is not None and limit <= kept:
        raise BranchError(
            f"max_tokens ({limit}) counts the kept prefix and the forced token ({kept} "
            "tokens) and must leave room for at least one more",
            "max_tokens",
        )
    plan = plan_branch(spec, ids, params, engine, ReplyMemory())
    return plan.replay, plan.engine_ids, None if limit is None else limit - kept


def _replayed(replay: list[Step], steps: Iterator[Step]) -> Iterator[Step]:
    """The replayed steps, then the engine's (closed with this iterator)."""
    try:
        yield from replay
        yield from steps
    finally:
        close = getattr(steps, "close", None)
        if close is not None:
            close()


def _constraint(
    tokenizer: Any,
    json_schema: Mapping[str, Any] | str | None,
    regex: str | None,
    choice: Sequence[str] | None,
    grammar: str | None,
) -> Constraint | None:
    """The constraint the keywords ask for, bound to `tokenizer` (None: unconstrained).
    A spec llguidance cannot compile is a `ConstraintError` naming the keyword."""
    if json_schema is None and regex is None and choice is None and grammar is None:
        return None
    from .constrain import constraint_from

    given = [k for k, v in (("json_schema", json_schema), ("regex", regex), ("choice", choice),
                            ("grammar", grammar)) if v is not None]  # fmt: skip
    if len(given) > 1:
        raise ValueError(f"give one constraint, not {' and '.join(given)}")
    if isinstance(json_schema, str):
        import json

        try:
            json_schema = json.loads(json_schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not JSON: {e}") from None
    spec = constraint_from(
        json_schema=json_schema, regex=regex, choice=list(choice) if choice else choice,
        grammar=grammar, param=given[0],
    )
    return None if spec is None else spec.bind(tokenizer)


def _sequence(
    engine: Engine,
    tokenizer: Any,
    ids: list[int],
    n_prompt: int,
    limit: int | None,
    stop: Any,
    align_to_prompt: bool,
    skip_special_tokens: bool,
    whole_tokens: bool,
) -> SequenceState:
    """The sequence's state: aligner (in the prompt's context or not), stops, EOS."""
    aligner = aligner_for(tokenizer, ids if align_to_prompt else None, skip_special_tokens)
    return SequenceState(
        aligner, stop_matcher(stop), eos_ids(tokenizer), n_prompt, limit, engine.vocab_size,
        engine.peak_memory, whole_tokens=whole_tokens,
        drop_first_space=not align_to_prompt and mlx_lm_drops_first_space(tokenizer),
    )


def _structure_format(
    reasoning: str | tuple[str, str] | ReasoningFormat | None,
    fields: bool,
    whole_tokens: bool,
) -> ReasoningFormat | None:
    """The checked reasoning format (None: no reasoning split)."""
    if not isinstance(fields, bool):
        raise TypeError(f"fields must be True or False, got {fields!r}")
    if whole_tokens and (reasoning is not None or fields):
        raise ValueError(
            "reasoning, fields and tools need each token's byte ranges: whole_tokens=False"
        )
    return None if reasoning is None else reasoning_format(reasoning)


def _structured(
    engine: Engine,
    tokenizer: Any,
    ids: list[int],
    structure: tuple[
        ReasoningFormat | None, bool, Mapping[str, Any] | None, str | None, Any, Any,
        Alarm | None,
    ],
    options: Mapping[str, Any],
    seq: Callable[[], SequenceState],
    steps: Iterator[Step],
    retry: RetryPolicy | None = None,
) -> Iterator[GenerationResponse]:
    """The responses of `steps` through the sequence's output stage
    (`output.processor.OutputProcessor`): channels, tool calls, fields with a scorer,
    then the calibration and the alarm (each only when asked for).

    A constraint (`tokentrail.constrain`, a JSON schema or choices) passes its schema
    here, so fields get its allowed values, and starts its mask once the reply leaves
    the reasoning.
    """
    fmt, fields, schema, parser, tools, calibration, alarm = structure
    output_ids: list[int] = []
    scorer = None
    if fields or parser is not None:  # tool calls' arguments get alternatives too
        from .engines.scoring import scorer_for

        scorer, why = scorer_for(engine, tokenizer, ids, output_ids, dict(options))
        if scorer is None:
            log.info("fields without alternatives: %s", why)

    def make() -> OutputProcessor:
        return OutputProcessor(
            seq(), reasoning=fmt, tool_parser=parser, tools=tools, fields=fields, scorer=scorer,
            output_ids=output_ids, schema=schema, calibration=calibration, alarm=alarm,
        )  # fmt: skip

    if retry is not None:
        return _run_retry(FieldRetry(steps, make, retry), steps, engine.name)
    return _run(make(), steps, engine.name)


def _prompt(
    engine: Engine,
    tokenizer: Any,
    prompt: Any,
    mlx_options: Mapping[str, Any],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[list[int], int]:
    """The prompt's checked ids and its length (that of `input_embeddings` given alone)."""
    embeddings = mlx_options.get("input_embeddings")
    if embeddings is not None and _empty(prompt):
        return [], len(embeddings)
    ids = prompt_ids(tokenizer, prompt, engine.vocab_size, tools)
    return ids, len(ids)


def _empty(prompt: Any) -> bool:
    try:
        return len(prompt) == 0
    except TypeError:
        return False


def _steps(
    engine: Any,
    mlx: bool,
    ids: list[int],
    params: SamplingParams,
    limit: int | None,
    mlx_args: tuple[Any, Any, Any, Any],
    options: dict[str, Any],
) -> Iterator[Step]:
    """The engine's steps; on MLX, mlx-lm's step functions with (draft model, stream,
    sampler, processors) `mlx_args` and the step `options`."""
    if mlx:
        return _mlx_steps(engine, ids, params, limit, *mlx_args, options)
    return engine.generate(ids, params, limit)


def _mlx_steps(
    engine: Any,
    ids: list[int],
    params: SamplingParams,
    limit: int | None,
    draft_model: Any,
    stream: Any,
    sampler: Callable[[Any], Any] | None,
    processors: list[Callable[[Any, Any], Any]] | None,
    options: dict[str, Any],
) -> Iterator[Step]:
    from .engines.mlx.guided import guided_recorder
    from .engines.mlx.sampling import sampling_for
    from .engines.mlx.steps import mlx_steps

    own_sampler, own_processors = sampling_for(params, engine.vocab_size)
    guided = guided_recorder(params, engine.vocab_size, params.top_logprobs)
    if guided is not None:
        if sampler is not None or draft_model is not None:
            raise ValueError(
                "a constraint (or logprobs_mode='processed') takes the place of the sampler: "
                "give it without sampler and draft_model"
            )
        own_sampler = guided
    processors = [*(processors or []), *own_processors]
    options = dict(options, logits_processors=processors or None)
    if params.seed is not None:
        import mlx.core as mx

        mx.random.seed(params.seed)
    yield from mlx_steps(
        engine.model, ids, sampler or own_sampler, params.top_logprobs, limit,
        draft_model, stream, **options,
    )


def _rewindable(
    engine: Any,
    ids: list[int],
    params: SamplingParams,
    limit: int | None,
    refused: tuple[Any, Any],
    options: dict[str, Any],
) -> Any:
    """The engine's rewindable steps for field retry (`engines.base.RewindableSteps`);
    ValueError where retry cannot run: no JSON constraint, an engine that cannot take
    tokens back, a draft model or a sampler of the caller's."""
    kind = None if params.constraint is None else params.constraint.kind
    if kind not in ("json_schema", "json_object"):
        raise ValueError("retry needs a JSON constraint: give json_schema")
    make = rewinder(engine)
    if make is None:
        raise ValueError(f"retry: the {engine.name} engine cannot take tokens back")
    if any(a is not None for a in refused):
        raise ValueError("retry does not take a draft_model or a sampler")
    if not getattr(engine, "mlx_options", False):
        options = {}
    return make(ids, params, limit, **options)


def _run_retry(
    retry: FieldRetry, steps: Any, name: str
) -> Iterator[GenerationResponse]:
    try:
        for out, logprobs in retry:
            yield GenerationResponse.of(out, logprobs)
        if not retry.done:
            raise RuntimeError(f"the {name} engine stopped before EOS or the token limit")
    finally:
        steps.close()


def _run(
    processor: OutputProcessor, steps: Iterator[Step], name: str
) -> Iterator[GenerationResponse]:
    try:
        for step in steps:
            yield GenerationResponse.of(processor.feed(step), step.logprobs)
            if processor.done:
                return
        raise RuntimeError(
            f"the {name} engine stopped before EOS or the token limit; engines must "
            "yield a step for every token up to max_tokens"
        )
    finally:
        close = getattr(steps, "close", None)
        if close is not None:
            close()
