"""Saved KV states found by the tokens they hold: the store behind the llama.cpp batch's
host-memory prompt cache (`llamacpp.batch`).

Each entry holds an engine's state for a sequence of tokens. The store is kept prefix-free,
as llama-server's `--cache-ram` keeps its states: a state whose tokens another one
extends is dropped for it, and one whose tokens a saved state already starts with is not
kept twice. Entries are looked up through a token trie, so finding the longest prefix a
prompt shares with any saved state walks the prompt once, however many states are kept
(a scan of every state cost milliseconds per request once a few hundred were kept).
Least recently used entries go first when a new one needs room under the byte bound.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PromptStore", "SavedPrompt"]

#: Trie key of the entry that ends at a node (token ids are never negative).
_END = -1


@dataclass(eq=False)
class SavedPrompt:
    """An engine's state for `tokens` (`data`: its bytes, e.g. a numpy uint8 array)."""

    tokens: list[int]
    data: Any

    @property
    def size(self) -> int:
        return int(self.data.nbytes)


class PromptStore:
    """Saved states, prefix-free, within `limit` bytes, least recently used first."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._root: dict[int, Any] = {}
        self._lru: OrderedDict[int, SavedPrompt] = OrderedDict()  # id(entry) -> entry
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._lru)

    def entries(self) -> list[SavedPrompt]:
        """The saved states, least recently used first."""
        return list(self._lru.values())

    def longest(self, ids: Sequence[int]) -> tuple[SavedPrompt | None, int]:
        """A saved state sharing the longest prefix with `ids`, and that length; (None, 0)
        when none shares a token. States sharing the same length are equivalent for a
        prompt (they differ only past what it can reuse): any one of them is returned."""
        node, n = self._root, 0
        for token in ids:
            child = node.get(token)
            if child is None:
                break
            node, n = child, n + 1
        if n == 0:
            return None, 0
        while _END not in node:  # prefix-free: every path below ends in an entry
            node = next(iter(node.values()))
        return node[_END], n

    def touch(self, entry: SavedPrompt) -> None:
        """Mark `entry` as the most recently used."""
        self._lru.move_to_end(id(entry))

    def covers(self, tokens: Sequence[int]) -> bool:
        """Whether a saved state starts with `tokens` (it is then touched): a state for
        `tokens` would add nothing."""
        found, n = self.longest(tokens)
        if found is None or n < len(tokens):
            return False
        self.touch(found)
        return True

    def put(self, entry: SavedPrompt) -> bool:
        """Keep `entry` unless it is over the bound or a saved state already starts with
        its tokens (that one is touched instead); drop the states its tokens extend, then
        the least recently used ones, to make room. Whether it was kept."""
        if not entry.tokens or self.covers(entry.tokens) or entry.size > self.limit:
            return False
        node = self._root
        for token in entry.tokens:  # drop the (at most one) state it extends
            ended = node.get(_END)
            if ended is not None:
                self.remove(ended)
            node = node.get(token)
            if node is None:
                break
        while self._lru and self.nbytes + entry.size > self.limit:
            self.remove(next(iter(self._lru.values())))
        node = self._root
        for token in entry.tokens:
            node = node.setdefault(token, {})
        node[_END] = entry
        self._lru[id(entry)] = entry
        self.nbytes += entry.size
        return True

    def remove(self, entry: SavedPrompt) -> None:
        """Forget `entry` (and the trie nodes only it used)."""
        if self._lru.pop(id(entry), None) is None:
            return
        self.nbytes -= entry.size
        path = [self._root]
        for token in entry.tokens:
            path.append(path[-1][token])
        del path[-1][_END]
        for depth in range(len(entry.tokens), 0, -1):
            if path[depth]:
                break
            del path[depth - 1][entry.tokens[depth - 1]]

    def clear(self) -> None:
        self._root = {}
        self._lru.clear()
        self.nbytes = 0
