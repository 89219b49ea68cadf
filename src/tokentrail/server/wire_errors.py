"""The 400s of the request models: pydantic's findings as OpenAI-shaped errors.

`validation_error` turns the first problem pydantic found into a 400 whose ``param``
is the top-level field (as OpenAI does) and whose message names the full path
(``'messages[0].content'``) and what was expected; `custom_error` is what the models'
own validators raise (`tokentrail.server.protocol`, `vllm_fields`), and `bad_request`
any other 400 naming a field.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticCustomError

from ..errors import APIError

__all__ = ["OWN_CODES", "bad_request", "custom_error", "json_type_name", "validation_error"]


def bad_request(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    """A 400 in OpenAI's shape naming the field `param`."""
    return APIError(400, message, param=param, code=code)


def json_type_name(value: Any) -> str:
    """The JSON name of a parsed value's type ("integer", "array", "null", ...)."""
    if value is None:
        return "null"
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }.get(type(value), type(value).__name__)


#: Error codes our own validators raise (`PydanticCustomError` types), used as given.
OWN_CODES = frozenset(
    {"invalid_type", "invalid_value", "invalid_unicode", "unsupported_parameter",
     "unsupported_value"}
)


def _path(loc: tuple[int | str, ...]) -> str:
    """A pydantic `loc` as a JSON path: ("messages", 0, "content") -> messages[0].content."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _code(kind: str) -> str:
    if kind in OWN_CODES:
        return kind
    if kind == "missing":
        return "missing_required_parameter"
    if kind.endswith("_type") or kind in ("finite_number", "int_from_float"):
        return "invalid_type"
    return "invalid_value"


def validation_error(error: ValidationError) -> APIError:
    """The 400 for the first problem pydantic found: `param` is the top-level field,
    the message names the full path and says what was expected."""
    first = error.errors(include_url=False)[0]
    loc = tuple(first["loc"])
    kind = first["type"]
    path = _path(loc) or "(body)"
    detail = first["msg"]
    if kind in OWN_CODES:
        message = f"'{path}' {detail}"
    elif kind == "missing":
        message = f"'{path}' is required"
    elif kind == "model_type":
        message = f"'{path}' must be an object, got {json_type_name(first.get('input'))}"
    else:
        got = first.get("input")
        message = f"'{path}': {detail[0].lower()}{detail[1:]}"
        if _code(kind) == "invalid_type":
            message += f", got {json_type_name(got)}"
        elif not isinstance(got, list | dict):
            message += f", got {got!r}"
    return bad_request(_param(loc), message, _code(kind))


def _param(loc: tuple[int | str, ...]) -> str | None:
    """The `param` of a 400: the top-level field, or for this server's own ``tokentrail``
    object the key inside it that was wrong (``tokentrail.alarm.below``)."""
    if not loc:
        return None
    if loc[0] == "tokentrail" and len(loc) > 1:
        return ".".join(str(p) for p in loc[:3] if isinstance(p, str))
    return str(loc[0])


def custom_error(code: str, message: str) -> PydanticCustomError:
    """The error a validator of the request models raises: `code` is one of
    `OWN_CODES`, and `message` follows the field's path in the 400's message."""
    return PydanticCustomError(code, "{detail}", {"detail": message})
