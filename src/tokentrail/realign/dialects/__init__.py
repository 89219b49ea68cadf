"""Wire dialects: one module per way a server describes the tokens it streamed.

`parse_chunk` turns one parsed chunk into a `Frame` (its content and its `WireToken`s).
Chunk-level dialects (`CHUNK_DIALECTS`) each say whether they `claims` a chunk and
`parse` it; choice-level id sources (`CHOICE_IDS`, e.g. vLLM's ``token_ids``) refine an
OpenAI-shaped choice. To add a dialect (SGLang's, TGI's), add a module with ``NAME``,
``claims`` and ``parse`` and list it in `CHUNK_DIALECTS`; a choice-level id source
(``claims`` and ``attach``) is listed in `tokentrail.realign.dialects.openai.CHOICE_IDS`,
where the OpenAI parser that uses them lives.

- `openai`: OpenAI/llama.cpp ``choices`` with logprobs (``bytes``, token strings);
- `vllm`: vLLM's ``token_ids`` (``return_token_ids``);
- `token_ids`: ``token_id:N`` strings (vLLM's ``return_tokens_as_token_ids``);
- `llamacpp`: llama.cpp's ``/completion`` (``n_probs``);
- `tokentrail`: tokentrail's own ``"tokentrail"`` extension.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import wire
from ..result import RealignError
from ..wire import Frame
from . import llamacpp, openai
from .openai import CHOICE_IDS

__all__ = ["CHOICE_IDS", "CHUNK_DIALECTS", "parse_chunk"]

#: Chunk-level dialects, tried in order.
CHUNK_DIALECTS = (openai, llamacpp)


def parse_chunk(chunk: Any, choice: int = 0, where: str = "chunk") -> Frame | None:
    """What one chunk says about choice `choice`; None when it says nothing (usage)."""
    if not isinstance(chunk, Mapping):
        raise RealignError(f"{where}: expected a JSON object, got {wire.type_name(chunk)}")
    ext = chunk.get("tokentrail")
    if ext is not None and not isinstance(ext, Mapping):
        raise RealignError(f"{where}.tokentrail must be an object, got {wire.type_name(ext)}")
    for dialect in CHUNK_DIALECTS:
        if dialect.claims(chunk):
            return dialect.parse(chunk, choice, where)
    if ext is not None:
        return Frame(ext=ext)
    if "error" in chunk:
        err = chunk["error"]
        msg = err.get("message") if isinstance(err, Mapping) else err
        return Frame(error=str(msg))
    raise RealignError(
        f"{where}: not a chunk of a known format (no 'choices', no llama.cpp "
        "'content' and 'stop', no 'tokentrail')"
    )
