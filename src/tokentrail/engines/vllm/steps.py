"""vLLM's outputs as tokentrail Steps: one `Step` per generated token, with the sampled
token's logprob and the top-k alternatives vLLM returned for its position."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..base import Step

__all__ = ["step_from_logprobs", "steps_from_completion"]


def steps_from_completion(completion: Any, k: int) -> list[Step]:
    """The Steps of one DELTA `CompletionOutput`: its new token ids with their logprobs."""
    logprobs = completion.logprobs
    return [
        step_from_logprobs(tid, None if logprobs is None else logprobs[i], k)
        for i, tid in enumerate(completion.token_ids)
    ]


def step_from_logprobs(token: int, position: Mapping[int, Any] | None, k: int) -> Step:
    """A Step from one position of vLLM's sample logprobs: {id: Logprob(logprob, rank)}.

    vLLM returns the top-k plus the sampled token when it is not among them (with its
    true rank), so the alternatives are the entries ranked 1..k, most likely first.
    """
    token = int(token)
    if position is None or token not in position:
        raise RuntimeError(
            f"vLLM returned no logprob for generated token {token}; was the request made "
            "with logprobs set (tokentrail always sets it)?"
        )
    entries = [
        (int(tid), float(e.logprob), getattr(e, "rank", None)) for tid, e in position.items()
    ]
    if k:
        ranked = [e for e in entries if e[2] is not None]
        if len(ranked) == len(entries):
            chosen = sorted((e for e in entries if e[2] <= k), key=lambda e: (e[2], -e[1]))[:k]
        else:  # no ranks: the k most likely entries
            chosen = sorted(entries, key=lambda e: -e[1])[:k]
        top = [(tid, lp) for tid, lp, _ in chosen]
    else:
        top = []
    return Step(token, float(position[token].logprob), top, None)
