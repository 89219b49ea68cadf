"""What is built per model tokenizer for constraints, kept exactly as long as the
tokenizer lives: llguidance's tokenizer (`lltokenizer.lltokenizer_for`), and what is made
from that (`lltok_memo`: the whitespace ids, the compiled matchers).

llguidance's `LLTokenizer` cannot be weakly referenced, so everything made from one is
filed under the model tokenizer it was built for, and a weak reference to that
tokenizer lets it all go at once. A tokenizer that cannot be weakly referenced either is
held, a few at most (`STRONG_KEPT`), the oldest let go first.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar, cast

T = TypeVar("T")

__all__ = ["STRONG_KEPT", "keep", "lltok_memo", "lltok_of"]

#: Tokenizers held strongly at most (those that cannot be weakly referenced).
STRONG_KEPT = 4


class _Entry:
    __slots__ = ("lltok", "memo", "ref")

    def __init__(self, ref: Any, lltok: Any) -> None:
        self.ref, self.lltok = ref, lltok
        self.memo: dict[str, Any] = {}

    def holds(self, tokenizer: Any) -> bool:
        target = self.ref() if isinstance(self.ref, weakref.ref) else self.ref
        return target is tokenizer


#: Entries by `id(tokenizer)`, and the same entries by `id(lltok)`.
_BY_TOKENIZER: dict[int, _Entry] = {}
_BY_LLTOK: dict[int, _Entry] = {}
#: The keys of `_BY_TOKENIZER` whose tokenizer is held strongly, oldest first.
_STRONG: list[int] = []
#: Re-entrant: a weak reference's callback (`_forget`) can run inside `keep` itself, on
#: the same thread, when an allocation there sets off a collection that frees a tokenizer.
_lock = threading.RLock()


def _forget(key: int) -> None:
    with _lock:
        entry = _BY_TOKENIZER.pop(key, None)
        if entry is not None and _BY_LLTOK.get(id(entry.lltok)) is entry:
            del _BY_LLTOK[id(entry.lltok)]
        if key in _STRONG:
            _STRONG.remove(key)


def lltok_of(tokenizer: Any) -> Any | None:
    """The llguidance tokenizer kept for `tokenizer`, or None."""
    entry = _BY_TOKENIZER.get(id(tokenizer))
    return entry.lltok if entry is not None and entry.holds(tokenizer) else None


def keep(tokenizer: Any, lltok: Any) -> Any:
    """File `lltok` under `tokenizer` until the tokenizer is gone; returns `lltok`."""
    key = id(tokenizer)
    _forget(key)  # a dead tokenizer's id, reused
    try:
        ref: Any = weakref.ref(tokenizer, lambda _: _forget(key))
        strong = False
    except TypeError:
        ref, strong = tokenizer, True
    entry = _Entry(ref, lltok)
    with _lock:
        _BY_TOKENIZER[key] = entry
        _BY_LLTOK[id(lltok)] = entry
        if strong:
            _STRONG.append(key)
        oldest = _STRONG[0] if len(_STRONG) > STRONG_KEPT else None
    if oldest is not None:
        _forget(oldest)
    return lltok


def lltok_memo(lltok: Any, name: str, make: Callable[[Any], T]) -> T:
    """`make(lltok)`, made once per kept llguidance tokenizer and let go with its model
    tokenizer; made afresh on each call for any other."""
    entry = _BY_LLTOK.get(id(lltok))
    if entry is None or entry.lltok is not lltok:
        return make(lltok)
    value = entry.memo.get(name)
    if value is None:
        value = entry.memo.setdefault(name, make(lltok))
    return cast("T", value)
