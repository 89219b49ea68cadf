"""Structure in model output, with the tokens behind each part: reasoning channels,
JSON fields and tool calls.

Everything here works on the segments the aligner emits (text plus each token's byte
range), after the fact or streamed, and never reaches into the aligner's state:
- `reasoning`: `ChannelSplitter` tags text as reasoning, content, tool_call or markup;
- `fields`: one `JsonField` per JSON leaf (path, value, exact text, narrowed tokens,
  confidence, and, given a scorer, the probability of each allowed value);
- `tools`: tool calls parsed in a model family's own format, with their fields.
"""

from __future__ import annotations

from .reasoning import (
    CHANNELS,
    REASONING_PARSERS,
    ChannelSegment,
    ChannelSplitter,
    ReasoningFormat,
    reasoning_format,
    split_channels,
)

__all__ = [
    "CHANNELS",
    "REASONING_PARSERS",
    "ChannelSegment",
    "ChannelSplitter",
    "ReasoningFormat",
    "reasoning_format",
    "split_channels",
]
