"""One generated sequence, token by token: engine `Step`s in, `GenerationResponse`s out.

Shared by `stream_generate` (one sequence) and the batched generators (many): each
step goes through the `Aligner` (text and token attribution), then the `StopMatcher`
(stop strings), EOS and the token limit, and becomes one `GenerationResponse`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .align import Aligner
from .engines.base import Step
from .output.record import TokenOutput
from .segment import Alternative, Confidence, Segment, TokenSpan, confidence_of
from .stops import StopMatcher, WholeTokens, drop_first_space, merge_spans

__all__ = ["GenerationResponse", "SequenceState"]


@dataclass(slots=True)
class GenerationResponse:
    """One generated token and the text that became final with it.

    The first ten fields mean what they mean in mlx-lm's `GenerationResponse`. The rest
    say where `text` came from: `last_segment_tokens` are the tokens (with the byte
    range of each that went into `text`) behind it, `confidence` aggregates their
    logprobs, `token_logprob` and `top_logprobs` describe this step's token, and, when a
    stop string ended generation (on the final response only), `stop_string` names it
    and `stop_tokens` are the spans that carried it: from its first byte to the end of
    what was generated (an EOS right after it included), none of them in `text`.

    It is a view of `output` (the step's `tokentrail.output.record.TokenOutput`), built
    once and never changed. With `stream_generate(..., reasoning=...)`, `fields=True`
    and/or `tools=...` the structure properties read it (`tokentrail.output.processor`
    says what each holds): `channel`, `channels` (`ChannelSegment`s final at this step),
    `reasoning_text` and `content_text` (this step's), and on the final response
    `reasoning`, `content` and `channel_confidence`; `fields` (the `JsonField`s completed
    at this step), and on the final response `all_fields` and `fields_error`;
    `tool_calls` (this step's `delta.tool_calls` pieces), `tool_fields` (the calls'
    fields completed at this step) and on the final response
    `all_tool_calls` (the `ToolCall`s, with their fields). Without them they are None /
    empty. With `alarm=...`, `alarms` (the flagged units final at this step) and, on
    the final response, `stopped_by` ("alarm" when an alarm's "stop" ended the reply).
    """

    text: str
    token: int
    logprobs: Any
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None
    last_segment_tokens: list[TokenSpan] = field(default_factory=list)
    confidence: Confidence | None = None
    token_logprob: float = 0.0
    top_logprobs: list[Alternative] = field(default_factory=list)
    stop_string: str | None = None
    stop_tokens: list[TokenSpan] = field(default_factory=list)
    output: TokenOutput | None = None

    @classmethod
    def of(cls, out: TokenOutput, logprobs: Any = None) -> GenerationResponse:
        """The mlx-lm-shaped view of `out` (`logprobs`: the engine's full vector)."""
        return cls(
            text=out.text,
            token=out.token,
            logprobs=logprobs,
            from_draft=out.from_draft,
            prompt_tokens=out.prompt_tokens,
            prompt_tps=out.prompt_tps,
            generation_tokens=out.index + 1,
            generation_tps=out.generation_tps,
            peak_memory=out.peak_memory,
            finish_reason=out.finish_reason,
            last_segment_tokens=list(out.tokens),
            confidence=out.confidence,
            token_logprob=out.logprob,
            top_logprobs=list(out.top),
            stop_string=out.stop_string,
            stop_tokens=list(out.stop_tokens),
            output=out,
        )

    # -- structure, read from `output` --

    @property
    def channel(self) -> str | None:
        return None if self.output is None else self.output.channel

    @property
    def channels(self) -> list[Any]:
        parts = None if self.output is None else self.output.parts
        return [] if parts is None else list(parts)

    def _channel_text(self, channel: str) -> str:
        return "".join(p.text for p in self.channels if p.channel == channel)

    @property
    def reasoning_text(self) -> str:
        return self._channel_text("reasoning")

    @property
    def content_text(self) -> str:
        """This step's content: with a tool parser, the content it let through."""
        out = self.output
        if out is not None and out.tool is not None:
            return out.tool.content
        return self._channel_text("content")

    @property
    def reasoning(self) -> str | None:
        end = None if self.output is None else self.output.end
        return None if end is None else end.reasoning

    @property
    def content(self) -> str | None:
        end = None if self.output is None else self.output.end
        if end is not None and end.tool_content is not None:
            return end.tool_content
        return None if end is None else end.content

    @property
    def channel_confidence(self) -> dict[str, Confidence | None] | None:
        end = None if self.output is None else self.output.end
        return None if end is None else end.channel_confidence

    @property
    def fields(self) -> list[Any] | None:
        found = None if self.output is None else self.output.fields
        return None if found is None else list(found)

    @property
    def all_fields(self) -> list[Any] | None:
        end = None if self.output is None else self.output.end
        return None if end is None or end.all_fields is None else list(end.all_fields)

    @property
    def fields_error(self) -> str | None:
        end = None if self.output is None else self.output.end
        return None if end is None else end.fields_error

    @property
    def tool_calls(self) -> list[dict[str, Any]] | None:
        tool = None if self.output is None else self.output.tool
        return None if tool is None else list(tool.deltas)

    @property
    def tool_fields(self) -> list[Any] | None:
        """The tool calls' fields completed at this step (None: no tool parser)."""
        tool = None if self.output is None else self.output.tool
        return None if tool is None else list(tool.fields)

    @property
    def all_tool_calls(self) -> list[Any] | None:
        end = None if self.output is None else self.output.end
        return None if end is None or end.tool_calls is None else list(end.tool_calls)

    @property
    def alarms(self) -> list[Any]:
        """With `alarm=...`: the units final at this step whose confidence is below its
        threshold (`tokentrail.output.alarm.AlarmHit`s); empty otherwise."""
        return [] if self.output is None else list(self.output.alarms)

    @property
    def stopped_by(self) -> str | None:
        """"alarm" on the final response when an alarm's "stop" ended the reply."""
        return None if self.output is None else self.output.stopped_by

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (no device arrays) for logs, scripts and HTTP."""
        out: dict[str, Any] = {
            "text": self.text,
            "token": self.token,
            "token_logprob": self.token_logprob,
            "top_logprobs": [a.to_dict() for a in self.top_logprobs],
            "last_segment_tokens": [t.to_dict() for t in self.last_segment_tokens],
            "confidence": None if self.confidence is None else self.confidence.to_dict(),
            "finish_reason": self.finish_reason,
            "stop_string": self.stop_string,
            "stop_tokens": [t.to_dict() for t in self.stop_tokens],
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "generation_tps": self.generation_tps,
        }
        structure_dict(self, out)
        return out


def structure_dict(r: GenerationResponse, out: dict[str, Any]) -> None:
    """Add `r`'s structure fields (those that are set) to its dict `out`."""
    if r.channel is not None:
        out["channel"] = r.channel
        out["channels"] = [c.to_dict() for c in r.channels]
        out["reasoning_text"] = r.reasoning_text
        out["content_text"] = r.content_text
        if r.channel_confidence is not None:
            out["reasoning"] = r.reasoning
            out["content"] = r.content
            out["channel_confidence"] = {
                k: None if c is None else c.to_dict() for k, c in r.channel_confidence.items()
            }
    if r.fields is not None:
        out["fields"] = [f.to_dict() for f in r.fields]
        if r.all_fields is not None:
            out["all_fields"] = [f.to_dict() for f in r.all_fields]
            out["fields_error"] = r.fields_error
    if r.alarms:
        out["alarms"] = [a.to_dict() for a in r.alarms]
    if r.stopped_by is not None:
        out["stopped_by"] = r.stopped_by
    if r.tool_calls is not None:
        out["tool_calls"] = r.tool_calls
        out["tool_fields"] = [f.to_dict() for f in r.tool_fields or ()]
        if r.channel is None:
            out["content_text"] = r.content_text
        calls = r.all_tool_calls
        if calls is not None:
            out["all_tool_calls"] = [c.to_dict() for c in calls]
            out["content"] = r.content


def _confidence(spans: list[TokenSpan]) -> Confidence | None:
    """`confidence_of(spans)`, with a shortcut for the common one-token segment."""
    if len(spans) == 1:
        t = spans[0]
        lp = t.logprob
        if lp is not None and not t.top_logprobs:
            return Confidence(lp, lp, math.exp(-lp), math.exp(lp), None, 1)
    return confidence_of(spans) if spans else None


class SequenceState:
    """The state of one sequence above the engine: aligner, stop strings, EOS, limit.

    `feed(step)` turns the next engine step into its `GenerationResponse`; `done` is
    set once a response carries a `finish_reason`. `padded_size` (the model's vocabulary
    when it runs past the tokenizer's) makes alternatives without text drop out.

    `whole_tokens`: each token is listed once, in the response whose text completes it
    (its span then covers all of its bytes), rather than in every response its bytes
    reach. `drop_first_space`: the reply's first leading space is dropped, as mlx-lm's
    byte-level BPE detokenizer does.
    """

    __slots__ = (
        "_drafted",
        "_open",
        "_pieces",
        "_size",
        "aligner",
        "done",
        "eos",
        "limit",
        "matcher",
        "n",
        "n_prompt",
        "padded",
        "peak_memory",
        "prompt_tps",
        "refused",
        "tic",
        "whole",
    )

    def __init__(
        self,
        aligner: Aligner,
        matcher: StopMatcher | None,
        eos: frozenset[int],
        n_prompt: int,
        limit: int | None,
        model_vocab_size: int | None,
        peak_memory: Callable[[], float],
        *,
        whole_tokens: bool = False,
        drop_first_space: bool = False,
    ) -> None:
        self.aligner = aligner
        self.whole = WholeTokens(aligner.vocab, bool(aligner.prompt_text)) if whole_tokens else None
        self._open = drop_first_space
        self._drafted: set[int] = set()
        self.matcher = matcher
        self.eos = eos
        self.n_prompt = n_prompt
        self.limit = limit
        vocab = aligner.vocab
        self._size = vocab.size
        self._pieces = vocab.pieces
        self.padded = model_vocab_size is not None and model_vocab_size > vocab.size
        self.peak_memory = peak_memory
        self.n = 0
        self.done = False
        self.tic = time.perf_counter()
        self.prompt_tps = 0.0
        #: index -> why, for tokens the engine could not identify (an upstream's lossy data)
        self.refused: dict[int, str] = {}

    def feed(self, step: Step) -> GenerationResponse:
        """The response for the next token; raises RuntimeError after the last one."""
        return GenerationResponse.of(self.advance(step), step.logprobs)

    # The per-token hot path of every engine: one frame instead of several helper calls
    # long: is measurably cheaper (benchmarks/bench_generate.py), so it stays one piece.
    def advance(self, step: Step, cached: int = 0) -> TokenOutput:
        """The record of the next token (`cached`: prompt tokens the engine's cache
        served); raises RuntimeError after the last one."""
        if self.done:
            raise RuntimeError("this sequence has already finished")
        n = self.n
        aligner = self.aligner
        if n == 0:
            now = time.perf_counter()
            self.prompt_tps = self.n_prompt / max(now - self.tic, 1e-9)
            self.tic = now
        token = step.token
        pairs = step.top_logprobs
        if self.padded and pairs:
            size, pieces = self._size, self._pieces
            pairs = [p for p in pairs if p[0] < size and pieces[p[0]] is not None]
        is_eos = token in self.eos
        last = is_eos or (self.limit is not None and n + 1 >= self.limit)
        eos_span = None
        if is_eos:
            # EOS ends the text: it adds no characters but is still reported.
            segs = aligner.finish()
            eos_top = aligner.alternatives(pairs) if pairs else None
            eos_span = TokenSpan(n, token, 0, 0, step.logprob, eos_top, step.from_draft)
        else:
            segs = aligner.push(token, step.logprob, pairs or None)
            if last:
                segs += aligner.finish()
        if self._open and segs:
            segs, self._open = drop_first_space(segs)
        if step.from_draft:
            self._drafted.add(n)

        stop_string = None
        stop_tokens: list[TokenSpan] = []
        matcher = self.matcher
        if matcher is not None:
            segs, match = matcher.feed(segs)
            if match is not None:
                stop_string = match.stop
                rest = [] if last else aligner.finish()
                stop_tokens = merge_spans([Segment("", match.tokens), *rest])
                if eos_span is not None:
                    stop_tokens.append(eos_span)
                    eos_span = None
                last = True
            elif last:
                segs += matcher.flush()

        if len(segs) == 1:
            text = segs[0].text
            spans = list(segs[0].tokens)
        else:
            text = "".join(s.text for s in segs)
            spans = merge_spans(segs)
        if eos_span is not None:
            spans.append(eos_span)
        if self._drafted:
            spans = self._mark_drafted(spans)
            stop_tokens = self._mark_drafted(stop_tokens)
        if self.whole is not None:
            spans, stop_tokens = self.whole.take(spans, stop_tokens, last, bool(text))

        if not pairs:
            top: tuple[Alternative, ...] = ()
        elif spans and spans[-1].index == n and spans[-1].top_logprobs is not None:
            top = tuple(spans[-1].top_logprobs)
        else:
            top = tuple(aligner.alternatives(pairs))

        finish = None
        if last:
            finish = "stop" if (is_eos or stop_string is not None) else "length"
            self.done = True
        self.n = n + 1
        reason = getattr(step, "refused", None)
        if reason is not None:
            self.refused[n] = reason
        refused: tuple[dict[str, Any], ...] = ()
        if self.refused:
            why = self.refused
            refused = tuple(
                {"index": t.index, "id": t.id, "reason": why[t.index]}
                for t in (*spans, *stop_tokens)
                if t.index in why
            )
        return TokenOutput(
            n,
            token,
            text,
            step.logprob,
            top,
            tuple(spans),
            _confidence(spans),
            finish,
            stop_string,
            tuple(stop_tokens),
            self.n_prompt,
            self.prompt_tps,
            (n + 1) / max(time.perf_counter() - self.tic, 1e-9),
            self.peak_memory(),
            step.from_draft,
            step.distribution,
            step.allowed_mass,
            cached,
            refused,
        )

    def end(self) -> tuple[TokenSpan, ...]:
        """End the sequence now, after the record `advance` last made (an alarm's
        "stop": `tokentrail.output.alarm`): the tokens still held back (text a stop
        string may yet start, an unfinished character) are returned, none of them put
        into the text, as a stop string's `stop_tokens` are; `done` is set, so the
        caller's loop ends as it does for EOS or a stop string."""
        if self.done:
            return ()
        held = [] if self.matcher is None else self.matcher.flush()
        spans = merge_spans([*held, *self.aligner.finish()])
        if self._drafted:
            spans = self._mark_drafted(spans)
        self.done = True
        return tuple(spans)

    def _mark_drafted(self, spans: list[TokenSpan]) -> list[TokenSpan]:
        """`spans` with `from_draft` set on the tokens a draft model proposed."""
        drafted = self._drafted
        return [t._replace(from_draft=True) if t.index in drafted else t for t in spans]
