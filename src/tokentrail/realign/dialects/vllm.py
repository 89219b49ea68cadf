"""vLLM's explicit token ids: ``token_ids`` on each choice (``return_token_ids``).

vLLM (>= 0.10.2) answers ``"return_token_ids": true`` with the ids of the tokens each
chunk carries, in a ``token_ids`` list on the choice, next to the usual logprobs (whose
entries, if any, are in the same order). The ids are exact; the logprobs entries only
lend their logprob and alternatives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import wire
from ..result import RealignError
from ..wire import Frame, WireToken

NAME = "vllm-token-ids"


def claims(choice: Mapping[str, Any]) -> bool:
    """Whether this choice carries vLLM's ids."""
    return choice.get("token_ids") is not None


def attach(choice: Mapping[str, Any], entries: list[WireToken], where: str, frame: Frame) -> None:
    """vLLM `token_ids`: the ids, with the logprobs entries (same order) attached."""
    ids = choice["token_ids"]
    if not isinstance(ids, list) or not all(wire.is_int(i) for i in ids):
        raise RealignError(f"{where}.token_ids must be a list of integers")
    if entries and len(entries) != len(ids):
        raise RealignError(f"{where}: {len(ids)} token_ids but {len(entries)} logprobs entries")
    for k, tid in enumerate(ids):
        e = entries[k] if entries else None
        frame.tokens.append(
            WireToken(
                tid,
                logprob=e.logprob if e else None,
                top=e.top if e else None,
                source=NAME,
            )
        )


#: What `plain_frame` reads from vLLM's usual streamed completions frame: (text, the
#: token's id, its logprob or None, its alternatives as (``token_id:N`` string, logprob)
#: pairs, or None where the frame lists none).
PlainFrame = tuple[str, int, float | None, list[tuple[str, float]] | None]


def plain_frame(chunk: dict[str, Any], choice: int) -> PlainFrame | None:
    """vLLM's usual streamed ``/v1/completions`` frame for choice `choice`, read without
    building its `Frame`: one choice, with ``text`` and ``token_ids`` of one id, and no
    logprobs, or logprobs of that one token (a finite float; alternatives keyed
    ``token_id:N`` with finite floats); no ``finish_reason``, no usage or ``timings``,
    no extension. None for any other chunk, which the general path (`openai.parse` and
    `attach`) then reads, or says what is wrong with: this reads the same values it
    would, and nothing it would refuse. The alternatives' ids are the caller's to read
    (`token_ids.identify`), as the general path reads them."""
    choices = chunk.get("choices")
    if (
        choices.__class__ is not list
        or len(choices) != 1
        or "tokentrail" in chunk
        or chunk.get("usage") is not None
        or "timings" in chunk
    ):
        return None
    ch = choices[0]
    if ch.__class__ is not dict or ch.get("index", 0) != choice:
        return None
    text, ids, lps = ch.get("text"), ch.get("token_ids"), ch.get("logprobs")
    if (
        text.__class__ is not str
        or ids.__class__ is not list
        or len(ids) != 1
        or ids[0].__class__ is not int
        or ch.get("finish_reason") is not None
        or "delta" in ch
        or "message" in ch
    ):
        return None
    if lps is None:
        return text, ids[0], None, None
    if lps.__class__ is not dict or "content" in lps:
        return None
    tokens, values, tops = lps.get("tokens"), lps.get("token_logprobs"), lps.get("top_logprobs")
    if (
        tokens.__class__ is not list
        or len(tokens) != 1
        or tokens[0].__class__ is not str
        or values.__class__ is not list
        or len(values) != 1
        or tops.__class__ is not list
        or len(tops) != 1
        or tops[0].__class__ is not dict
    ):
        return None
    lp = values[0]
    if lp.__class__ is not float or not lp > wire.WIRE_NEG_INF:
        return None
    alts = []
    for name, v in tops[0].items():
        if v.__class__ is not float or not v > wire.WIRE_NEG_INF:
            return None
        alts.append((name, v))
    return text, ids[0], lp, alts or None
