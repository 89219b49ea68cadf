"""Compiling constraints within bounds: llguidance's parser limits, a time budget, a
worker pool off the model's thread, a cache, and one-line error messages.

A constraint comes from whoever can reach the server, so compiling it must never stall
the model or end anyone else's generation (issue #29). Three bounds apply:

* **llguidance's own limits** (`LIMITS`, its `LLParserLimits`): the fuel for building
  the lexer, the grammar's size, the items in one Earley row, and the fuel and items of
  one mask computation. Every matcher is built under them, so a spec too large for them
  fails at compile time, and a step that would need more than its share ends that one
  sequence with an error (llguidance puts the matcher in its error state).
* **A time budget** (`Compiler.run`): the work runs on a small thread pool (llguidance
  drops the GIL while it builds a grammar), awaited from the event loop; past the
  budget the request is refused as "too complex" before it ever joins the batch.
* **A cache** of compiled specs (`cached_spec`) and of built matchers keyed by (grammar,
  tokenizer) (`prototype_for`; a tokenizer's go with it), as vLLM's: the same spec sent
  again costs a lookup and a `deep_copy` of the matcher, not a compile. Each sequence
  starts from a copy of the cached matcher (`prototype_for`), never compiling on the
  model's thread.

llguidance's messages can hold its internal state over several lines (the parser's
rows, the tokens so far); `one_line` condenses them to the reason alone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import llguidance as llg
import llguidance.numpy as llg_np

from ..errors import ConstraintError
from .kept import lltok_memo

__all__ = [
    "COMPILE_SECONDS",
    "LIMITS",
    "Compiler",
    "Limits",
    "TooComplex",
    "cached_spec",
    "one_line",
    "parser_limits",
    "prototype_for",
    "reason_of",
    "spec_key",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: Seconds a request's constraint may take to compile before it is refused.
COMPILE_SECONDS = 10.0
#: Longest message kept from llguidance (characters, after condensing).
MESSAGE_CHARS = 240


@dataclass(frozen=True)
class Limits:
    """llguidance's parser limits (see `llguidance.LLParserLimits`) tokentrail uses.

    Lower than llguidance's defaults where a hostile spec could otherwise take seconds
    of the model's thread in one step: `step_lexer_fuel` (~14k/ms) and
    `step_max_items` (~20k/ms) bound one mask computation to a few milliseconds."""

    max_items_in_row: int = 2_000
    initial_lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 200_000
    step_max_items: int = 50_000
    max_lexer_states: int = 250_000
    max_grammar_size: int = 500_000


#: The limits every matcher is built under.
LIMITS = Limits()


def parser_limits(limits: Limits = LIMITS) -> Any:
    """`limits` as llguidance's `LLParserLimits` (terse errors: no internal state)."""
    return llg.LLParserLimits(**dataclasses.asdict(limits), verbose_errors=False)


_STATE = re.compile(r"<state>|<non-verbose/>|\nTokens:|\nRow |\nStack:|\ngrammar ", re.IGNORECASE)


def one_line(message: str, limit: int = MESSAGE_CHARS) -> str:
    """llguidance's `message` as one line: what comes before its dump of internal state
    (`<state>`, the tokens, the parser's rows), whitespace runs folded to one space,
    at most `limit` characters."""
    cut = _STATE.search(message)
    if cut is not None:
        message = message[: cut.start()]
    text = " ".join(message.split())
    text = text.rstrip(" :;,")
    if len(text) > limit:
        text = text[: limit - 1].rstrip() + "…"
    return text or "unknown error"


#: Phrases in llguidance's messages that mean a limit was hit, not a mistake in the spec.
_LIMIT_PHRASES = (
    "max is", "fuel", "too many", "too large", "limit", "grammar size", "max_", "budget",
)


def reason_of(message: str) -> str:
    """"too_complex" when llguidance's `message` says a limit was hit, else "invalid"
    (the label `/metrics` counts refusals by)."""
    low = message.lower()
    return "too_complex" if any(p in low for p in _LIMIT_PHRASES) else "invalid"


class TooComplex(ConstraintError):
    """A constraint over a limit (llguidance's, a schema bound, or the time budget)."""


# -- the matcher cache ---------------------------------------------------------------------

#: Built matchers kept per tokenizer (least recently used goes first); all of a
#: tokenizer's go with it (`kept.lltok_memo`).
CACHE_ENTRIES = 64
_cache_lock = threading.Lock()


def _matchers(_lltok: Any) -> OrderedDict[str, Any]:
    return OrderedDict()


def prototype_for(grammar: str, lltok: Any, param: str) -> Any:
    """llguidance's matcher for `grammar` on the tokenizer `lltok`, at the start of the
    grammar, built under `LIMITS` (cached by grammar for as long as the tokenizer lives;
    never advance it: sequences take `deep_copy`s). A `ConstraintError` naming `param`
    with llguidance's reason in one line when it cannot be built (`TooComplex` for a
    limit)."""
    built = lltok_memo(lltok, "matchers", _matchers)
    with _cache_lock:
        hit = built.get(grammar)
        if hit is not None:
            built.move_to_end(grammar)
            return hit
    # llguidance drops the GIL while it builds the grammar and its lexer.
    matcher = llg.LLMatcher(lltok, grammar, log_level=0, limits=parser_limits())
    if not matcher.is_error():
        # The first mask too: a lexer or an Earley row past the limits shows up only
        # there, and would otherwise fail the sequence's first step in the batch.
        words = llg_np.allocate_token_bitmask(1, lltok.vocab_size)[0]
        matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    if matcher.is_error():
        raw = matcher.get_error()
        kind = TooComplex if reason_of(raw) == "too_complex" else ConstraintError
        prefix = "too complex: " if kind is TooComplex else ""
        raise kind(f"{param}: {prefix}{one_line(raw)}", param)
    with _cache_lock:
        built[grammar] = matcher
        while len(built) > CACHE_ENTRIES:
            built.popitem(last=False)
    return matcher


# -- the spec cache ------------------------------------------------------------------------

#: Compiled specs kept (least recently used goes first).
SPEC_ENTRIES = 64
_specs: OrderedDict[str, Any] = OrderedDict()


def spec_key(*parts: Any) -> str | None:
    """A cache key for a spec given as JSON-like `parts` (None: not JSON, never cached)."""
    try:
        return json.dumps(parts)
    except (TypeError, ValueError, RecursionError):
        return None


def cached_spec(key: str | None, build: Callable[[], T]) -> T:
    """`build()`'s result for `key`, built once while it stays among the last
    `SPEC_ENTRIES` (errors are not kept: they raise again). The spec half of vLLM's
    compile cache; `prototype_for` is the tokenizer-bound half."""
    if key is None:
        return build()
    with _cache_lock:
        if key in _specs:
            _specs.move_to_end(key)
            return _specs[key]
    value = build()
    with _cache_lock:
        _specs[key] = value
        while len(_specs) > SPEC_ENTRIES:
            _specs.popitem(last=False)
    return value


# -- the worker pool -----------------------------------------------------------------------


class Compiler:
    """Runs constraint work off the calling thread, under a time budget.

    `run(fn, *args, param=...)` awaits `fn(*args)` on one of `workers` threads and
    raises `TooComplex` naming `param` when it takes more than `seconds`. A call past
    its budget cannot be stopped inside llguidance; it finishes on its thread (its
    work is bounded by `LIMITS`) and its result is dropped. `on_compile(seconds)` and
    `on_refuse(reason)` are told about each call (the server's metrics)."""

    def __init__(
        self,
        seconds: float = COMPILE_SECONDS,
        workers: int = 2,
        on_compile: Callable[[float], None] | None = None,
        on_refuse: Callable[[str], None] | None = None,
    ) -> None:
        if not seconds > 0:
            raise ValueError(f"the compile budget must be > 0 seconds, got {seconds}")
        self.seconds = seconds
        self.on_compile = on_compile
        self.on_refuse = on_refuse
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="tokentrail-compile"
        )

    async def run(self, fn: Callable[..., T], *args: Any, param: str) -> T:
        """`fn(*args)` on the pool, within the budget (see the class)."""
        loop = asyncio.get_running_loop()
        tic = time.perf_counter()
        future = loop.run_in_executor(self._pool, _timed, fn, args)
        try:
            result, spent = await asyncio.wait_for(asyncio.shield(future), self.seconds)
        except TimeoutError:
            future.cancel()  # not started yet: never runs; running: its result is dropped
            logger.warning("a constraint on %r took over %g s to compile", param, self.seconds)
            self.refused("too_complex")
            raise TooComplex(
                f"{param}: too complex: compiling it took over {self.seconds:g} s", param
            ) from None
        except TooComplex:
            self.refused("too_complex")
            raise
        except ConstraintError as e:
            self.refused(reason_of(str(e)))
            raise
        if self.on_compile is not None:
            self.on_compile(spent if spent else time.perf_counter() - tic)
        return result

    def refused(self, reason: str) -> None:
        """Count a refusal (`on_refuse`)."""
        if self.on_refuse is not None:
            self.on_refuse(reason)

    def close(self) -> None:
        """Stop taking work (running calls finish on their threads)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _timed(fn: Callable[..., T], args: tuple[Any, ...]) -> tuple[T, float]:
    tic = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - tic
