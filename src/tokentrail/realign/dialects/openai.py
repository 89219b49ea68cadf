"""OpenAI-shaped chunks: ``choices`` with chat deltas or completion text, and logprobs.

Chat logprobs (``logprobs.content[]`` entries with ``token``, ``logprob``, ``bytes``,
``top_logprobs``) identify a token by its raw bytes; so do llama.cpp's, which add the
token's ``id`` and send the same entries on ``/v1/completions`` too. Legacy completions
logprobs (``tokens``, ``token_logprobs``, ``top_logprobs`` as parallel lists) identify it
by its token string (OpenAI's ``bytes:\\xNN`` form for bytes that are not UTF-8 alone).
A choice-level id source (`CHOICE_IDS`, e.g. vLLM's
``token_ids``) takes precedence over what the logprobs say.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import wire
from ..result import RealignError
from ..wire import Frame, WireToken
from . import vllm

NAME = "openai"
#: Choice-level sources of exact ids, tried in order on an OpenAI-shaped choice.
CHOICE_IDS = (vllm,)


def claims(chunk: Mapping[str, Any]) -> bool:
    """Whether the chunk is OpenAI-shaped (has ``choices``)."""
    return "choices" in chunk


def _content_entries(content: Any, where: str) -> list[WireToken]:
    if not isinstance(content, list):
        raise RealignError(f"{where} must be a list")
    out = [wire.sourced(wire.entry(e, f"{where}[{k}]", "")) for k, e in enumerate(content)]
    for w in out:
        # llama.cpp: an entry's bytes are its token's plus those of the tokens whose
        # frames it folded in (tokens ending inside a character get no frame).
        w.folded = w.id is not None and w.raw is not None
    return out


def chat_choice(ch: Mapping[str, Any], where: str, frame: Frame) -> list[WireToken]:
    """Read a chat choice's content into `frame`; return its logprobs entries."""
    body = ch.get("delta", ch.get("message"))
    if body is not None and not isinstance(body, Mapping):
        raise RealignError(f"{where}.delta must be an object, got {wire.type_name(body)}")
    frame.content = wire.text((body or {}).get("content"), f"{where}.delta.content")
    lps = ch.get("logprobs")
    if lps is None:
        return []
    if not isinstance(lps, Mapping):
        raise RealignError(f"{where}.logprobs must be an object, got {wire.type_name(lps)}")
    return _content_entries(lps.get("content") or [], f"{where}.logprobs.content")


def completion_choice(ch: Mapping[str, Any], where: str, frame: Frame) -> list[WireToken]:
    """Read a completions choice's text into `frame`; return its logprobs entries."""
    frame.content = wire.text(ch.get("text"), f"{where}.text")
    lps = ch.get("logprobs")
    if lps is None:
        return []
    if not isinstance(lps, Mapping):
        raise RealignError(f"{where}.logprobs must be an object, got {wire.type_name(lps)}")
    if "content" in lps and "tokens" not in lps:
        # llama.cpp's /v1/completions: chat-style entries (with ids and bytes).
        return _content_entries(lps.get("content") or [], f"{where}.logprobs.content")
    entries: list[WireToken] = []
    tokens = lps.get("tokens") or []
    values = lps.get("token_logprobs") or []
    tops = lps.get("top_logprobs") or []
    for name, v in (("tokens", tokens), ("token_logprobs", values), ("top_logprobs", tops)):
        if not isinstance(v, list):
            raise RealignError(f"{where}.logprobs.{name} must be a list")
    for k, tok in enumerate(tokens):
        if not isinstance(tok, str):
            raise RealignError(f"{where}.logprobs.tokens[{k}] must be a string")
        lp = None
        if k < len(values):
            lp = wire.logprob(values[k], f"{where}.logprobs.token_logprobs[{k}]")
        top = None
        alts = tops[k] if k < len(tops) else None
        if alts is not None:
            if not isinstance(alts, Mapping):
                raise RealignError(f"{where}.logprobs.top_logprobs[{k}] must be an object")
            here = f"{where}.top_logprobs"
            top = [
                wire.sourced(WireToken(token=str(t), logprob=wire.logprob(v, here)))
                for t, v in alts.items()
            ]
        entries.append(wire.sourced(WireToken(token=tok, logprob=lp, top=top)))
    return entries


def _pick_choice(choices: Any, choice: int, where: str) -> Mapping[str, Any] | None:
    if not isinstance(choices, list):
        raise RealignError(f"{where}.choices must be a list, got {wire.type_name(choices)}")
    for k, ch in enumerate(choices):
        if not isinstance(ch, Mapping):
            raise RealignError(f"{where}.choices[{k}] must be an object, got {wire.type_name(ch)}")
        if ch.get("index", k) == choice:
            return ch
    return None


def _count(obj: Any, key: str) -> int | None:
    if isinstance(obj, Mapping):
        n = obj.get(key)
        if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
            return n
    return None


def _completion_tokens(chunk: Mapping[str, Any]) -> int | None:
    """How many tokens the server says it generated so far: ``usage.completion_tokens``
    (at the end; on every chunk with vLLM's continuous usage stats), else llama.cpp's
    ``timings.predicted_n`` (on every chunk with its ``timings_per_token``)."""
    n = _count(chunk.get("usage"), "completion_tokens")
    return n if n is not None else _count(chunk.get("timings"), "predicted_n")


def parse(chunk: Mapping[str, Any], choice: int, where: str) -> Frame | None:
    """The frame of choice `choice`; None when the chunk has no such choice (usage)."""
    ext = chunk.get("tokentrail")
    if isinstance(ext, Mapping) and ext.get("choice", 0) != choice:
        ext = None  # n > 1: another choice's extension
    ch = _pick_choice(chunk["choices"], choice, where)
    # usage counts all choices together: it speaks for choice 0 of a one-choice stream.
    total = _completion_tokens(chunk) if choice == 0 else None
    others = any(
        isinstance(c, Mapping) and c.get("index", k) != choice
        for k, c in enumerate(chunk["choices"])
    )
    if ch is None:
        if ext is None and total is None and not others:
            return None
        return Frame(ext=ext, total=total, other_choices=others)
    frame = Frame(ext=ext, total=total, other_choices=others)
    here = f"{where}.choices[{choice}]"
    reason = ch.get("finish_reason")
    frame.finish = reason if isinstance(reason, str) else None
    if "delta" in ch or "message" in ch:
        frame.chat = True
        entries = chat_choice(ch, here, frame)
    elif "text" in ch:
        entries = completion_choice(ch, here, frame)
    else:
        raise RealignError(f"{here} has neither 'delta', 'message' nor 'text'")
    for source in CHOICE_IDS:
        if source.claims(ch):
            source.attach(ch, entries, here, frame)
            break
    else:
        frame.tokens.extend(entries)
    return frame
