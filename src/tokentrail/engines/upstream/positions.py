"""Teacher-forced logprobs at every position of a prompt, asked of the upstream: what
``echo`` with ``logprobs`` lists for a prompt through the proxy.

vLLM computes them itself: one ``/v1/completions`` request of the ids with its
``prompt_logprobs`` k and one greedy token. Each position comes back as JSON, ``{"id":
{"logprob", "rank", "decoded_token"}}`` (the top k and the token itself, with its true
rank), read as vLLM's sample logprobs are (`vllm.steps.step_from_logprobs`): the
model's raw distribution, before any processor. The other dialects have no prompt
logprobs to give (llama-server computes none; an OpenAI-compatible server that does has
no common field for them), and the reason says so.

The request is a blocking HTTP call: the server makes it off its event loop
(`server.echo.fetch_prompt_rows`, in a thread) before the request joins the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from ...errors import UpstreamError
from ..base import Row
from ..vllm.steps import step_from_logprobs
from .wire import status_error

__all__ = ["position_rows"]


def position_rows(
    engine: Any, ids: Sequence[int], n: int, k: int
) -> tuple[list[Row] | None, str | None]:
    """For each of `ids[n:]`, the upstream's logprob of it after the ids before it and
    the `k` most likely (id, logprob), most likely first; (None, why) where the
    upstream's dialect has none to give. `UpstreamError` where it fails."""
    ids = [int(i) for i in ids]
    if not 1 <= n <= len(ids):
        raise ValueError(f"n must be in 1..{len(ids)}, got {n}")
    if engine.dialect != "vllm":
        return None, (
            f"the upstream ({engine.dialect} dialect) has no prompt logprobs to give "
            "(a vLLM upstream has: its prompt_logprobs)"
        )
    if n == len(ids):
        return [], None
    body: dict[str, Any] = {"prompt": ids, "max_tokens": 1, "temperature": 0.0,
                            "prompt_logprobs": max(k, 0)}  # fmt: skip
    if engine.model is not None:
        body["model"] = engine.model
    import httpx

    try:
        r = engine.client.post("/v1/completions", json=body)
    except httpx.HTTPError as e:
        raise engine.transport_error(e) from e
    if r.status_code >= 400:
        raise status_error(r.status_code, r.text, engine.url + "/v1/completions")
    try:
        found = r.json()["choices"][0]["prompt_logprobs"]
    except (ValueError, KeyError, IndexError, TypeError):
        found = None
    if not isinstance(found, list) or len(found) != len(ids):
        raise UpstreamError(f"the upstream returned no prompt logprobs for {len(ids)} tokens")
    return [_row(ids[i], found[i], k) for i in range(n, len(ids))], None


def _row(token: int, position: Any, k: int) -> Row:
    """One position of vLLM's JSON ``prompt_logprobs`` as a `Row`."""
    if not isinstance(position, dict):
        raise UpstreamError(f"the upstream's prompt logprobs list no entry for token {token}")
    entries = {}
    for key, entry in position.items():
        try:
            lp, rank = float(entry["logprob"]), entry.get("rank")
            entries[int(key)] = SimpleNamespace(logprob=lp, rank=rank)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise UpstreamError(f"the upstream's prompt logprobs hold {entry!r}") from None
    try:
        step = step_from_logprobs(token, entries, k)
    except RuntimeError as e:
        raise UpstreamError(str(e)) from None
    return step.logprob, list(step.top_logprobs)
