"""Every exception tokentrail raises on purpose, in one place.

Each class also subclasses the builtin callers caught before it existed, so
`except ValueError` keeps working; `except TokentrailError` catches them all::

    TokentrailError
    ├── TokenizerLoadError (ValueError)    a tokenizer that cannot be recognised or read
    │   └── UnsupportedGGUF                 a GGUF tokenizer model with no llama.cpp rule here
    ├── GGUFError (ValueError)              a GGUF file the chosen engine cannot run
    ├── ContextOverflow (ValueError)        a prompt or max_tokens past the model's context
    ├── SamplingError (ValueError)          a sampling setting out of range; `param` names it
    │   └── SamplingTypeError (TypeError)   a sampling setting of the wrong type
    ├── RealignError (ValueError)           an upstream chunk that cannot be understood
    ├── StructureError (ValueError)         a reasoning or tool-call parser name that is not
    │                                       known, or output that is not in the expected format
    ├── ConstraintError (ValueError)        a schema, regex, choice or grammar the grammar
    │                                       library cannot compile; `param` names the field
    ├── ActionError (ValueError)            an option that acts on confidence (alarm, ...)
    │   │                                   out of range; `param` names the key
    │   └── BranchError                     a branch from a token that cannot be taken
    │                                       (branch.ids, .at, .token)
    ├── ModelNotAvailable (FileNotFoundError)  a named model that is not on this machine
    ├── EngineError (RuntimeError)          an engine failure with an HTTP meaning
    │   └── UpstreamError                   a remote upstream that failed
    ├── CalibrationError (ValueError)       a calibration set or map that cannot be used
    │                                       (a bad line, a map fitted for another model)
    ├── UsageError                          bad command-line input: exit 2, one line
    └── APIError                            an HTTP error answered in OpenAI's shape
        └── QueueFull                       429: too many requests already waiting

`ClientGone` is not an error of anyone's input: the server raises it when a client hangs
up before its request was read, so that nobody is answered.

This module imports nothing from tokentrail, so every layer can raise from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

__all__ = [
    "APIError",
    "ActionError",
    "BranchError",
    "CalibrationError",
    "ClientGone",
    "ConstraintError",
    "ContextOverflow",
    "EngineError",
    "GGUFError",
    "ModelNotAvailable",
    "QueueFull",
    "RealignError",
    "SamplingError",
    "SamplingTypeError",
    "StructureError",
    "TokenizerLoadError",
    "TokentrailError",
    "UnsupportedGGUF",
    "UpstreamError",
    "UsageError",
]


class TokentrailError(Exception):
    """Base of every exception tokentrail raises on purpose."""


class TokenizerLoadError(TokentrailError, ValueError):
    """The tokenizer could not be recognised or read."""


class UnsupportedGGUF(TokenizerLoadError):
    """The GGUF tokenizer model has no llama.cpp rule here."""


class GGUFError(TokentrailError, ValueError):
    """A GGUF file that the chosen engine cannot run; the message names file and remedy."""


class ContextOverflow(TokentrailError, ValueError):
    """A request that does not fit the model's context. `param` names what to change:
    "prompt" when the prompt alone leaves no room, "max_tokens" when the limit asked
    for is past the room the prompt leaves."""

    def __init__(self, message: str, param: Literal["prompt", "max_tokens"]) -> None:
        super().__init__(message)
        self.param = param


class SamplingError(TokentrailError, ValueError):
    """A sampling setting out of its range; `param` names the setting (e.g. "top_p")."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class SamplingTypeError(SamplingError, TypeError):
    """A sampling setting of the wrong type (also a TypeError, as before it existed)."""


class RealignError(TokentrailError, ValueError):
    """A chunk could not be understood: it names the chunk and the field."""


class StructureError(TokentrailError, ValueError):
    """A reasoning or tool-call parser that is not known (the message lists the known
    names), or model output that is not in the format asked for (the message says where)."""


class ConstraintError(TokentrailError, ValueError):
    """A constraint (JSON schema, regex, choice list, grammar) that cannot be compiled, or
    that is used in a way it cannot be: `param` names the request field (e.g.
    "response_format") and the message gives the grammar library's reason."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class ActionError(TokentrailError, ValueError):
    """An option that acts on confidence (an alarm, ...) with a bad value, or asked
    where it cannot act: `param` names the key (e.g. "alarm.below")."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class BranchError(ActionError):
    """A branch (`stream_generate(branch=...)`, the server's ``branch`` option) that
    cannot be taken: ids the tokenizer cannot produce, a position past them, a prefix
    whose logprobs cannot be replayed. `param` names the key ("branch.ids", "branch.at",
    "branch.token")."""


class ModelNotAvailable(TokentrailError, FileNotFoundError):
    """A named model is not on this machine; the message says how to fetch it."""


class EngineError(TokentrailError, RuntimeError):
    """An engine failed for a reason that has an HTTP meaning (a remote upstream that is
    gone or too slow): `status` is what a server answers (502, 504, or an upstream's own
    4xx) and `code` a short machine-readable name."""

    def __init__(self, message: str, status: int = 502, code: str = "upstream_error") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class UpstreamError(EngineError):
    """The upstream failed: `status` is what the proxy answers (502, 504, or the
    upstream's own 4xx), `code` a short machine-readable name."""


class CalibrationError(TokentrailError, ValueError):
    """A labelled set or a calibration map that cannot be used: a malformed line
    (`line` is its 1-based number), or a map fitted for another model."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line


class UsageError(TokentrailError):
    """Bad input from the command line: the CLI exits 2 with this one-line message."""


class APIError(TokentrailError):
    """An error answered to an HTTP client in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body: `{"error": {message, type, param, code}}`."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Any:
        """A starlette JSONResponse with this error's status, body and headers."""
        from starlette.responses import JSONResponse

        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class QueueFull(APIError):
    """Raised when `max_queue` requests are already waiting: a 429 with Retry-After."""

    def __init__(self, waiting: int, retry_after: int) -> None:
        super().__init__(
            429,
            f"the server is busy: {waiting} requests are already waiting; retry after "
            f"{retry_after} s",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(retry_after)},
        )


class ClientGone(Exception):
    """The client hung up before its request was read: nobody to answer."""
