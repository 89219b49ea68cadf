"""The request body: read within the size cap (413), parsed as one JSON object, with
integers past `MAX_INT_DIGITS` digits refused by their path (a 400, not seconds of
work turning them into Python ints)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import APIError, ClientGone
from .wire_errors import json_type_name

if TYPE_CHECKING:
    from starlette.requests import Request

__all__ = ["MAX_INT_DIGITS", "read_json"]

#: The most digits an integer in a request body may have.
MAX_INT_DIGITS = 64


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """Read at most `limit` bytes of body and parse a JSON object, or raise APIError."""
    too_big = APIError(
        413,
        f"request body is larger than {limit} bytes",
        param=None,
        code="request_too_large",
    )
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise too_big
        except ValueError:
            raise APIError(400, "invalid Content-Length header", code="invalid_header") from None
    from starlette.requests import ClientDisconnect

    chunks = bytearray()
    try:
        async for chunk in request.stream():
            chunks += chunk
            if len(chunks) > limit:
                raise too_big
    except ClientDisconnect:
        raise ClientGone(f"the client hung up after {len(chunks)} bytes of body") from None
    if not chunks:
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    return _parse_body(bytes(chunks))


def _parse_body(raw: bytes) -> dict[str, Any]:
    """A JSON object, with oversized integers refused by path (see `_HugeInt`)."""
    try:
        body = json.loads(raw, parse_int=_parse_int)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(body, dict):
        raise APIError(
            400,
            f"the request body must be a JSON object, got {json_type_name(body)}",
            code="invalid_json",
        )
    try:
        where = _find_huge_int(body, "")
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    if where is not None:
        path, digits = where
        raise APIError(
            400,
            f"'{path}' is an integer of {digits} digits; integers may have at most "
            f"{MAX_INT_DIGITS} digits",
            param=path.split(".")[0].split("[")[0],
            code="invalid_value",
        )
    return body


@dataclass(frozen=True)
class _HugeInt:
    """Stands in for an integer literal too long to be any valid field's value.

    Kept although pydantic parses big integers: `json.loads` (which reads the body, for
    its RecursionError and decode errors) raises ValueError past 4300 digits, and a
    message naming the field and the digit count is what clients are promised."""

    digits: int


def _parse_int(text: str) -> int | _HugeInt:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:  # never call int() on it: 4300+ digits raise ValueError
        return _HugeInt(digits)
    return int(text)


def _find_huge_int(value: Any, path: str) -> tuple[str, int] | None:
    """The path (e.g. ``logit_bias.5``) and length of the first oversized integer."""
    if isinstance(value, _HugeInt):
        return path or "(body)", value.digits
    if isinstance(value, dict):
        for key, item in value.items():
            found = _find_huge_int(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _find_huge_int(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None
