"""Structure in model output, with the tokens behind each part: reasoning channels,
JSON fields and tool calls.

Everything here works on the segments the aligner emits (text plus each token's byte
range), after the fact or streamed, and never reaches into the aligner's state:
- `reasoning`: `ChannelSplitter` tags text as reasoning, content, tool_call or markup;
- `fields`: one `JsonField` per JSON leaf (path, value, exact text, narrowed tokens,
  confidence, and, given a scorer, the probability of each allowed value);
- `tools`: tool calls parsed in a model family's own format, with their fields;
- `schema`: the values a JSON schema allows at a path (`$ref`, `anyOf`, `allOf`...).
"""

from __future__ import annotations

from .fields import (
    NO_SCORER,
    AllowedValue,
    ContinuationScorer,
    FieldStream,
    JsonField,
    TokenPlacement,
    allowed_values,
    json_fields,
)
from .jsonscan import JsonLeaf, JsonScanner, json_pointer
from .reasoning import (
    CHANNELS,
    REASONING_PARSERS,
    ChannelSegment,
    ChannelSplitter,
    ReasoningFormat,
    reasoning_format,
    split_channels,
)
from .tool_stream import ToolCallStream
from .tools import (
    TOOL_PARSERS,
    ToolCall,
    ToolCallDelta,
    ToolCallResult,
    detect_tool_parser,
    parse_tool_calls,
    tool_schemas,
)

__all__ = [
    "CHANNELS",
    "NO_SCORER",
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "AllowedValue",
    "ChannelSegment",
    "ChannelSplitter",
    "ContinuationScorer",
    "FieldStream",
    "JsonField",
    "JsonLeaf",
    "JsonScanner",
    "ReasoningFormat",
    "TokenPlacement",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallResult",
    "ToolCallStream",
    "allowed_values",
    "detect_tool_parser",
    "json_fields",
    "json_pointer",
    "parse_tool_calls",
    "reasoning_format",
    "split_channels",
    "tool_schemas",
]
