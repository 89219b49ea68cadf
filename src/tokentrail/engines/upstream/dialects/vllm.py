"""vLLM's dialect (``/v1/completions`` with its token-id fields)."""

from __future__ import annotations

from typing import Any

from ....sampling import SamplingParams
from ..constraints import vllm_structured_outputs
from .base import UpstreamDialect

__all__ = ["VLLM_CAPACITY", "VLLMDialect"]

#: Requests kept in flight to a vLLM upstream, which does not say its ``max_num_seqs``:
#: the default of vLLM's OpenAI server on GPUs (arg_utils; 128 on CPU, 1024 on H100-class
#: GPUs). Requests beyond its own figure wait in vLLM's queue, as they would sent directly.
VLLM_CAPACITY = 256


class VLLMDialect(UpstreamDialect):
    """vLLM: ``return_token_ids`` and ``return_tokens_as_token_ids`` (exact ids,
    alternatives as ``token_id:N``), ``structured_outputs`` for constraints."""

    name = "vllm"
    owned_by = "vllm"
    default_capacity = VLLM_CAPACITY
    ids_without_logprobs = True  # vLLM's token_ids need no logprobs
    processed_why = (
        "vLLM sets its logprobs mode for the whole server (vllm serve --logprobs-mode), "
        "not per request"
    )
    # vLLM applies the grammar's bitmask to the logits before any logprobs (its
    # raw_logprobs included): a forbidden token is listed at -inf.
    constrained_distribution = "masked"
    takes_ignore_eos = True

    def sampling_fields(self, params: SamplingParams) -> dict[str, Any]:
        out: dict[str, Any] = {"top_k": params.top_k or -1, "min_p": params.min_p}
        if params.repetition_penalty:
            out["repetition_penalty"] = params.repetition_penalty
        return out

    def id_fields(self) -> dict[str, Any]:
        return {
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }

    def constraint_fields(self, constraint: Any) -> dict[str, Any]:
        return {"structured_outputs": vllm_structured_outputs(constraint.kind, constraint.source)}

    def chat_fields(self) -> dict[str, Any]:
        return {"return_token_ids": True}
