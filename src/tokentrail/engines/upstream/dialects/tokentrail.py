"""Another tokentrail server's dialect (its extension carries the ids)."""

from __future__ import annotations

from typing import Any

from ....sampling import SamplingParams
from ..constraints import vllm_structured_outputs
from .base import UpstreamDialect

__all__ = ["TokentrailDialect"]


class TokentrailDialect(UpstreamDialect):
    """Another tokentrail: its extension carries the ids; it reads vLLM's
    ``structured_outputs`` and says its ``max_batch`` on /health."""

    name = "tokentrail"
    owned_by = "tokentrail"
    slots_probe = ("/health", "max_batch")
    # A tokentrail upstream could send them (its `logprobs`), but the upstream engine's
    # steps do not carry the distribution they come from yet, so the proxy would label
    # them "raw".
    processed_why = "the proxy does not pass a tokentrail upstream's distribution on yet"

    def sampling_fields(self, params: SamplingParams) -> dict[str, Any]:
        out: dict[str, Any] = {"top_k": params.top_k, "min_p": params.min_p}
        if params.repetition_penalty:
            out["repetition_penalty"] = params.repetition_penalty
        return out

    def constraint_fields(self, constraint: Any) -> dict[str, Any]:
        return {"structured_outputs": vllm_structured_outputs(constraint.kind, constraint.source)}
