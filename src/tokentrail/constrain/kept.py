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
from collections.abc import Callable
from typing import Any, TypeVar, cast

from ..weakid import IdWeakMap

T = TypeVar("T")

__all__ = ["STRONG_KEPT", "keep", "lltok_memo", "lltok_of"]

#: Tokenizers held strongly at most (those that cannot be weakly referenced).
STRONG_KEPT = 4


class _Entry:
    __slots__ = ("lltok", "memo")

    def __init__(self, lltok: Any) -> None:
        self.lltok = lltok
        self.memo: dict[str, Any] = {}


#: The same entries by `id(lltok)`: each goes with its tokenizer's (`_unindex`).
_BY_LLTOK: dict[int, _Entry] = {}
_lock = threading.RLock()


def _unindex(entry: _Entry, index: dict[int, _Entry] = _BY_LLTOK, lock: Any = _lock) -> None:
    # (The index and lock bound here: at interpreter exit a tokenizer's weak-reference
    # callback can run after this module's globals are cleared.)
    with lock:
        if index.get(id(entry.lltok)) is entry:
            del index[id(entry.lltok)]


#: Entries by model tokenizer.
_BY_TOKENIZER: IdWeakMap[_Entry] = IdWeakMap(strong=STRONG_KEPT, on_drop=_unindex)


def lltok_of(tokenizer: Any) -> Any | None:
    """The llguidance tokenizer kept for `tokenizer`, or None."""
    entry = _BY_TOKENIZER.get(tokenizer)
    return None if entry is None else entry.lltok


def keep(tokenizer: Any, lltok: Any) -> Any:
    """File `lltok` under `tokenizer` until the tokenizer is gone; returns `lltok`."""
    entry = _Entry(lltok)
    with _lock:
        _BY_LLTOK[id(lltok)] = entry
    _BY_TOKENIZER.put(tokenizer, entry)
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
