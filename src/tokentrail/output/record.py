"""`TokenOutput`: one generated token and what became final with it, frozen.

Made once per token by `tokentrail.sequence.SequenceState.advance` (text, tokens, stop,
finish) and, where a request asks for structure, completed by
`tokentrail.output.processor.OutputProcessor` (channels, tool calls, fields) before
anyone sees it. Nothing writes to it afterwards, so it crosses threads as it is: it
holds no engine arrays (the engine's full logprob vector stays on the `Step`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..segment import Alternative, Confidence, TokenSpan

if TYPE_CHECKING:
    from ..structure.fields import JsonField
    from ..structure.reasoning import ChannelSegment
    from ..structure.tools import ToolCall
    from .alarm import AlarmHit

__all__ = ["SequenceEnd", "TokenOutput", "ToolStep"]


@dataclass(frozen=True, slots=True)
class ToolStep:
    """A step's content through a tool-call parser: `content` (the content text it let
    through), `deltas` (OpenAI `delta.tool_calls` pieces, one per call index),
    `released` (the content tokens it let through, in order, each once: what
    `logprobs.content` lists) and `fields` (the calls' fields whose last character
    arrived now: a call's name, each argument leaf, with their tokens)."""

    content: str
    deltas: tuple[dict[str, Any], ...]
    released: tuple[TokenSpan, ...]
    fields: tuple[JsonField, ...] = ()


@dataclass(frozen=True, slots=True)
class SequenceEnd:
    """What only the last token's record has: the whole reply's structure.

    `reasoning` / `content` (the whole texts per channel) and `channel_confidence`
    (each channel that has tokens) with a reasoning format; `all_fields` (every JSON
    field of the content, or none when it is not one JSON value) and `fields_error`
    (why) with fields on; with a tool parser, `tool_calls` (the calls, each with its
    fields) and `tool_content` (the content around them).
    """

    reasoning: str | None = None
    content: str | None = None
    channel_confidence: dict[str, Confidence | None] | None = None
    all_fields: tuple[JsonField, ...] | None = None
    fields_error: str | None = None
    tool_calls: tuple[ToolCall, ...] | None = None
    tool_content: str | None = None


@dataclass(slots=True)
class TokenOutput:
    """One generated token (`index` in the reply, `token`, its `logprob` and `top`
    alternatives, from `distribution` "raw", "processed" or "masked" (`engines.base.Step`),
    `allowed_mass` under a constraint) and the text that became final with it: `text`,
    the `tokens` behind it (each with the byte range it put into `text`) and their
    `confidence`.

    `finish_reason` is set on the last one ("stop": EOS or a stop string, "length");
    a stop string is named by `stop_string`, the tokens that carried it are
    `stop_tokens` (none of them in `text`). `cached_tokens` is how many prompt tokens
    the engine's prompt cache served; `refused` lists tokens behind this text the
    engine could not identify (an upstream's lossy data), as {"index", "id", "reason"}.

    Structure (None where not asked for): `channel` (the channel the reply is in after
    this token) and `parts` (the `ChannelSegment`s final now) with a reasoning format;
    `tool` (this step through the tool-call parser); `fields` (the JSON fields whose
    last character arrived now); `end` on the last record (`SequenceEnd`).

    With an alarm (`tokentrail.output.alarm`): `alarms` lists the units final with this
    record whose confidence is below its threshold; `stopped_by` is "alarm" on the last
    record when an alarm's "stop" ended the reply there.
    `stopped_by` is "early_stop" when the scheduler's vote stopped it
    (`tokentrail.output.vote`).

    A record is read-only by contract (every consumer of the step reads the same one;
    make a changed copy with `dataclasses.replace`), though not frozen: a frozen
    dataclass of these 26 fields took 2.8 µs to make against 0.4 µs, once per token.
    """

    index: int
    token: int
    text: str
    logprob: float
    top: tuple[Alternative, ...]
    tokens: tuple[TokenSpan, ...]
    confidence: Confidence | None
    finish_reason: str | None = None
    stop_string: str | None = None
    stop_tokens: tuple[TokenSpan, ...] = ()
    prompt_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    peak_memory: float = 0.0
    from_draft: bool = False
    distribution: str = "raw"
    allowed_mass: float | None = None
    cached_tokens: int = 0
    refused: tuple[dict[str, Any], ...] = ()
    channel: str | None = None
    parts: tuple[ChannelSegment, ...] | None = None
    tool: ToolStep | None = None
    fields: tuple[JsonField, ...] | None = None
    end: SequenceEnd | None = None
    alarms: tuple[AlarmHit, ...] = ()
    stopped_by: str | None = None

    @property
    def generation_tokens(self) -> int:
        """Tokens generated so far, this one included."""
        return self.index + 1
