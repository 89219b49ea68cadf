"""Rebuild exact segments, with token attribution, from any OpenAI-compatible stream.

`Realigner` reads the chunks a server streamed (parsed JSON objects), recovers the id of
every generated token from what the wire carries, and runs them through the `Aligner`,
so each segment of text comes with the tokens that made it, their logprobs and their
alternatives. Token ids are recovered, best first, from:

- tokentrail's own ``"tokentrail"`` extension (`tokentrail.server`): the segments are
  passed through, and checked against a realignment of the extension's token ids;
- explicit ids: vLLM's ``token_ids`` on each choice (``return_token_ids``),
  ``token_id:N`` token strings (vLLM's ``return_tokens_as_token_ids``), the ``id`` of
  llama.cpp's ``completion_probabilities`` entries;
- raw bytes: the ``bytes`` of OpenAI-style logprobs, or the token strings themselves
  (OpenAI's ``bytes:\\xe2\\x80`` form for bytes that are not UTF-8 on their own), mapped
  back to ids through the tokenizer's vocabulary.

Servers are not always faithful. Many send a token that is not valid UTF-8 on its own as
U+FFFD (bytes EF BF BD), and llama.cpp sends no frame at all for a token that leaves an
incomplete character, folding its bytes into the next frame. Such tokens cannot be
identified; the realigner says so (`RealignedSegment.refused`, `RealignResult.lossy`)
and keeps its text exact from the streamed content, instead of guessing. Nothing is
released until the streamed content confirms it; a disagreement is reported, never
papered over.

`Realigner(on_token=...)` follows every token as it reaches the aligner (a
`TokenEvent`), which is how `tokentrail.engines.upstream.engine` turns a realigned stream into
steps.

The package: `core` (the `Realigner`), `feeding` (its `Feeder`: aligner feeding,
confirmation), `placement` (fitting unidentified tokens' bytes between identified
ones), `vocabmap` (bytes and names back to ids), `wire` and `dialects` (one parser per
wire dialect: `openai`, `vllm`, `token_ids`, `llamacpp`, `tokentrail`), `capture` (JSON
lines / SSE) and `cli` (``tokentrail realign``).
"""

from __future__ import annotations

from .capture import read_chunks
from .cli import main, register, run, segment_json  # noqa: F401  (see __all__)
from .core import Realigner, realign
from .dialects import parse_chunk
from .result import RealignedSegment, RealignError, RealignResult, RefusedToken, TokenEvent
from .wire import REPLACEMENT, WIRE_NEG_INF, token_string_bytes

# Not listed: `register` (the `tokentrail` command's plugin hook), and `run` and
# `segment_json`, importable here where they were (their home is `tokentrail.realign.cli`).
__all__ = [
    "REPLACEMENT",
    "WIRE_NEG_INF",
    "RealignError",
    "RealignResult",
    "RealignedSegment",
    "Realigner",
    "RefusedToken",
    "TokenEvent",
    "main",
    "parse_chunk",
    "read_chunks",
    "realign",
    "token_string_bytes",
]
