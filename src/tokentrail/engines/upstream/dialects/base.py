"""`UpstreamDialect`: OpenAI's ``/v1/completions`` as any compatible server takes it,
with a method or attribute for everything another dialect does otherwise (see the
package); `OpenAIDialect` is it unchanged."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ....errors import ConstraintError
from ....sampling import SamplingParams
from ...batch import UPSTREAM_CAPACITY
from ..constraints import check_sendable

__all__ = ["CompletionAsk", "OpenAIDialect", "UpstreamDialect", "ids_only", "openai_body"]


@dataclass(frozen=True, slots=True)
class CompletionAsk:
    """One completion request as the engine asks it: `max_tokens` tokens after
    `prompt_ids` under `params`, for `model` (None: no ``model`` field); `prompt_text`
    turns the ids into text for a dialect that takes no token-id prompt."""

    prompt_ids: Sequence[int]
    params: SamplingParams
    max_tokens: int | None
    model: str | None
    prompt_text: Callable[[Sequence[int]], str]
    #: A text's canonical token ids (the tokenizer's own spelling of it alone), or None
    #: where they do not spell exactly its bytes: for a dialect that can force tokens.
    canonical: Callable[[str], list[int] | None] | None = None


def ids_only(params: SamplingParams) -> bool:
    """No logprob is wanted (`SamplingParams.logprobs` False, no ``top_logprobs``): a
    dialect that sends ids without logprobs asks for the ids alone. Top-k costs the
    upstream a sort of its vocabulary per token, and both sides a larger frame."""
    return not params.logprobs and params.top_logprobs == 0


class UpstreamDialect:
    """An OpenAI-compatible server's dialect; the subclasses override what differs."""

    #: The ``--upstream-dialect`` name (`UpstreamEngine.dialect`, check's report).
    name = "openai"
    #: The ``owned_by`` by which the server's /v1/models names it (None: none does).
    owned_by: str | None = None
    #: Where the server says how many sequences it runs at once: (path, JSON key) of a
    #: GET answer, or None where it does not say.
    slots_probe: tuple[str, str] | None = None
    #: Requests kept in flight upstream when the server does not say (`slots_probe`).
    default_capacity = UPSTREAM_CAPACITY
    #: Logged as a warning when an engine starts on this dialect, after "upstream URL".
    startup_warning: str | None = None
    #: A note for check's report on a server of this dialect (e.g. that no server of
    #: that kind has been run against here); None: nothing to note.
    check_note: str | None = None
    #: Why a per-request ``logprobs_mode`` other than raw cannot be asked.
    processed_why = ""
    #: The distribution the upstream's logprobs come from under a constraint it
    #: applies: "raw" (the model's own, before the mask, as llama-server's n_probs) or
    #: "masked" (after it: `tokentrail.engines.base.Step.distribution`).
    constrained_distribution = "raw"
    #: Whether each frame names its distribution (a tokentrail upstream's extension),
    #: which then labels the steps instead of `constrained_distribution`.
    says_distribution = False
    #: Whether the completion stream lists token ids without logprobs being asked.
    ids_without_logprobs = False
    #: Whether it takes vLLM's ``ignore_eos`` (`SamplingParams.ignore_eos`); where it
    #: does not, such a request is refused rather than ended at the first end token.
    takes_ignore_eos = False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

    # -- recognition --

    def claims(self, owners: set[str], server_header: str) -> bool:
        """Whether a server whose /v1/models lists `owners` and whose Server header is
        `server_header` speaks this dialect."""
        return self.owned_by is not None and self.owned_by in owners

    # -- completions --

    def completion_request(self, ask: CompletionAsk) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) for `ask`. Never silently unconstrained: the constraint and
        the logprobs mode go in the dialect's own fields (`request_fields`), or a
        `ConstraintError` names the request field."""
        params = ask.params
        extra = self.request_fields(params.constraint, params.logprobs_mode)
        if params.constraint is not None or params.logprobs_mode != "raw":
            params = replace(params, constraint=None, logprobs_mode="raw")
            ask = replace(ask, params=params)
        path, body = self.completion_body(ask)
        if params.ignore_eos:
            if not self.takes_ignore_eos:
                raise ConstraintError(
                    f"ignore_eos: the upstream ({self.name} dialect) takes no such field, "
                    "so its replies would end at the first end token; use a vLLM, "
                    "llama.cpp or tokentrail upstream",
                    "ignore_eos",
                )
            extra["ignore_eos"] = True
        return path, {**body, **extra}

    def completion_body(self, ask: CompletionAsk) -> tuple[str, dict[str, Any]]:
        """`completion_request` before the constraint's fields: ``/v1/completions``,
        streamed, with ``logprobs`` (token strings, ``bytes:`` forms) and usage."""
        params = ask.params
        body = openai_body(ask)
        if not (self.ids_without_logprobs and ids_only(params)):
            body["logprobs"] = max(1, params.top_logprobs)
        body["stream_options"] = {"include_usage": True}
        body.update(self.sampling_fields(params))
        body.update(self.id_fields())
        return "/v1/completions", body

    def sampling_fields(self, params: SamplingParams) -> dict[str, Any]:
        """Sampling fields beyond OpenAI's (temperature, top_p, seed, logit_bias)."""
        return {}

    def id_fields(self) -> dict[str, Any]:
        """Fields asking a completion stream for each token's exact id."""
        return {}

    def request_fields(self, constraint: Any, logprobs_mode: str) -> dict[str, Any]:
        """The body fields asking for `constraint` (a `Constraint` or None) and
        `logprobs_mode` ("raw" or "processed"); ``{}`` when there is nothing to ask."""
        fields: dict[str, Any] = {}
        if constraint is not None:
            check_sendable(constraint)
            fields.update(self.constraint_fields(constraint))
        if logprobs_mode != "raw":
            fields.update(self.logprobs_fields(logprobs_mode))
        return fields

    def constraint_fields(self, constraint: Any) -> dict[str, Any]:
        """The fields for one constraint; `ConstraintError` naming its ``param`` when the
        dialect has none."""
        param = constraint.param
        raise ConstraintError(
            f"{param}: the upstream ({self.name} dialect) takes no constraint tokentrail can "
            "pass on, and tokentrail does not mask in front of an upstream; use a vLLM, "
            "llama.cpp or tokentrail upstream",
            param,
        )

    def logprobs_fields(self, mode: str) -> dict[str, Any]:
        """The fields for logprobs `mode` (not "raw"): no dialect has a per-request choice
        today, so a `ConstraintError` naming ``tokentrail`` says why."""
        why = (
            self.processed_why
            or f"the {self.name} dialect has no per-request choice of distribution"
        )
        raise ConstraintError(
            f"tokentrail: logprobs {mode!r} cannot be asked of this upstream: {why}; "
            "it reports the raw distribution",
            "tokentrail",
        )

    # -- chat (``serve --upstream-chat``, ``tokentrail check``) --

    def chat_fields(self) -> dict[str, Any]:
        """What a chat stream is asked for beyond OpenAI's fields (the proxy's chat body
        and check's probes alike)."""
        return {}

    def whole_chat(self, payload: Mapping[str, Any]) -> bool:
        """Whether a chat request is sent whole (``stream`` false) and read as one chunk."""
        return False


def openai_body(ask: CompletionAsk) -> dict[str, Any]:
    """OpenAI's ``/v1/completions`` fields every dialect on that path shares."""
    params, model, max_tokens = ask.params, ask.model, ask.max_tokens
    body: dict[str, Any] = {
        "prompt": list(ask.prompt_ids),
        "stream": True,
        "temperature": params.temp,
        "top_p": params.top_p,
    }
    if model is not None:
        body["model"] = model
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if params.seed is not None:
        body["seed"] = params.seed
    if params.logit_bias:
        body["logit_bias"] = {str(i): b for i, b in params.logit_bias.items()}
    body.update(penalty_fields(params))
    return body


def penalty_fields(params: SamplingParams) -> dict[str, float]:
    """OpenAI's ``presence_penalty`` and ``frequency_penalty`` where set (llama-server,
    vLLM and mlx_lm.server take them under those names)."""
    out = {}
    if params.presence_penalty:
        out["presence_penalty"] = params.presence_penalty
    if params.frequency_penalty:
        out["frequency_penalty"] = params.frequency_penalty
    return out


class OpenAIDialect(UpstreamDialect):
    """Any other OpenAI-compatible server: ``logprobs`` (token strings, ``bytes:``
    forms); no constraint is passed on."""

    name = "openai"
