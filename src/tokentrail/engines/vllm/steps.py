"""vLLM's outputs as tokentrail Steps: one `Step` per generated token, with the sampled
token's logprob and the top-k alternatives vLLM returned for its position.

Under structured outputs vLLM applies the grammar's bitmask to the logits before it
computes any logprobs (its ``raw_logprobs`` included): a forbidden token comes back at
minus infinity and the allowed ones share all the probability. Those steps say so:
`distribution` "masked" (`distribution_of`), not "raw", which promises the model's own
distribution before the mask (what tokentrail's MLX, torch and llama.cpp engines and
llama-server report), and `allowed_mass` stays None: vLLM never shows the mass the
mask took away."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...sampling import SamplingParams
from ..base import Step

__all__ = ["distribution_of", "step_from_logprobs", "steps_from_completion"]


def distribution_of(params: SamplingParams) -> str:
    """The distribution vLLM's logprobs come from for a request of `params`: "masked"
    under a constraint (see the module), else "raw"."""
    return "masked" if params.constraint is not None else "raw"


def steps_from_completion(completion: Any, k: int, distribution: str = "raw") -> list[Step]:
    """The Steps of one DELTA `CompletionOutput`: its new token ids with their logprobs."""
    logprobs = completion.logprobs
    return [
        step_from_logprobs(tid, None if logprobs is None else logprobs[i], k, distribution)
        for i, tid in enumerate(completion.token_ids)
    ]


def step_from_logprobs(
    token: int, position: Mapping[int, Any] | None, k: int, distribution: str = "raw"
) -> Step:
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
    return Step(token, float(position[token].logprob), top, None, False, distribution)
