"""mlx_lm.server's request fields beyond OpenAI's, as an mlx-lm user sends them here.

mlx-lm's server reads a few fields of its own from the body (`mlx_lm/server.py`). Each
is honoured, refused with a 400 naming it, or accepted where it cannot change the
answer (the same rule as `server.vllm_fields` and `server.llamacpp_fields`):

- ``repetition_context_size``, ``presence_context_size``, ``frequency_context_size``:
  how many recent tokens a penalty looks at. The window is each engine's own (mlx-lm's
  20 on MLX and torch, llama.cpp's 64, vLLM's whole sequence), so a size is accepted
  at mlx-lm's default, 20, or while its penalty is off, and refused otherwise;
- ``adapters``, ``draft_model``, ``role_mapping``: another model or template than the
  one served; refused unless null;
- ``num_draft_tokens``: speculative decoding's draft length, which does not change the
  answer: accepted without effect;
- ``xtc_probability`` and ``xtc_threshold`` are llama.cpp's fields too
  (`server.llamacpp_fields`).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field

from ..errors import APIError

__all__ = ["MlxFields", "mlx_extras"]

#: mlx-lm's default window for each penalty, and the request field of the penalty.
WINDOW = 20
_WINDOWS = {
    "repetition_context_size": "repetition_penalty",
    "presence_context_size": "presence_penalty",
    "frequency_context_size": "frequency_penalty",
}
_OTHER_MODEL = {
    "adapters": "the server's model is used as loaded",
    "draft_model": "the server's model decodes alone",
    "role_mapping": "the model's own chat template is used",
}


#: A penalty's window in tokens, as mlx-lm takes it.
WindowSize = Annotated[int, Field(ge=0)]


class MlxFields(BaseModel):
    """mlx_lm.server's fields that chat and completions share (see the module)."""

    repetition_context_size: WindowSize | None = None
    presence_context_size: WindowSize | None = None
    frequency_context_size: WindowSize | None = None
    adapters: Any = None
    draft_model: Any = None
    role_mapping: Any = None
    num_draft_tokens: Any = None  # accepted: speculative decoding keeps the answer


def mlx_extras(wire: Any, req: Any) -> None:
    """Refuse the fields of `wire` (a request with `MlxFields`) that would change the
    answer here (APIError 400 naming the field); `req` is its `GenRequest`."""
    for name, penalty in _WINDOWS.items():
        value = getattr(wire, name)
        if value is None:
            continue
        off = (None, 1.0) if penalty == "repetition_penalty" else (None, 0.0)
        if value != WINDOW and getattr(req, penalty) not in off:
            raise APIError(
                400, f"'{name}' is not supported here: the penalty looks at each engine's "
                f"own window (mlx-lm's {WINDOW} tokens on MLX); only {WINDOW} is accepted "
                f"with '{penalty}' on", param=name, code="unsupported_value",
            )  # fmt: skip
    for name, why in _OTHER_MODEL.items():
        if getattr(wire, name) is not None:
            raise APIError(400, f"'{name}' is not supported: {why}", param=name,
                           code="unsupported_value")  # fmt: skip
