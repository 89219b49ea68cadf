"""llama.cpp's llama-server dialect (its own ``/completion``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..constraints import gbnf_tokens, llamacpp_fields
from .base import CompletionAsk, UpstreamDialect, ids_only, penalty_fields

__all__ = ["LlamaCppDialect"]


class LlamaCppDialect(UpstreamDialect):
    """llama.cpp's llama-server: its own ``/completion`` with ``return_tokens`` and
    ``n_probs`` (exact ids and counts in every frame), ``json_schema`` or GBNF
    ``grammar`` for constraints, its slots on /props."""

    name = "llamacpp"
    owned_by = "llamacpp"
    slots_probe = ("/props", "total_slots")
    processed_why = "llama-server's n_probs are the model's own distribution"
    takes_ignore_eos = True

    def completion_body(self, ask: CompletionAsk) -> tuple[str, dict[str, Any]]:
        params, max_tokens = ask.params, ask.max_tokens
        body: dict[str, Any] = {
            "prompt": list(ask.prompt_ids),
            "n_predict": -1 if max_tokens is None else max_tokens,
            "stream": True,
            "return_tokens": True,
            "cache_prompt": True,
            "temperature": params.temp,
            "repeat_penalty": params.repetition_penalty or 1.0,
        }
        if params.temp > 0:
            # Greedy decoding takes the highest logit whatever top-k, top-p or min-p
            # keep (each keeps it), so they are sent only to sampling: left out, llama-
            # server's own defaults cut the candidates to 40 before its temperature and
            # sampling steps, where "no filter" (0, 1, 0) has them walk the whole
            # vocabulary for every token (10% of its CPU per token on the demo model,
            # benchmarks/results/proxy-cpu.md). The request is then the one a greedy
            # client of llama-server sends itself.
            body.update(top_p=params.top_p, top_k=params.top_k, min_p=params.min_p)
        if not ids_only(params):
            body["n_probs"] = max(1, params.top_logprobs)
        if params.seed is not None:
            body["seed"] = params.seed
        if params.logit_bias:
            body["logit_bias"] = [[int(i), float(b)] for i, b in params.logit_bias.items()]
        body.update(penalty_fields(params))
        return "/completion", body

    def completion_request(self, ask: CompletionAsk) -> tuple[str, dict[str, Any]]:
        """As every dialect's, except that a constraint that forces the whole answer (one
        choice) is sent as its canonical tokens (GBNF token literals): tokentrail's own
        constrained decoding writes forced text in the tokenizer's own tokens, while
        llama-server's grammar of characters lets its sampler spell it in any ("Chopin"
        as C+hop+i+n, 26 nats less likely than Ch+opin on SmolLM2)."""
        path, body = super().completion_request(ask)
        ids = _forced_ids(ask)
        if ids is not None:
            body["grammar"] = gbnf_tokens(ids)
        return path, body

    def constraint_fields(self, constraint: Any) -> dict[str, Any]:
        return llamacpp_fields(constraint.kind, constraint.source, constraint.param)

    def whole_chat(self, payload: Mapping[str, Any]) -> bool:
        # llama-server refuses logprobs on a streamed request with tools.
        return bool(payload.get("tools"))


def _forced_ids(ask: CompletionAsk) -> list[int] | None:
    """The canonical ids of the one text `ask`'s constraint allows (a single choice),
    or None: no such constraint, or no canonical spelling of it."""
    c = ask.params.constraint
    if c is None or c.kind != "choice" or ask.canonical is None:
        return None
    options = json.loads(c.source)
    return ask.canonical(options[0]) if len(options) == 1 else None
