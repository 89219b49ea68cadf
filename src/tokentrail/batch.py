"""Batched generation: `batch_generate` (like `mlx_lm.batch_generate`) and the streaming
`stream_batch_generate`, with exact token attribution for every sequence.

Both run on the engine's `Batch` (`tokentrail.engines.batch.open_batch`): on MLX that is
mlx-lm's `BatchGenerator` with per-sequence samplers, processors and on-device logprobs
(`tokentrail.engines.mlx.batch`); other engines get a `SerialBatch`. Sequences join the
batch as others finish, so `n` completions per prompt and more prompts than `max_batch`
stream through together. Each sequence has its own `tokentrail.sequence.SequenceState`
(aligner in its prompt's context, stop strings, EOS, token limit).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .engines import engine_for
from .engines.batch import open_batch
from .output.alarm import Alarm, checked_alarm
from .output.processor import OutputProcessor
from .output.vote import EarlyStop, feed_early
from .prompting import aligner_for, eos_ids, prompt_ids, room, stop_matcher
from .sampling import SamplingParams, check_max_tokens, for_choice, make_params
from .segment import Segment
from .sequence import GenerationResponse, SequenceState
from .structure.tool_choice import tools_for

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_BATCH",
    "BatchResponse",
    "Completion",
    "batch_generate",
    "open_sequence",
    "sequence_state",
    "stream_batch_generate",
]

#: Sequences decoded together unless `max_batch` says otherwise: mlx-lm's
#: `BatchGenerator` default, for `batch_generate` and `tokentrail serve` alike.
DEFAULT_MAX_BATCH = 32
_PER_SEQUENCE = (
    "temp", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "logit_bias",
    "top_logprobs",
)


@dataclass
class Completion:
    """One finished sequence: its text, the segments (text with the tokens behind it)
    it streamed, its token ids and their logprobs, and why it ended."""

    prompt_index: int
    text: str
    segments: list[Segment] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop_string: str | None = None
    #: What ended it before the model did ("early_stop"), else None.
    stopped_by: str | None = None
    #: With `tools`: the calls the reply made (`structure.ToolCall`s, with their
    #: fields) and its content around them (`text` keeps the whole reply).
    tool_calls: list[Any] = field(default_factory=list)
    content: str | None = None
    #: With `alarm`: the flagged units (`output.alarm.AlarmHit`s) in order, and
    #: "alarm" when an alarm's "stop" ended the reply.
    alarms: list[Any] = field(default_factory=list)
    stopped_by: str | None = None


@dataclass
class BatchResponse:
    """What `batch_generate` returns: one `Completion` per prompt and choice, in order
    (prompt 0's `n` choices first). `texts`, `token_ids` and `logprobs` are mlx-lm's
    `BatchResponse` fields."""

    completions: list[Completion]

    @property
    def texts(self) -> list[str]:
        return [c.text for c in self.completions]

    @property
    def token_ids(self) -> list[list[int]]:
        return [c.token_ids for c in self.completions]

    @property
    def logprobs(self) -> list[list[float]]:
        return [c.logprobs for c in self.completions]


def _per_prompt(name: str, value: Any, n_prompts: int, nested: bool = False) -> list[Any]:
    """`value` for every prompt: a list is one entry per prompt, anything else is shared.

    For `stop` (`nested`), a list is per prompt only if its entries are lists or None."""
    is_list = isinstance(value, list | tuple)
    if nested:
        is_list = is_list and bool(value) and all(v is None or isinstance(v, list | tuple)
                                                   for v in value)
    if not is_list:
        return [value] * n_prompts
    if len(value) != n_prompts:
        raise ValueError(f"{name} has {len(value)} entries for {n_prompts} prompts")
    return list(value)


@dataclass
class _Job:
    index: int
    choice: int
    ids: list[int]
    params: SamplingParams
    limit: int | None
    stop: Any


def open_sequence(
    batch: Any,
    engine: Any,
    tokenizer: Any,
    ids: list[int],
    params: SamplingParams,
    limit: int | None,
    stop: Any = None,
    *,
    choice: int = 0,
    eos: frozenset[int] | None = None,
    skip_special_tokens: bool = True,
    prefix: Sequence[int] = (),
) -> tuple[int, SequenceState]:
    """Add one sequence to `batch` and return its uid and per-token state.

    `ids` are the prompt's checked token ids (`prompting.prompt_ids`) and `limit` its
    token limit (`prompting.room`). `choice` is the sequence's index among a prompt's
    `n`: with a seed, choice j samples with `seed + j` (`sampling.for_choice`). The
    state (`SequenceState`) has its own aligner continuing the prompt, stop strings,
    EOS (`eos`, default: the tokenizer's) and limit; feed it the batch's steps for `uid`.
    Used by `stream_batch_generate` and the server's scheduler alike.

    `prefix`: reply tokens that are already known (a branch, `tokentrail.branching`): the
    engine reads `ids + prefix` and generates after them, while the state still starts
    after `ids` (feed it the prefix's steps first) and its `limit` counts the prefix.
    """
    engine_limit = None if limit is None else limit - len(prefix)
    uid = batch.add([*ids, *prefix], for_choice(params, choice), engine_limit)
    return uid, sequence_state(engine, tokenizer, ids, limit, stop, eos, skip_special_tokens)


def sequence_state(
    engine: Any,
    tokenizer: Any,
    ids: list[int],
    limit: int | None,
    stop: Any = None,
    eos: frozenset[int] | None = None,
    skip_special_tokens: bool = True,
) -> SequenceState:
    """A fresh `SequenceState` for a reply to prompt `ids` (what `open_sequence` gives
    with its sequence; field retry makes one again each time it goes back)."""
    return SequenceState(
        aligner_for(tokenizer, ids, skip_special_tokens),
        stop_matcher(stop),
        eos_ids(tokenizer) if eos is None else eos,
        len(ids),
        limit,
        engine.vocab_size,
        engine.peak_memory,
    )


def stream_batch_generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Any],
    max_tokens: int | Sequence[int | None] | None = 256,
    *,
    n: int = 1,
    temp: float | Sequence[float] = 0.0,
    top_p: float | Sequence[float] = 1.0,
    top_k: int | Sequence[int] = 0,
    min_p: float | Sequence[float] = 0.0,
    repetition_penalty: float | Sequence[float | None] | None = None,
    seed: int | Sequence[int | None] | None = None,
    logit_bias: Mapping[int, float] | Sequence[Mapping[int, float] | None] | None = None,
    top_logprobs: int | Sequence[int] = 0,
    stop: str | Sequence[str] | Sequence[Sequence[str] | None] | None = None,
    skip_special_tokens: bool = True,
    max_batch: int | None = None,
    prompt_cache_bytes: int | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    tool_parser: str | None = None,
    alarm: Alarm | Mapping[str, Any] | None = None,
    early_stop: bool = False,
) -> Iterator[tuple[int, GenerationResponse]]:
    """Generate from every prompt together; yield `(index, response)` per token.

    `index` is `prompt_index * n + choice`. Each sequence's responses are exactly what
    `stream_generate` would yield for it (text aligned in its prompt's context, tokens,
    logprobs, alternatives, stop strings; its last response has a `finish_reason`).
    On llama.cpp the call's batch splits its KV cache among its sequences, each share
    sized for the longest (a shared cache lets neighbours move a sequence's logprobs and
    even its greedy tokens there; docs/engines.md), and without `max_batch` it runs as
    many at once as such shares fit in the engine's own context.
    Every sampling keyword takes one value for all prompts or a list with one per
    prompt (for `stop`, a list of lists). With `n > 1` and a `seed`, choice j uses
    `seed + j`. `max_batch` sequences decode at once (default: all, up to 32; on
    llama.cpp, see above); the rest join as others finish. `prompt_cache_bytes`
    (default None: no cache) turns on a prompt cache of that many bytes, shared by the
    call's sequences: one that joins after another with a common prefix finished reuses
    its KV cache. `tools`, `tool_choice` and
    `tool_parser` (one set for every prompt; the prompts are chat messages) parse tool
    calls as `stream_generate` does; `alarm` (one for every sequence) flags and stops
    as `stream_generate`'s. `early_stop` (with `n` > 1) stops a choice whose
    running confidence falls below that of its prompt's finished choices
    (`tokentrail.output.vote.EarlyStop`): its last response says "stop" and its
    `output.stopped_by` "early_stop". Arguments are checked before any model work.
    """
    engine = engine_for(model)
    _check_shape(prompts, n, early_stop)
    count = len(prompts)
    settings = {
        "temp": temp, "top_p": top_p, "top_k": top_k, "min_p": min_p,
        "repetition_penalty": repetition_penalty, "seed": seed, "logit_bias": logit_bias,
        "top_logprobs": top_logprobs,
    }
    per = {k: _per_prompt(k, v, count) for k, v in settings.items()}
    limits = [check_max_tokens(m) for m in _per_prompt("max_tokens", max_tokens, count)]
    stops = _per_prompt("stop", stop, count, nested=True)
    constraint, parser = tools_for(tokenizer, tools, tool_choice, tool_parser)
    alarm = checked_alarm(alarm, parser is not None)
    jobs: deque[_Job] = deque()
    for i, prompt in enumerate(prompts):
        ids = prompt_ids(tokenizer, prompt, engine.vocab_size, tools)
        limit = room(engine.context_length, len(ids), limits[i])
        stop_matcher(stops[i])  # checked now
        params = make_params(**{k: per[k][i] for k in _PER_SEQUENCE},
                             vocab_size=engine.vocab_size, constraint=constraint)
        for j in range(n):
            jobs.append(_Job(i * n + j, j, ids, params, limit, stops[i]))
    max_batch, options = _batch_shape(engine, jobs, max_batch, prompt_cache_bytes)
    output = (skip_special_tokens, parser, tools, alarm)
    early = {i * n: EarlyStop(n) for i in range(count)} if early_stop else {}
    return _run(engine, tokenizer, jobs, max_batch, output, options, early)


def _batch_shape(
    engine: Any, jobs: deque[_Job], max_batch: int | None, prompt_cache_bytes: int | None
) -> tuple[int, dict[str, Any]]:
    """How many sequences decode at once, and the options of the call's batch."""
    if max_batch is not None and (
        isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1
    ):
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    # A one-shot call's batch is private and short-lived, so its prompt cache only pays
    # off when asked for (sequences that follow others with a common prefix).
    options: dict[str, Any] = {
        "prompt_cache_bytes": 0 if prompt_cache_bytes is None else prompt_cache_bytes
    }
    # An engine whose batch can lay out its cache so no sequence sees another (llama.cpp:
    # split) is asked to, sized for the longest sequence: each equals its solo run.
    solo = getattr(engine, "solo_batch", None)
    if callable(solo):
        longest = max(len(j.ids) + (j.limit if j.limit is not None else 0) for j in jobs)
        if any(j.limit is None for j in jobs):
            longest = max(longest, engine.context_length or longest)
        max_batch, layout = solo(longest, max_batch, min(len(jobs), DEFAULT_MAX_BATCH))
        options.update(layout)
    elif max_batch is None:
        max_batch = min(len(jobs), DEFAULT_MAX_BATCH)
    return max_batch, options


def _check_shape(prompts: Any, n: Any, early_stop: bool) -> None:
    """TypeError / ValueError unless `prompts` is a non-empty list and `n` (with
    `early_stop`) a count the call can run."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a list of prompts (str, token ids or chat messages)")
    if not prompts:
        raise ValueError("prompts is empty")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if early_stop and n < 2:
        raise ValueError("early_stop needs n > 1 (it compares a prompt's choices)")


def _run(
    engine: Any,
    tokenizer: Any,
    jobs: deque[_Job],
    max_batch: int,
    output: tuple[bool, str | None, Any, Alarm | None],
    options: dict[str, Any],
    early: dict[int, EarlyStop] | None = None,
) -> Iterator[tuple[int, GenerationResponse]]:
    """The batch loop; `output`: (skip_special_tokens, the tool-call parser or None,
    the tools, whose schemas give the calls' arguments their allowed values, the
    alarm); `early`: each prompt's `EarlyStop`, by its first choice's index (none:
    no early stop)."""
    skip_special_tokens, parser, tools, alarm = output
    batch = open_batch(engine, max_batch, **options)
    eos = eos_ids(tokenizer)
    live: dict[int, tuple[_Job, OutputProcessor]] = {}
    try:
        while jobs or live:
            while jobs and len(batch) < max_batch:
                job = jobs.popleft()
                uid, seq = open_sequence(
                    batch, engine, tokenizer, job.ids, job.params, job.limit, job.stop,
                    choice=job.choice, eos=eos, skip_special_tokens=skip_special_tokens,
                )
                out = OutputProcessor(seq, tool_parser=parser, tools=tools, alarm=alarm)
                live[uid] = (job, out)
            for uid, step in batch.step():
                entry = live.get(uid)
                if entry is None:
                    continue
                job, seq = entry
                stop = early.get(job.index - job.choice) if early else None
                record = seq.feed(step) if stop is None else feed_early(stop, job.choice, seq, step)
                response = GenerationResponse.of(record, step.logprobs)
                if seq.done:
                    del live[uid]
                    batch.remove(uid)
                yield job.index, response
            if live and len(batch) == 0:
                raise RuntimeError(
                    f"the {engine.name} engine's batch dropped {len(live)} sequence(s) "
                    "before EOS or their token limit"
                )
    finally:
        batch.close()


def batch_generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Any],
    max_tokens: int | Sequence[int | None] | None = 128,
    **kwargs: Any,
) -> BatchResponse:
    """Generate for every prompt together (like `mlx_lm.batch_generate`); return one
    `Completion` per prompt and choice with its text, segments, token ids and logprobs.

    Takes `stream_batch_generate`'s keywords (`n`, sampling settings per prompt,
    `top_logprobs`, `stop`, `max_batch`, `prompt_cache_bytes`, ...). EOS ends a
    completion and is not part of its tokens, as in mlx-lm."""
    stream = stream_batch_generate(model, tokenizer, prompts, max_tokens, **kwargs)
    n = kwargs.get("n", 1)
    out = [Completion(i // n, "") for i in range(len(prompts) * n)]
    texts: list[list[str]] = [[] for _ in out]
    eos = eos_ids(tokenizer)
    for index, r in stream:
        c = out[index]
        if r.text or r.last_segment_tokens:
            texts[index].append(r.text)
            c.segments.append(Segment(r.text, tuple(r.last_segment_tokens)))
        if not (r.finish_reason == "stop" and r.token in eos and r.stop_string is None):
            c.token_ids.append(r.token)
            c.logprobs.append(r.token_logprob)
        c.alarms += r.alarms
        if r.finish_reason is not None:
            c.finish_reason = r.finish_reason
            c.stopped_by = r.stopped_by
            c.stop_string = r.stop_string
            c.stopped_by = None if r.output is None else r.output.stopped_by
            c.tool_calls = r.all_tool_calls or []
            if r.all_tool_calls is not None:
                c.content = r.content
    for c, parts in zip(out, texts, strict=True):
        c.text = "".join(parts)
    return BatchResponse(out)
