"""Teacher-forced logprobs at every position of a token sequence on vLLM: what ``echo``
with ``logprobs`` lists for a prompt on ``serve --engine vllm``, and where a ``branch``
prefix is scored.

vLLM computes them itself: one request of the ids with ``prompt_logprobs`` k and one
greedy token, run by the engine's `AsyncLLM` beside whatever else it is running. Each
position comes back as vLLM's sample logprobs do ({id: Logprob(logprob, rank)}, the top
k and the token itself) and is read the same way (`steps.step_from_logprobs`). They are
vLLM's raw logprobs, the model's distribution before any processor. An offline
``vllm.LLM`` (one stream at a time) has none to give here.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from ..base import Row
from .steps import step_from_logprobs

__all__ = ["position_rows"]


def position_rows(engine: Any, ids: Sequence[int], n: int, k: int) -> list[Row] | None:
    """For each of `ids[n:]`, vLLM's logprob of it after the ids before it and the `k`
    most likely (id, logprob), most likely first; None for an offline ``vllm.LLM``."""
    ids = [int(i) for i in ids]
    if not 1 <= n <= len(ids):
        raise ValueError(f"n must be in 1..{len(ids)}, got {n}")
    if n == len(ids):
        return []
    if engine.offline:
        return None
    found = engine.submit(_prompt_logprobs(engine.engine, ids, k)).result()
    if found is None or len(found) != len(ids):
        raise RuntimeError(f"vLLM returned no prompt logprobs for {len(ids)} tokens")
    rows: list[Row] = []
    for i in range(n, len(ids)):
        step = step_from_logprobs(ids[i], found[i], k)
        rows.append((step.logprob, list(step.top_logprobs)))
    return rows


async def _prompt_logprobs(llm: Any, ids: list[int], k: int) -> Any:
    """vLLM's ``prompt_logprobs`` of `ids` (one entry per id, None first)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sampling = SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )  # fmt: skip
    final = None
    request_id = f"tokentrail-score-{uuid.uuid4().hex}"
    stream = llm.generate({"prompt_token_ids": ids}, sampling, request_id)
    try:
        async for output in stream:
            final = output
    finally:
        await stream.aclose()
    return None if final is None else final.prompt_logprobs
