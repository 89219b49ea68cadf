"""`PromptStore`, the token-trie index of the llama.cpp batch's host-memory prompt cache,
against brute force over the states it says it keeps: the longest shared prefix, the
store staying prefix-free and within its bound, and what each `put` drops (the states
the new one extends, then the least recently used). Small token alphabets make prefixes
shared at every depth. The llama.cpp side is in tests/test_llamacpp_prompt_cache.py.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tokentrail.engines.saved_prompts import PromptStore, SavedPrompt

tokens = st.lists(st.integers(0, 3), min_size=0, max_size=8)


def entry(toks: list[int], size: int) -> SavedPrompt:
    return SavedPrompt(list(toks), np.zeros(size, dtype=np.uint8))


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def check_store(store: PromptStore) -> None:
    kept = store.entries()
    assert store.nbytes == sum(e.size for e in kept) <= store.limit
    assert len(store) == len(kept)
    for a in kept:
        assert a.tokens
        for b in kept:
            if a is not b:
                assert shared(a.tokens, b.tokens) < len(a.tokens), "not prefix-free"


@settings(max_examples=400, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["put", "ask"]), tokens, st.integers(1, 40)), max_size=30
    ),
    limit=st.integers(1, 120),
)
def test_the_store_agrees_with_brute_force(
    ops: list[tuple[str, list[int], int]], limit: int
) -> None:
    store = PromptStore(limit)
    for op, toks, size in ops:
        before = store.entries()
        if op == "ask":
            found, n = store.longest(toks)
            best = max((shared(e.tokens, toks) for e in before), default=0)
            assert n == best
            if best == 0:
                assert found is None
            else:
                assert found in before and shared(found.tokens, toks) == best
            continue
        new = entry(toks, size)
        kept = store.put(new)
        after = store.entries()
        check_store(store)
        covered = any(shared(e.tokens, toks) == len(toks) for e in before)
        assert kept == (bool(toks) and not covered and size <= limit)
        if not kept:
            assert set(map(id, after)) == set(map(id, before))
            continue
        assert after[-1] is new  # the most recently used
        extended = [e for e in before if shared(e.tokens, toks) == len(e.tokens)]
        assert not any(e in after for e in extended)
        evicted = [e for e in before if e not in after and e not in extended]
        rest = [e for e in before if e not in extended]
        assert evicted == rest[: len(evicted)]  # least recently used first
        if evicted:  # no more than needed: keeping the last one would break the bound
            assert store.nbytes + evicted[-1].size > limit


def test_a_touched_state_outlives_older_ones() -> None:
    store = PromptStore(30)
    a, b, c = entry([1, 2], 10), entry([2, 3], 10), entry([3, 4], 10)
    for e in (a, b, c):
        assert store.put(e)
    store.touch(a)
    assert store.put(entry([0], 10))  # one must go: b, the least recently used
    assert b not in store.entries() and a in store.entries()


def test_a_state_over_the_bound_is_not_kept() -> None:
    store = PromptStore(10)
    assert not store.put(entry([1, 2, 3], 11))
    assert len(store) == 0 and store.longest([1, 2]) == (None, 0)


def test_removing_prunes_the_trie() -> None:
    store = PromptStore(100)
    a, b = entry([1, 2, 3], 5), entry([1, 2, 4], 5)
    store.put(a)
    store.put(b)
    store.remove(a)
    assert store.longest([1, 2, 3]) == (b, 2)
    store.remove(b)
    assert store.longest([1, 2, 3]) == (None, 0)
