"""`OutputProcessor`: one sequence's output stage, the same for every entry point.

Each engine `Step` goes through the stages in one fixed order, on whichever thread
feeds it (the caller's for `stream_generate`, the model thread for the server):

1. `SequenceState.advance`: the aligner (text and the tokens behind it), stop strings,
   EOS and the token limit, giving the step's `TokenOutput`;
2. reasoning channels (`structure.reasoning.ChannelSplitter`), when a format is set;
3. tool calls (`structure.tools.ToolCallStream`) on the content channel, when a tool
   parser is set;
4. JSON fields (`structure.fields.FieldStream`) on the content channel, when asked for;
5. calibration (`calibrate.Calibration`), when a map is given: `confidence.calibrated`;
6. alarms (`output.alarm.AlarmWatch`), when asked for: the units below a threshold on
   the record (`alarms`); with "stop" the record that completes the first one becomes
   the last (`finish_reason` "stop", `stopped_by` "alarm"; `SequenceState.end`), the
   structure stages finish there, and the caller's loop ends without another token.

A step without structure is the record `advance` made; with structure the record is
made once more with the structure filled in, before anyone sees it. The record is then
final: `GenerationResponse.of` views it for the library, the server's renderer writes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..engines.base import Step
from ..segment import Segment
from ..sequence import SequenceState
from ..structure.fields import ContinuationScorer, FieldStream
from ..structure.reasoning import CHANNELS, ChannelSplitter, ReasoningFormat
from ..structure.tool_stream import ToolCallStream
from .alarm import Alarm, AlarmWatch
from .record import SequenceEnd, TokenOutput, ToolStep

__all__ = ["OutputProcessor", "joined", "merged_tool_deltas"]


class OutputProcessor:
    """Turns one sequence's engine steps into `TokenOutput`s (see the module).

    `state`: the sequence's `SequenceState`. `reasoning`: a parser name, a
    `ReasoningFormat` or (START, END) markers, or None. `tool_parser`: a
    `structure.TOOL_PARSERS` name (None: no tool calls); `tools` (OpenAI's list) give
    the calls' arguments their allowed values. `fields`: find JSON fields in the
    content; `schema` / `choices` give leaves their allowed values and `scorer` their
    alternatives (the calls' arguments' too). `output_ids` is filled with each step's
    token, in order, before fields are built (a scorer built on the same list sees the
    output up to the leaf). `calibration`: a checked `tokentrail.calibrate.Calibration`,
    applied after the structure (each record's `confidence.calibrated`, and its
    channels'). `alarm`: an `output.alarm.Alarm` (or its mapping), the last stage.
    """

    __slots__ = ("alarm", "calibration", "fields", "output_ids", "splitter", "state", "tools")

    def __init__(
        self,
        state: SequenceState,
        *,
        reasoning: str | ReasoningFormat | tuple[str, str] | None = None,
        starts_in_reasoning: bool | None = None,
        tool_parser: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        fields: bool = False,
        schema: Mapping[str, Any] | None = None,
        choices: Mapping[str, Sequence[Any]] | None = None,
        scorer: ContinuationScorer | None = None,
        output_ids: list[int] | None = None,
        calibration: Any = None,
        alarm: Alarm | Mapping[str, Any] | None = None,
    ) -> None:
        self.state = state
        #: The alarm stage (None: no alarm asked for).
        self.alarm = None if alarm is None else AlarmWatch(Alarm.of(alarm))
        #: A checked `tokentrail.calibrate.Calibration` (None: none): the last stage.
        self.calibration = calibration
        self.splitter = (
            None
            if reasoning is None
            else ChannelSplitter(reasoning, starts_in_reasoning=starts_in_reasoning)
        )
        self.tools = (
            None if tool_parser is None
            else ToolCallStream(tool_parser, tools=tools, scorer=scorer)
        )  # fmt: skip
        self.fields = FieldStream(schema=schema, choices=choices, scorer=scorer) if fields else None
        self.output_ids = [] if output_ids is None else output_ids

    @property
    def done(self) -> bool:
        """Whether the last token has been fed."""
        return self.state.done

    @property
    def structured(self) -> bool:
        """Whether any structure stage is on."""
        return not (self.splitter is None and self.tools is None and self.fields is None)

    @property
    def open_field(self) -> bool:
        """Whether a JSON leaf value of the content has begun and is not complete (what
        field retry holds back, `output.retry`)."""
        return self.fields is not None and self.fields.open_leaf

    @property
    def channel(self) -> str | None:
        """The channel the reply is in now (None without a reasoning format)."""
        return None if self.splitter is None else self.splitter.channel

    def feed(self, step: Step, cached: int = 0) -> TokenOutput:
        """The record of the next token (`cached`: prompt tokens the engine's prompt
        cache served); RuntimeError after the last one."""
        out = self.state.advance(step, cached)
        if not (self.splitter is None and self.tools is None and self.fields is None):
            out = self.structure(out)
        if self.calibration is not None:
            out = self.calibrated(out)
        if self.alarm is not None:
            out = self.alarmed(out)
        return out

    def alarmed(self, out: TokenOutput) -> TokenOutput:
        """`out` with its alarms; with "stop" and a unit flagged, made the last record
        (the structure stages finish with it; their last parts and fields are checked
        too)."""
        watch = self.alarm
        assert watch is not None
        hits = watch.check(out)
        if not hits:
            return out
        if watch.alarm.stops and out.finish_reason is None:
            held = self.state.end()
            out = replace(
                out, finish_reason="stop", stopped_by="alarm", stop_tokens=out.stop_tokens + held
            )
            if self.structured:  # the stages' last pass, with no new text
                tail = self.structure(replace(out, text="", tokens=()), fed=True)
                hits += watch.check(tail)
                out = joined(out, tail)
                if self.calibration is not None:
                    out = self.calibrated(out)
        return replace(out, alarms=tuple(hits))

    def calibrated(self, out: TokenOutput) -> TokenOutput:
        """`out` with its segment's and channels' confidences calibrated."""
        cal = self.calibration
        changes: dict[str, Any] = {"confidence": cal.confidence(out.confidence)}
        end = out.end
        if end is not None and end.channel_confidence is not None:
            by_channel = {c: cal.confidence(v) for c, v in end.channel_confidence.items()}
            changes["end"] = replace(end, channel_confidence=by_channel)
        return replace(out, **changes)

    # long: the three structure stages in their fixed order, each a few lines, read as one.
    def structure(self, out: TokenOutput, fed: bool = False) -> TokenOutput:
        """`out` with the structure stages applied (for a record made elsewhere, e.g.
        by the proxy's realigner). `fed`: its token is in `output_ids` already."""
        if not fed:
            self.output_ids.append(out.token)
        seg = Segment(out.text, out.tokens)
        final = out.finish_reason is not None
        has_text = bool(seg.text or seg.tokens)
        content: list[Segment] = [seg] if has_text else []
        changes: dict[str, Any] = {}
        end: dict[str, Any] = {}
        splitter = self.splitter
        if splitter is not None:
            parts = splitter.feed(seg) if has_text else []
            if final:
                parts += splitter.finish()
            changes["channel"] = splitter.channel
            changes["parts"] = tuple(parts)
            content = [p for p in parts if p.channel == "content"]
            if final:
                end["reasoning"] = splitter.text("reasoning")
                end["content"] = splitter.text("content")
                end["channel_confidence"] = {
                    c: splitter.confidence(c) for c in CHANNELS if splitter.tokens(c)
                }
        tools = self.tools
        if tools is not None:
            piece, deltas = tools.feed(content)
            if final:
                more, more_deltas = tools.finish()
                piece, deltas = piece + more, deltas + more_deltas
                result = tools.result
                if result is not None:
                    end["tool_calls"] = tuple(result.calls)
                    end["tool_content"] = result.content
            # the content's parts as the parser decides them: content, or a call's text
            decided = tools.take_parts()
            kept = [p for p in changes.get("parts", ()) if p.channel != "content"]
            changes["parts"] = (*kept, *decided)
            if splitter is None:
                changes["channel"] = tools.channel
            changes["tool"] = ToolStep(
                piece,
                tuple(merged_tool_deltas([d.to_dict() for d in deltas])),
                tuple(tools.released_tokens()),
                tuple(tools.take_fields()),
            )
        stream = self.fields
        if stream is not None:
            found = stream.feed(content) if stream.error is None else []
            if final and stream.error is None:
                found += stream.finish()
            changes["fields"] = tuple(found)
            if final:
                error = stream.trailing_error()
                end["fields_error"] = error
                end["all_fields"] = tuple(stream.fields) if error is None else ()
        if final:
            changes["end"] = SequenceEnd(**end)
        return replace(out, **changes)


def joined(out: TokenOutput, tail: TokenOutput) -> TokenOutput:
    """`out` with the structure of `tail` (the stages' last pass after it, with no
    new text) added: its parts, fields, tool-call pieces, channel and `end`."""
    changes: dict[str, Any] = {"channel": tail.channel, "end": tail.end}
    if out.parts is not None or tail.parts is not None:
        changes["parts"] = (*(out.parts or ()), *(tail.parts or ()))
    if out.fields is not None or tail.fields is not None:
        changes["fields"] = (*(out.fields or ()), *(tail.fields or ()))
    a, b = out.tool, tail.tool
    if a is not None and b is not None:
        deltas = merged_tool_deltas([dict(d) for d in (*a.deltas, *b.deltas)])
        changes["tool"] = ToolStep(
            a.content + b.content, tuple(deltas), a.released + b.released, a.fields + b.fields
        )
    return replace(out, **changes)


def merged_tool_deltas(pieces: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`delta.tool_calls` pieces with one entry per call index (arguments joined)."""
    out: dict[int, dict[str, Any]] = {}
    for piece in pieces:
        have = out.get(piece["index"])
        if have is None:
            out[piece["index"]] = {**piece, "function": dict(piece["function"])}
            continue
        for key in ("id", "type"):
            if key in piece:
                have[key] = piece[key]
        fn = have["function"]
        if "name" in piece["function"]:
            fn["name"] = piece["function"]["name"]
        if "arguments" in piece["function"]:
            fn["arguments"] = fn.get("arguments", "") + piece["function"]["arguments"]
    return list(out.values())
