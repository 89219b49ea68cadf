"""The JSON codec of the streaming hot paths: orjson where installed, else the stdlib.

The proxy decodes every frame its upstream streams and encodes every chunk it sends
(issue #32: its CPU per token). orjson (the ``server`` extra) does both in C, several
times faster than the stdlib `json`; without it the stdlib gives the same values.

Both spellings write compact JSON (no spaces), UTF-8 text unescaped, and never NaN or
Infinity: callers pass numbers through `tokentrail.segment.json_number` first (the one
rule for non-finite figures); a non-finite number that slips past it is written as
null by orjson (the rule's own answer for NaN and +inf) and refused with `ValueError`
by the stdlib. Decoding reads what the stdlib reads (see `loads`). Floats are written
as their shortest round-trip form in both, though not always with the same characters
(orjson's ``0.00001`` is the stdlib's ``1e-05``): the same number on the wire.
"""

from __future__ import annotations

import json
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - the server extra installs it
    orjson = None  # type: ignore[assignment]

__all__ = ["HAVE_ORJSON", "dumps", "loads"]

#: Whether the fast codec is in use.
HAVE_ORJSON = orjson is not None


def _stdlib_dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _tuple_default(obj: Any) -> Any:
    """What orjson cannot write itself: a tuple subclass (a named tuple) as a list."""
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError


if orjson is not None:
    _OPTIONS = orjson.OPT_NON_STR_KEYS
    _orjson_dumps = orjson.dumps
    _orjson_loads = orjson.loads

    def dumps(obj: Any) -> bytes:
        """`obj` as compact UTF-8 JSON bytes (see the module)."""
        try:
            return _orjson_dumps(obj, default=_tuple_default, option=_OPTIONS)
        except TypeError:
            return _stdlib_dumps(obj)  # what orjson does not know: the stdlib's answer

    def loads(data: bytes | str) -> Any:
        """The value `data` holds; `ValueError` when it is not JSON. What orjson
        refuses and the stdlib reads (``-Infinity``, which vLLM writes for a logprob; a
        lone surrogate escape; an integer past 64 bits) is read by the stdlib."""
        try:
            return _orjson_loads(data)
        except ValueError:  # orjson.JSONDecodeError
            return json.loads(data)

else:  # pragma: no cover

    def dumps(obj: Any) -> bytes:
        """`obj` as compact UTF-8 JSON bytes (see the module)."""
        return _stdlib_dumps(obj)

    def loads(data: bytes | str) -> Any:
        """The value `data` holds; `ValueError` when it is not JSON."""
        return json.loads(data)
