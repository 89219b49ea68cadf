"""A tokentrail constraint in an upstream's own request fields (``serve --upstream``).

In front of another server tokentrail applies no mask of its own: the upstream decodes
under its own structured outputs, and tokentrail attributes the tokens it sends and
computes the fields. Each dialect (`tokentrail.engines.upstream.dialects`) says which of
these forms it takes for a `Constraint` (any kind `tokentrail.constrain.constraint_from`
makes) and a ``logprobs_mode`` (its ``request_fields``):

- ``vllm`` (``/v1/completions``): ``structured_outputs`` with one of ``json`` (the
  schema), ``json_object``, ``regex``, ``choice`` or ``grammar`` (vLLM's
  `StructuredOutputsParams`, passed as given: vLLM's backend compiles it):
  `vllm_structured_outputs`;
- ``tokentrail`` (``/v1/completions``): the same ``structured_outputs`` (tokentrail reads
  vLLM's form);
- ``llamacpp`` (``/completion``): ``json_schema`` (llama-server turns the schema into a
  grammar itself; ``json_object`` is the schema ``{"type": "object"}``) or ``grammar``
  (GBNF); a choice becomes the GBNF alternation of its strings as literals:
  `llamacpp_fields`.

What a dialect cannot express is a `ConstraintError` naming the request field (the
constraint's `param`, e.g. ``response_format``, or ``tokentrail`` for the logprobs mode):
a regex or a Lark grammar on llama.cpp; any constraint on mlx_lm.server and plain OpenAI
upstreams; ``processed`` logprobs on every dialect but tokentrail's (vLLM's
``--logprobs-mode`` is one setting for the whole server; llama.cpp's ``n_probs`` are the
model's own; another tokentrail takes it per request and names its distribution in every
frame, which the proxy passes on); a constraint after tokentrail's reasoning
format on every dialect (`check_sendable`). A request is never answered with
unconstrained output.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ...errors import ConstraintError

__all__ = [
    "check_sendable", "gbnf_literal", "gbnf_tokens", "llamacpp_fields", "vllm_structured_outputs",
]


def check_sendable(constraint: Any) -> None:
    """`ConstraintError` naming the constraint's param when no upstream can be asked
    for it: one that applies after tokentrail's reasoning format."""
    if getattr(constraint, "after", ()):
        # The upstream would mask from the first token; tokentrail's reasoning format says
        # the reply starts in the reasoning, which no upstream request field can express.
        raise ConstraintError(
            f"{constraint.param}: a constraint after tokentrail's reasoning format cannot be "
            "sent upstream (the upstream would constrain the reasoning too); send it without "
            'reasoning ("tokentrail": {"reasoning": false}) or use the upstream\'s own '
            "reasoning parser",
            constraint.param,
        )


def vllm_structured_outputs(kind: str, source: str) -> dict[str, Any]:
    """vLLM's ``structured_outputs`` fields for one constraint (the proxy sends them as
    JSON; `tokentrail.engines.vllm.engine` builds vLLM's params object from them)."""
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        return {"json": json.loads(source)}
    if kind == "choice":
        return {"choice": json.loads(source)}
    return {kind: source}  # "regex" and "grammar" are given as text


def llamacpp_fields(kind: str, source: str, param: str) -> dict[str, Any]:
    """llama-server's ``/completion`` fields for one constraint."""
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    if kind == "json_schema":
        return {"json_schema": json.loads(source)}
    if kind == "choice":
        options = json.loads(source)
        return {"grammar": "root ::= " + " | ".join(gbnf_literal(c) for c in options)}
    if kind == "grammar":
        from llguidance.gbnf_to_lark import is_lark_syntax

        if is_lark_syntax(source):
            raise ConstraintError(
                f"{param}: llama-server reads GBNF grammars only, and this one is Lark "
                "(as llguidance reads it); send it in GBNF",
                param,
            )
        return {"grammar": source}
    raise ConstraintError(
        f"{param}: llama-server has no {kind} constraint (it takes json_schema and GBNF "
        "grammar); use a JSON schema or a grammar, or a vLLM upstream",
        param,
    )


def gbnf_literal(text: str) -> str:
    """`text` as one GBNF string literal (llama.cpp's grammars/README.md): quote and
    backslash escaped, control characters as ``\\xNN``, everything else as itself."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def gbnf_tokens(ids: Sequence[int]) -> str:
    """A GBNF grammar whose only sentence is the tokens `ids`, as token literals
    (``<[id]>``, llama.cpp's grammars/README.md): those very tokens, not merely their
    text, which a grammar of characters lets the sampler spell in any tokens."""
    return "root ::= " + " ".join(f"<[{int(i)}]>" for i in ids)
