"""llama-server's request fields beyond OpenAI's, as a llama.cpp user sends them here.

llama-server reads its own sampling and generation fields from the body of every
endpoint, OpenAI's included (its ``/v1/chat/completions`` copies every field of the body
into its native parameters; the list is its ``tools/server/server-schema.cpp``). A
client moving from llama-server sends them unchanged, and ignoring one would change
the answer without a word: ``n_predict`` ignored runs to another length,
``repeat_penalty`` ignored repeats, ``mirostat`` ignored samples another way. So each
is honoured, refused with a 400 naming it, or, where it cannot change the answer here,
accepted:

Honoured, with llama-server's meaning:

- ``n_predict``: the token limit; it wins over ``max_tokens`` as in llama-server, and
  -1 is no limit of the request's own (the context's room);
- ``repeat_penalty``: ``repetition_penalty`` (llama.cpp's sign-aware division, which
  every engine here applies; the window is each engine's own: the last 64 tokens,
  prompt included, on llama.cpp, as llama-server's default ``repeat_last_n``);
- ``n_probs``: alternatives per token where the request asks no logprobs of its own
  (chat: ``logprobs`` true with ``top_logprobs`` N; completions: ``logprobs`` N);
- ``n_cmpl``: ``n``;
- ``reasoning_format``: "none" leaves the reasoning in the content (as
  ``"tokentrail": {"reasoning": false}``); "auto" and "deepseek" are the server's own split;
- ``ignore_eos``, ``chat_template_kwargs`` and ``continue_final_message`` are vLLM's
  fields too (`server.vllm_fields`), with the same meaning.

Refused unless off (a sampler llama.cpp applies that no engine here does): ``mirostat``,
``typical_p`` below 1, ``dry_multiplier``, ``xtc_probability`` (with ``xtc_threshold``
at most 0.5), ``top_n_sigma`` above 0, ``dynatemp_range``, ``adaptive_target`` from 0,
``min_keep`` above 1, ``repeat_last_n`` other than 64 with a penalty on, ``samplers``
in an order that differs from the one applied here or that leaves out one the request
turns on, ``t_max_predict_ms``, ``n_indent``, ``lora``, ``post_sampling_probs``
(``"tokentrail": {"logprobs": "processed"}`` gives the logprobs after the sampling filters),
``grammar_lazy``, ``grammar_triggers``, ``preserved_tokens`` and
``reasoning_budget_tokens``. A sampler's own settings (``mirostat_tau``, ``dry_base``,
``xtc_threshold``...) are accepted at any value while the sampler is off, as they change
nothing then: clients that send every setting (SillyTavern, Open WebUI) are served.

Accepted and without effect, as they do not change the answer: ``cache_prompt``,
``id_slot``, ``n_cache_reuse``, ``n_keep`` and ``n_discard`` (the context is never
shifted here), ``return_tokens`` and ``response_fields`` (llama-server's own
``/completion`` only), ``timings_per_token``, ``return_progress``,
``sse_ping_interval``, ``backend_sampling``, ``verbose``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pydantic import BaseModel

from ..errors import APIError

__all__ = ["LlamaCppFields", "llamacpp_extras"]

#: The samplers this server applies, in its order (llama.cpp's default order, less the
#: samplers it does not have); a ``samplers`` list must keep this order.
ORDER = ("penalties", "top_k", "top_p", "min_p", "temperature")
#: llama.cpp's one-letter sampler names (``samplers`` as a string).
_CHARS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p",
          "p": "top_p", "m": "min_p", "x": "xtc", "t": "temperature", "i": "infill",
          "a": "adaptive_p"}  # fmt: skip
#: Other names llama.cpp takes for samplers.
_ALIASES = {"typical_p": "typ_p", "typical": "typ_p", "nucleus": "top_p", "temp": "temperature"}
_KNOWN = set(_CHARS.values())


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


#: Samplers refused unless off: field -> (off?, what off is, why).
_OFF: dict[str, tuple[Callable[[Any], bool], str]] = {
    "mirostat": (lambda v: v == 0, "0"),
    "typical_p": (lambda v: v >= 1, "1.0"),
    "dry_multiplier": (lambda v: v == 0, "0"),
    "top_n_sigma": (lambda v: v <= 0, "-1"),
    "dynatemp_range": (lambda v: v <= 0, "0"),
    "adaptive_target": (lambda v: v < 0, "-1"),
    "min_keep": (lambda v: v in (0, 1), "0"),
    "t_max_predict_ms": (lambda v: v <= 0, "0"),
    "n_indent": (lambda v: v == 0, "0"),
    "reasoning_budget_tokens": (lambda v: v == -1, "-1"),
}
#: Settings of a sampler, accepted at any value while it is off: field -> its switch.
_SETTINGS = {
    "mirostat_tau": "mirostat", "mirostat_eta": "mirostat",
    "dry_base": "dry_multiplier", "dry_allowed_length": "dry_multiplier",
    "dry_penalty_last_n": "dry_multiplier", "dry_sequence_breakers": "dry_multiplier",
    "dynatemp_exponent": "dynatemp_range", "adaptive_decay": "adaptive_target",
}  # fmt: skip
#: Fields refused unless false or empty: field -> what to do instead.
_EMPTY = {
    "lora": "the server's model is used as loaded",
    "post_sampling_probs": "'tokentrail': {'logprobs': 'processed'} gives the logprobs "
    "after the sampling filters",
    "grammar_lazy": "a grammar applies from the first token",
    "grammar_triggers": "a grammar applies from the first token",
    "preserved_tokens": "special tokens' text is left out of the content",
}


class LlamaCppFields(BaseModel):
    """llama-server's fields that chat and completions share (see the module)."""

    n_predict: Any = None
    repeat_penalty: Any = None
    repeat_last_n: Any = None
    n_probs: Any = None
    n_cmpl: Any = None
    reasoning_format: Any = None
    samplers: Any = None
    mirostat: Any = None
    mirostat_tau: Any = None
    mirostat_eta: Any = None
    typical_p: Any = None
    dry_multiplier: Any = None
    dry_base: Any = None
    dry_allowed_length: Any = None
    dry_penalty_last_n: Any = None
    dry_sequence_breakers: Any = None
    xtc_probability: Any = None
    xtc_threshold: Any = None
    top_n_sigma: Any = None
    dynatemp_range: Any = None
    dynatemp_exponent: Any = None
    adaptive_target: Any = None
    adaptive_decay: Any = None
    min_keep: Any = None
    t_max_predict_ms: Any = None
    n_indent: Any = None
    reasoning_budget_tokens: Any = None
    lora: Any = None
    post_sampling_probs: Any = None
    grammar_lazy: Any = None
    grammar_triggers: Any = None
    preserved_tokens: Any = None


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"'{param}' {message}", param=param, code=code)


def _int(wire: Any, name: str, lo: int, hi: int) -> int | None:
    value = getattr(wire, name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(name, "must be an integer", "invalid_type")
    if not lo <= value <= hi:
        raise _bad(name, f"must be between {lo} and {hi}, got {value}")
    return value


def _checked(wire: Any, name: str) -> Any:
    """A sampler field's number (None where absent), or the 400 for a non-number."""
    value = getattr(wire, name)
    if value is None or name in ("dry_sequence_breakers",):
        return value
    if not _number(value) or not math.isfinite(value):
        raise _bad(name, "must be a finite number", "invalid_type")
    return value


def _refuse_on(wire: Any, penalized: bool) -> None:
    """The 400 for a sampler or option llama-server would apply and this server cannot."""
    for name, (off, shown) in _OFF.items():
        value = _checked(wire, name)
        if value is not None and not off(value):
            raise _bad(name, f"is not supported here (only off, {shown}, is accepted)",
                       "unsupported_value")  # fmt: skip
    for name in _SETTINGS:
        _checked(wire, name)  # any value while its sampler is off (checked above)
    xtc, threshold = _checked(wire, "xtc_probability"), _checked(wire, "xtc_threshold")
    if xtc is not None and xtc != 0 and (threshold is None or threshold <= 0.5):
        raise _bad("xtc_probability", "is not supported here (only off, 0, is accepted)",
                   "unsupported_value")  # fmt: skip
    last_n = _checked(wire, "repeat_last_n")
    if last_n is not None and last_n != 64 and penalized:
        raise _bad("repeat_last_n", "is not supported here: the penalties look at each "
                   "engine's own window (llama.cpp's 64 tokens); only 64 is accepted with a "
                   "penalty on", "unsupported_value")  # fmt: skip
    for name, why in _EMPTY.items():
        value = getattr(wire, name)
        if value not in (None, False, [], {}):
            raise _bad(name, f"is not supported: {why}", "unsupported_value")


def _sampler_names(value: Any) -> list[str]:
    if isinstance(value, str):
        unknown = [c for c in value if c not in _CHARS]
        if unknown:
            raise _bad("samplers", f"holds {unknown[0]!r}, which names no llama.cpp sampler")
        return [_CHARS[c] for c in value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _bad("samplers", "must be an array of sampler names or a string of their "
                   "letters", "invalid_type")  # fmt: skip
    names = []
    for v in value:
        name = v.replace("-", "_").lower()
        name = _ALIASES.get(name, name)
        if name not in _KNOWN:
            raise _bad("samplers", f"holds {v!r}, which names no llama.cpp sampler")
        names.append(name)
    return names


def _check_samplers(value: Any, active: set[str]) -> None:
    """Refuse a ``samplers`` order this server would not apply: its samplers out of
    `ORDER`'s order, or one of `active` (those the request turns on) left out."""
    listed = [n for n in _sampler_names(value) if n in ORDER]
    if listed != sorted(dict.fromkeys(listed), key=ORDER.index):
        raise _bad("samplers", f"orders them as {listed}; this server applies "
                   f"{list(ORDER)} in that order", "unsupported_value")  # fmt: skip
    missing = [n for n in ORDER if n in active and n not in listed]
    if missing:
        raise _bad("samplers", f"leaves out {missing[0]!r}, which the request turns on; "
                   "this server cannot skip it", "unsupported_value")  # fmt: skip


def llamacpp_extras(wire: Any, req: Any, *, max_n: int, max_tokens: int) -> None:
    """Apply the honoured fields of `wire` (a request with `LlamaCppFields`) to `req`
    (its `GenRequest`, before its sampling settings are made), and refuse the others
    (APIError 400 naming the field). `max_n` and `max_tokens` bound ``n_cmpl`` and
    ``n_predict`` as ``n`` and ``max_tokens`` are bounded."""
    chat = req.kind == "chat"
    n_predict = _int(wire, "n_predict", -1, max_tokens)
    if n_predict == -1:  # no limit of its own: the context's room (prepare._limit)
        req.max_tokens, req.max_tokens_given = max_tokens, False
    elif n_predict == 0 and (chat or not getattr(wire, "echo", None)):
        raise _bad("n_predict", "must be at least 1; 0 is for 'echo' alone on "
                   "/v1/completions, or -1 for no limit")  # fmt: skip
    elif n_predict is not None:
        req.max_tokens, req.max_tokens_given = n_predict, True
    n_cmpl = _int(wire, "n_cmpl", 1, max_n)
    if n_cmpl is not None:
        if wire.n is not None and wire.n != n_cmpl:
            raise _bad("n_cmpl", "and 'n' disagree; give one of them")
        req.n = n_cmpl
    repeat = _checked(wire, "repeat_penalty")
    if repeat is not None:
        if repeat <= 0:
            raise _bad("repeat_penalty", f"must be above 0, got {repeat}")
        if wire.repetition_penalty is not None and wire.repetition_penalty != repeat:
            raise _bad("repeat_penalty", "and 'repetition_penalty' disagree; give one of them")
        req.repetition_penalty = float(repeat)
    _n_probs(wire, req)
    penalized = (req.repetition_penalty not in (None, 1.0) or bool(req.presence_penalty)
                 or bool(req.frequency_penalty))  # fmt: skip
    _refuse_on(wire, penalized)
    if wire.samplers is not None:
        greedy = req.temperature == 0
        active = {"temperature"}
        active |= {"penalties"} if penalized else set()
        if not greedy:
            active |= {n for n, on in (("top_k", req.top_k > 0), ("top_p", req.top_p < 1),
                                       ("min_p", req.min_p > 0)) if on}  # fmt: skip
        _check_samplers(wire.samplers, active)
    _reasoning(wire, req, chat)


def _n_probs(wire: Any, req: Any) -> None:
    n = _int(wire, "n_probs", 0, 2**31 - 1)
    if not n:
        return
    own = wire.logprobs not in (None, False) or getattr(wire, "top_logprobs", None) is not None
    if own:
        same = (req.logprobs and req.top_logprobs == n)
        if not same:
            raise _bad("n_probs", "and the request's own logprobs fields disagree; give one "
                       "of them")  # fmt: skip
        return
    req.logprobs, req.top_logprobs = True, n


def _reasoning(wire: Any, req: Any, chat: bool) -> None:
    value = wire.reasoning_format
    if value is None or value in ("auto", "deepseek"):
        return
    if value != "none":
        raise _bad("reasoning_format", f"{value!r} is not supported: 'none' keeps the "
                   "reasoning in the content, 'auto' or 'deepseek' splits it as the server "
                   "does", "unsupported_value")  # fmt: skip
    options = getattr(wire, "tokentrail", None)
    if chat and (options is None or options.reasoning is None):
        req.structure = replace(req.structure, reasoning=False)
