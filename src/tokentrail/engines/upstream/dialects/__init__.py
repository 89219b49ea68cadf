"""One class per upstream dialect: everything that differs between the servers
``serve --upstream`` talks to, in one place the proxy and ``tokentrail check`` share.

`UpstreamDialect` is OpenAI's ``/v1/completions`` as any compatible server takes it; a
subclass overrides what its server does otherwise:

- how it is recognised (`UpstreamDialect.owned_by` in /v1/models, or its Server header);
- what a completion request asks for (`UpstreamDialect.completion_request`: the path and
  body, token ids, sampling fields, the constraint and logprobs-mode fields of
  `UpstreamDialect.request_fields`, or the `ConstraintError` naming the request field);
- what a chat request adds (`UpstreamDialect.chat_fields`, `UpstreamDialect.whole_chat`);
- how many requests it runs at once (`UpstreamDialect.slots_probe`, else
  `UpstreamDialect.default_capacity`);
- what the engine logs and check's report notes about it.

`DIALECTS` maps each ``--upstream-dialect`` name to its instance; `pick_dialect` is
``auto``: the dialect a server's /v1/models answer and Server header name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .base import CompletionAsk, OpenAIDialect, UpstreamDialect
from .llamacpp import LlamaCppDialect
from .mlx import MLXDialect
from .tokentrail import TokentrailDialect
from .vllm import VLLM_CAPACITY, VLLMDialect

__all__ = [
    "DIALECTS",
    "VLLM_CAPACITY",
    "CompletionAsk",
    "LlamaCppDialect",
    "MLXDialect",
    "OpenAIDialect",
    "TokentrailDialect",
    "UpstreamDialect",
    "VLLMDialect",
    "dialect_named",
    "model_owners",
    "pick_dialect",
]

#: Every dialect by its ``--upstream-dialect`` name (in the flag's order, after "auto").
DIALECTS: dict[str, UpstreamDialect] = {
    d.name: d
    for d in (VLLMDialect(), LlamaCppDialect(), OpenAIDialect(), TokentrailDialect(), MLXDialect())
}
#: The order `pick_dialect` asks the dialects in (the first that claims a server wins;
#: none: openai).
_DETECTION = ("llamacpp", "vllm", "tokentrail", "mlx")


def dialect_named(dialect: str | UpstreamDialect) -> UpstreamDialect:
    """The dialect called `dialect` (a dialect object is returned as it is);
    ValueError naming the choices for an unknown name."""
    if isinstance(dialect, UpstreamDialect):
        return dialect
    try:
        return DIALECTS[dialect]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown upstream dialect {dialect!r}; use one of {tuple(DIALECTS)}"
        ) from None


def model_owners(models: Any) -> set[str]:
    """The ``owned_by`` values of a /v1/models answer (anything else: none)."""
    data = models.get("data") if isinstance(models, Mapping) else None
    if not isinstance(data, list | tuple):
        return set()
    return {str(m.get("owned_by", "")) for m in data if isinstance(m, Mapping)}


def pick_dialect(models: Any, server_header: str) -> UpstreamDialect:
    """The dialect of a server whose /v1/models answered `models` (its JSON, or None)
    and whose Server header is `server_header` (``--upstream-dialect auto``)."""
    owners = model_owners(models)
    for name in _DETECTION:
        if DIALECTS[name].claims(owners, server_header or ""):
            return DIALECTS[name]
    return DIALECTS["openai"]
