"""Constrained decoding through llguidance: JSON schemas, JSON objects, regexes, choices
and Lark/GBNF grammars, applied as a token mask on every in-process engine.

Why llguidance (not xgrammar): it is the library LM Studio's mlx-engine, llama.cpp
(`llama_sampler_init_llg`) and vLLM's `guidance` backend use; it ships a wheel with
helpers for numpy, torch and MLX, computes a mask in tens of microseconds without
precompiling per-vocabulary tables (a new schema costs no warm-up per request), takes
a tokenizer from raw token bytes (so llama.cpp's GGUF vocabularies work, not only
Hugging Face tokenizers), and reads Lark and GBNF grammars as well as JSON schemas.

    c = constraint_from(json_schema={"type": "object", ...}).bind(tokenizer)
    params = make_params(temp=0.7, constraint=c)       # every engine applies the mask

Per step, engines report on `Step` which distribution `logprob`/`top_logprobs` carry
(`distribution`: "raw", the model's own before the mask, by default; "processed" with
`logprobs_mode="processed"`) and `allowed_mass`: the probability the model put on the
tokens the grammar allowed.

With a reasoning format, `Constraint.after_reasoning(end_markers)` applies the constraint
to the content after the reasoning, as vLLM does: the guide leaves the logits unmasked
(`Guide.active` False, no allowed mass) until the end marker has been generated (`gate`).
"""

from ..errors import ConstraintError
from .guide import Guide
from .lltokenizer import lltokenizer_for
from .spec import (
    Constraint,
    Kind,
    constraint_from,
    from_response_format,
    from_structured_outputs,
)

__all__ = [
    "Constraint",
    "ConstraintError",
    "Guide",
    "Kind",
    "constraint_from",
    "from_response_format",
    "from_structured_outputs",
    "lltokenizer_for",
]
