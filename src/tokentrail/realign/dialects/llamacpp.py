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


#: What `plain_frame` reads from llama.cpp's usual streamed frame: (content, the token's
#: id, its logprob, its alternatives as (id, logprob) pairs, ``tokens_predicted``).
PlainFrame = tuple[str, int, float, list[tuple[int, float]], int]


def _plain_entry(e: dict[str, Any]) -> tuple[int, float] | None:
    """(id, logprob) of an entry in llama.cpp's own shape (an integer id, a string token,
    a finite float logprob, a valid ``bytes`` list) with no ``top_probs`` or ``probs``;
    None for anything else. Its list of alternatives is the caller's to read."""
    tid, lp, raw = e.get("id"), e.get("logprob"), e.get("bytes")
    if (
        tid.__class__ is not int
        or e.get("token").__class__ is not str
        or lp.__class__ is not float
        or raw.__class__ is not list
        or not lp > wire.WIRE_NEG_INF
        or "top_probs" in e
        or "probs" in e
    ):
        return None
    try:
        bytes(raw)  # (checked as `parse` checks it, though the id, not these, is read)
    except (TypeError, ValueError):
        return None
    return tid, lp


def plain_frame(chunk: dict[str, Any]) -> PlainFrame | None:
    """llama.cpp's usual streamed frame, read without building its `Frame`: one token
    (``tokens`` is its id alone, and ``completion_probabilities`` one entry for it in
    llama.cpp's own shape, its alternatives with no lists of their own), a
    ``tokens_predicted`` count, not the last frame. None for any other chunk, which
    `parse` then reads (or says what is wrong with): this reads the same values `parse`
    would, and nothing `parse` would refuse."""
    probs = chunk.get("completion_probabilities")
    ids = chunk.get("tokens")
    if (
        probs.__class__ is not list
        or len(probs) != 1
        or ids.__class__ is not list
        or len(ids) != 1
        or ids[0].__class__ is not int
        or "choices" in chunk
        or "tokentrail" in chunk
        or chunk.get("stop")
    ):
        return None
    content, n, e = chunk.get("content"), chunk.get("tokens_predicted"), probs[0]
    if content.__class__ is not str or n.__class__ is not int or e.__class__ is not dict:
        return None
    own = _plain_entry(e)
    if own is None or own[0] != ids[0]:
        return None
    top = e.get("top_logprobs")
    alts: list[tuple[int, float]] = []
    if top is not None:
        if top.__class__ is not list:
            return None
        for t in top:
            alt = _plain_entry(t) if t.__class__ is dict and "top_logprobs" not in t else None
            if alt is None:
                return None
            alts.append(alt)
    return content, own[0], own[1], alts, n
