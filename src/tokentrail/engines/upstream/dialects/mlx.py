"""mlx_lm.server's dialect (no logprobs in its streams, no token-id prompts)."""

from __future__ import annotations

from typing import Any

from .base import CompletionAsk, UpstreamDialect, openai_body

__all__ = ["MLXDialect"]


class MLXDialect(UpstreamDialect):
    """mlx_lm.server (on Python's http.server, Server header "BaseHTTP..."): its streams
    carry no logprobs and it takes no token-id prompts, so a request is sent whole with
    the prompt as text (re-tokenized upstream) and its tokens streamed on once complete."""

    name = "mlx"
    startup_warning = (
        "is mlx_lm.server: its streams carry no logprobs and it takes no token-id prompts, "
        "so each request is sent whole with the prompt as text (re-tokenized upstream) and "
        "streamed on once complete"
    )

    def claims(self, owners: set[str], server_header: str) -> bool:
        return server_header.startswith("BaseHTTP")

    def completion_body(self, ask: CompletionAsk) -> tuple[str, dict[str, Any]]:
        params = ask.params
        body = openai_body(ask)
        body["prompt"] = ask.prompt_text(ask.prompt_ids)
        body["stream"] = False
        body["logprobs"] = True
        body["top_logprobs"] = max(1, params.top_logprobs)
        if params.top_k:
            body["top_k"] = params.top_k
        if params.min_p:
            body["min_p"] = params.min_p
        if params.repetition_penalty:
            body["repetition_penalty"] = params.repetition_penalty
        return "/v1/completions", body
