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
    #: Its frames say which distribution their logprobs come from (the extension's
    #: ``distribution``), and the reader passes that on (`StepReader`).
    says_distribution = True
    takes_ignore_eos = True

    def sampling_fields(self, params: SamplingParams) -> dict[str, Any]:
        out: dict[str, Any] = {"top_k": params.top_k, "min_p": params.min_p}
        if params.repetition_penalty:
            out["repetition_penalty"] = params.repetition_penalty
        return out

    def logprobs_fields(self, mode: str) -> dict[str, Any]:
        """Another tokentrail takes the logprobs mode per request (its extension's
        ``logprobs``) and names the distribution in every frame."""
        return {"tokentrail": {"logprobs": mode}}

    def constraint_fields(self, constraint: Any) -> dict[str, Any]:
        return {"structured_outputs": vllm_structured_outputs(constraint.kind, constraint.source)}
