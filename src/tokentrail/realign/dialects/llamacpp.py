"""llama.cpp's own ``/completion`` endpoint, streamed or whole, with ``n_probs``.

Each frame has ``content`` (the text it releases), ``tokens`` (the ids it carries; sent
by llama.cpp 0.3.x servers even without ``return_tokens``), ``tokens_predicted`` and,
with ``n_probs``, ``completion_probabilities`` entries (``id``, ``token``, ``bytes``,
``logprob``, ``top_logprobs``). llama.cpp sends no frame for a token that leaves an
incomplete character (or a possible stop string) and folds its bytes into the next
frame; ``tokens_predicted`` says how many tokens such a gap held.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import wire
from ..result import RealignError
from ..wire import Frame, WireToken

NAME = "llama.cpp"
#: Keys that, next to ``content``, mark a llama.cpp /completion object.
_KEYS = ("stop", "completion_probabilities", "tokens", "id_slot", "tokens_predicted")


def claims(chunk: Mapping[str, Any]) -> bool:
    """Whether the chunk is a llama.cpp /completion frame or response."""
    return "content" in chunk and "choices" not in chunk and any(k in chunk for k in _KEYS)


def parse(chunk: Mapping[str, Any], choice: int, where: str) -> Frame | None:
    """A llama.cpp /completion object (one streamed frame, or a whole response)."""
    frame = Frame(content=wire.text(chunk.get("content"), f"{where}.content"), folded_content=True)
    probs = chunk.get("completion_probabilities") or []
    if not isinstance(probs, list):
        raise RealignError(f"{where}.completion_probabilities must be a list")
    entries = []
    for k, e in enumerate(probs):
        # llama.cpp's own shape is read without naming where (only an error needs it).
        w = wire.plain_entry(e) if e.__class__ is dict else None
        if w is None:
            w = wire.entry(e, f"{where}.completion_probabilities[{k}]", "llama.cpp")
        entries.append(w)
    ids = chunk.get("tokens")
    if ids is not None and (not isinstance(ids, list) or not all(wire.is_int(i) for i in ids)):
        raise RealignError(f"{where}.tokens must be a list of integers")
    ids = ids or []
    if ids:
        # The token ids are complete; entries may miss tokens whose frame was dropped.
        k = 0
        for tid in ids:
            if k < len(entries) and entries[k].id in (tid, None):
                e = entries[k]
                k += 1
                frame.tokens.append(WireToken(tid, e.token, None, e.logprob, e.top, "llama.cpp"))
            else:
                frame.tokens.append(WireToken(tid, source="llama.cpp"))
        if k < len(entries):
            raise RealignError(f"{where}: completion_probabilities name ids that are not in tokens")
    else:
        for e in entries:
            if e.id is not None:
                e.source = "llama.cpp"
                e.folded = e.raw is not None
            frame.tokens.append(e if e.id is not None else wire.sourced(e))
    n = chunk.get("tokens_predicted")
    # A streamed frame's tokens are the last ones generated; so are none in the final
    # frame. A whole response's count says how many are missing, not where.
    if wire.is_int(n) and (not chunk.get("stop") or not frame.tokens):
        frame.first_index = n - len(frame.tokens)
    return frame
