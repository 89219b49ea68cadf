"""Values filed under objects by identity, each let go when its object is freed.

`weakref.WeakKeyDictionary` keys on hash and equality, which does not fit the objects
tokentrail files things under: an MLX model is an `nn.Module`, a dict (unhashable, and
equal to any dict with the same items), and a tokenizer's equality is its library's
business. `IdWeakMap` keys on `id(obj)` and keeps a weak reference to the object beside
the value, so an entry answers only for that very object and goes when it is freed: a
freed object's id, soon another object's, never finds the old value.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

V = TypeVar("V")

__all__ = ["IdWeakMap"]


class IdWeakMap(Generic[V]):
    """A map from objects (by identity) to values, an entry dropped when its object is
    freed; `on_drop(value)` then runs.

    An object that cannot be weakly referenced is held strongly, at most `strong` of
    them (the oldest let go first); with `strong=0` it is not filed at all (`put` says
    so). Safe across threads; a weak reference's callback may run inside `put` itself,
    on the same thread, when an allocation there starts a collection (a re-entrant lock).
    """

    def __init__(self, strong: int = 0, on_drop: Callable[[V], None] | None = None) -> None:
        self._items: dict[int, tuple[Any, V]] = {}
        self._strong: list[int] = []  # keys of the objects held strongly, oldest first
        self._most_strong = strong
        self._on_drop = on_drop
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, obj: Any) -> V | None:
        """The value filed under this very object, or None."""
        hit = self._items.get(id(obj))
        if hit is None:
            return None
        ref = hit[0]
        return hit[1] if (ref() if isinstance(ref, weakref.ref) else ref) is obj else None

    def put(self, obj: Any, value: V) -> bool:
        """File `value` under `obj` (replacing what was there); whether it was filed."""
        key = id(obj)
        self._drop(key)  # what an object freed before the callback ran left, or obj's own
        try:
            ref: Any = weakref.ref(obj, lambda _: self._drop(key))
            strong = False
        except TypeError:
            if not self._most_strong:
                return False
            ref, strong = obj, True
        with self._lock:
            self._items[key] = (ref, value)
            if strong:
                self._strong.append(key)
            oldest = self._strong[0] if len(self._strong) > self._most_strong else None
        if oldest is not None:
            self._drop(oldest)
        return True

    def _drop(self, key: int) -> None:
        with self._lock:
            hit = self._items.pop(key, None)
            if key in self._strong:
                self._strong.remove(key)
        if hit is not None and self._on_drop is not None:
            self._on_drop(hit[1])
