"""One chunk as the wire describes it, before any token id is known.

The dialect parsers (`tokentrail.realign.dialects`) turn chunks into `Frame`s of
`WireToken`s with the helpers here (each checks one JSON value and raises `RealignError`
naming where it is); the `Realigner` identifies the tokens afterwards.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .result import RealignError

#: UTF-8 of U+FFFD, the stand-in servers send for bytes that are not text on their own.
REPLACEMENT = "\ufffd".encode()
#: Logprobs at or below this are "minus infinity" on the wire: OpenAI and vLLM send
#: -9999.0, llama.cpp the lowest float.
WIRE_NEG_INF = -9999.0

_BYTES_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})|(.)", re.S)


@dataclass(slots=True)
class WireToken:
    """One token as the wire describes it, before its id is known."""

    id: int | None = None
    token: str | None = None
    raw: bytes | None = None
    logprob: float | None = None
    top: list[WireToken] | None = None
    source: str = ""
    #: llama.cpp entry: `raw` is everything sent with this token, dropped frames included.
    folded: bool = False


@dataclass(slots=True)
class Frame:
    """The part of one chunk that matters here."""

    content: str = ""
    tokens: list[WireToken] = field(default_factory=list)
    ext: Mapping[str, Any] | None = None
    #: llama.cpp: position of the frame's first token (from tokens_predicted).
    first_index: int | None = None
    #: llama.cpp: the frame's content holds the text of its tokens plus dropped ones.
    folded_content: bool = False
    error: str | None = None
    #: ``usage.completion_tokens``: how many tokens the server says it generated.
    total: int | None = None
    #: The chunk also carries other choices (then usage does not speak for this one).
    other_choices: bool = False
    #: The choice's ``finish_reason`` ("stop", "length", ...), when this chunk ends it.
    finish: str | None = None
    #: A chat choice (``delta`` / ``message``), not a completions one.
    chat: bool = False


def type_name(value: Any) -> str:
    """A JSON value's type, for error messages ("null" for None)."""
    return "null" if value is None else type(value).__name__


def is_int(value: Any) -> bool:
    """Whether `value` is a JSON integer (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def logprob(value: Any, where: str) -> float | None:
    """A wire logprob: None for null or NaN, -inf at or below `WIRE_NEG_INF`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RealignError(f"{where}: logprob must be a number, got {type_name(value)}")
    value = float(value)
    if math.isnan(value):
        return None
    return -math.inf if value <= WIRE_NEG_INF else value


def _prob_to_logprob(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RealignError(f"{where}: prob must be a number, got {type_name(value)}")
    return math.log(value) if value > 0 else -math.inf


def byte_list(value: Any, where: str) -> bytes | None:
    """A wire ``bytes`` list (integers 0..255) as bytes; None for null."""
    if value is None:
        return None
    try:
        if isinstance(value, list):
            return bytes(value)
    except (TypeError, ValueError):
        pass
    raise RealignError(f"{where}: bytes must be a list of integers 0..255")


def text(value: Any, where: str) -> str:
    """A wire string; "" for null."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RealignError(f"{where} must be a string, got {type_name(value)}")
    return value


def token_string_bytes(token: str) -> bytes:
    """The bytes a token string stands for.

    OpenAI writes a token that is not valid UTF-8 as ``bytes:\\xe2\\x80`` (backslash
    escapes, literal characters for the rest); any other string is its UTF-8.
    """
    if token.startswith("bytes:") and "\\x" in token:
        out = bytearray()
        for m in _BYTES_ESCAPE.finditer(token, 6):
            if m.group(1) is not None:
                out.append(int(m.group(1), 16))
            else:
                out += m.group(2).encode("utf-8")
        return bytes(out)
    return token.encode("utf-8")


_MISSING = object()


def plain_entry(e: dict[str, Any]) -> WireToken | None:
    """`entry` for the shape llama.cpp streams (an integer ``id``, a string ``token``, a
    finite float ``logprob``, a ``bytes`` list, plain entries in ``top_logprobs``),
    without building the error locations `entry` names; None for anything else, which
    `entry` then checks and reads (or says what is wrong with)."""
    tid = e.get("id")
    token = e.get("token")
    lp = e.get("logprob")
    raw = e.get("bytes")
    if (
        tid.__class__ is not int
        or token.__class__ is not str
        or lp.__class__ is not float
        or raw.__class__ is not list
        or not lp > WIRE_NEG_INF  # NaN or "minus infinity": `logprob` decides
    ):
        return None
    try:
        data = bytes(raw)
    except (TypeError, ValueError):
        return None
    top_src = e.get("top_logprobs", _MISSING)
    top = None
    if top_src is _MISSING:
        if "top_probs" in e or "probs" in e:
            return None
    elif top_src is not None:
        if top_src.__class__ is not list:
            return None
        top = []
        for t in top_src:
            alt = plain_entry(t) if t.__class__ is dict else None
            if alt is None:
                return None
            top.append(alt)
    return WireToken(tid, token, data, lp, top, "llama.cpp-ids")


def entry(e: Any, where: str, source: str) -> WireToken:
    """A logprobs entry: OpenAI chat (token, logprob, bytes, top_logprobs) or llama.cpp."""
    if e.__class__ is dict:
        plain = plain_entry(e)
        if plain is not None:
            return plain
    if not isinstance(e, Mapping):
        raise RealignError(f"{where}: expected an object, got {type_name(e)}")
    tid = e.get("id")
    if tid is not None and not is_int(tid):
        raise RealignError(f"{where}.id must be an integer, got {type_name(tid)}")
    token = e.get("token", e.get("tok_str", e.get("content")))
    if token is not None and not isinstance(token, str):
        raise RealignError(f"{where}.token must be a string, got {type_name(token)}")
    if "logprob" in e:
        lp = logprob(e["logprob"], f"{where}.logprob")
    else:
        lp = _prob_to_logprob(e.get("prob"), f"{where}.prob")
    top_src = next((e[k] for k in ("top_logprobs", "top_probs", "probs") if k in e), None)
    top = None
    if top_src is not None:
        if not isinstance(top_src, list):
            raise RealignError(f"{where}.top_logprobs must be a list, got {type_name(top_src)}")
        top = [entry(t, f"{where}.top_logprobs[{k}]", source) for k, t in enumerate(top_src)]
    raw = byte_list(e.get("bytes"), f"{where}.bytes")
    return WireToken(tid, token, raw, lp, top, source if tid is None else "llama.cpp-ids")


def sourced(w: WireToken) -> WireToken:
    """Name how the token is identified, for `RealignResult.source`."""
    if w.id is not None:
        return w
    if w.token is not None and w.token.startswith("token_id:"):
        w.source = "token-id-strings"
    elif w.raw is not None:
        w.source = "logprob-bytes"
    else:
        w.source = "token-strings"
    return w
