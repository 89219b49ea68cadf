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
