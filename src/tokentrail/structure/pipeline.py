"""Structure applied to a stream of responses: reasoning channels, then JSON fields.

`StructuredStream` sits after the sequence (aligner, stop strings, EOS): each response's
final text and tokens (`text`, `last_segment_tokens`) are one segment, which goes
through a `ChannelSplitter` (when a reasoning format is set) and, for the content
channel only, a `FieldStream` (when fields are asked for). It writes what it found
onto the response's own fields and leaves every other field as it was, so `text` keeps
its meaning (all the text that became final, marker text included) and the channel
fields say where each part of it went:

- `channel`: the channel the reply is in after this step (None: no reasoning format);
- `channels`: the `ChannelSegment`s that became final at this step (a tail that may
  start a marker is held back, so they can lag `text` by a few characters);
- `reasoning_text`, `content_text`: this step's reasoning and content text;
- on the final response, `reasoning` and `content` (the whole texts) and
  `channel_confidence` (each channel that has tokens: its `Confidence`);
- `fields`: the `JsonField`s whose last character arrived at this step (None when
  fields are off); on the final response `all_fields` holds every field, or none when
  the content as a whole is not one JSON value, and `fields_error` says why (None when
  it is). A streamed field is final once given: content that stops being JSON later
  (text after the value) does not take it back, `fields_error` says so at the end.

It works on the responses alone (duck-typed), so it never imports `generate` and runs
the same wherever responses come from. A constraint (a JSON schema) applies to the
content after the reasoning: the engine's guide watches for the reasoning's end marker
(`tokentrail.constrain.gate`), and the schema comes here, so fields get its allowed
values.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..segment import Segment
from .fields import ContinuationScorer, FieldStream
from .reasoning import CHANNELS, ChannelSegment, ChannelSplitter, ReasoningFormat

__all__ = ["StructuredStream"]


class StructuredStream:
    """Applies a reasoning format and/or JSON fields to one sequence's responses.

    `reasoning`: a parser name, a `ReasoningFormat` or (START, END), or None.
    `fields`: find JSON fields in the content; `schema` / `choices` give leaves their
    allowed values, `scorer` their alternatives. `output_ids` is filled with each
    response's token, in order, before fields are built (a scorer built on the same list
    sees the output up to the leaf).
    """

    def __init__(
        self,
        reasoning: str | ReasoningFormat | tuple[str, str] | None = None,
        *,
        fields: bool = False,
        schema: Mapping[str, Any] | None = None,
        choices: Mapping[str, Sequence[Any]] | None = None,
        scorer: ContinuationScorer | None = None,
        output_ids: list[int] | None = None,
        starts_in_reasoning: bool | None = None,
    ) -> None:
        self.splitter = (
            None
            if reasoning is None
            else ChannelSplitter(reasoning, starts_in_reasoning=starts_in_reasoning)
        )
        self.fields = (
            FieldStream(schema=schema, choices=choices, scorer=scorer) if fields else None
        )
        self.output_ids = [] if output_ids is None else output_ids

    @property
    def channel(self) -> str | None:
        """The channel the reply is in now (None without a reasoning format)."""
        return None if self.splitter is None else self.splitter.channel

    def wrap(self, responses: Iterator[Any]) -> Iterator[Any]:
        """`responses`, each with its structure fields set; closing this closes them."""
        try:
            for r in responses:
                yield self.apply(r)
        finally:
            close = getattr(responses, "close", None)
            if close is not None:
                close()

    def apply(self, r: Any) -> Any:
        """Set `r`'s structure fields from its text and tokens; return `r`."""
        self.output_ids.append(r.token)
        seg = Segment(r.text, tuple(r.last_segment_tokens))
        final = r.finish_reason is not None
        content: list[Segment] = [seg]
        splitter = self.splitter
        if splitter is not None:
            parts = splitter.feed(seg) if (seg.text or seg.tokens) else []
            if final:
                parts += splitter.finish()
            r.channel = splitter.channel
            r.channels = parts
            r.reasoning_text = _text(parts, "reasoning")
            r.content_text = _text(parts, "content")
            content = [p for p in parts if p.channel == "content"]
            if final:
                r.reasoning = splitter.text("reasoning")
                r.content = splitter.text("content")
                r.channel_confidence = {
                    c: splitter.confidence(c) for c in CHANNELS if splitter.tokens(c)
                }
        stream = self.fields
        if stream is not None:
            found = stream.feed(content) if stream.error is None else []
            if final and stream.error is None:
                found += stream.finish()
            r.fields = found
            if final:
                r.fields_error = stream.trailing_error()
                r.all_fields = list(stream.fields) if r.fields_error is None else []
        return r


def _text(parts: list[ChannelSegment], channel: str) -> str:
    return "".join(p.text for p in parts if p.channel == channel)
