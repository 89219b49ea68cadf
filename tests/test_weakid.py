"""`tokentrail.weakid.IdWeakMap`: values by object identity, let go with the object."""

from __future__ import annotations

import gc

from tokentrail.weakid import IdWeakMap


class Obj:
    pass


class Dictish(dict):  # what an MLX module is: unhashable, equal to any like dict
    pass


def test_an_entry_answers_only_for_its_own_object_and_goes_with_it() -> None:
    dropped: list[str] = []
    m: IdWeakMap[str] = IdWeakMap(on_drop=dropped.append)
    a, b = Dictish(), Dictish()  # equal, and unhashable
    assert m.put(a, "a") and m.put(b, "b")
    assert (m.get(a), m.get(b), len(m)) == ("a", "b", 2)
    assert m.get(Dictish()) is None
    del a
    gc.collect()
    assert dropped == ["a"] and len(m) == 1 and m.get(b) == "b"


def test_a_freed_objects_id_reused_finds_nothing() -> None:
    m: IdWeakMap[int] = IdWeakMap()
    for n in range(200):  # ids of freed objects come back quickly
        o = Obj()
        assert m.get(o) is None, n
        m.put(o, n)
        del o
    assert len(m) == 0


def test_replacing_a_value_drops_the_old_one() -> None:
    dropped: list[int] = []
    m: IdWeakMap[int] = IdWeakMap(on_drop=dropped.append)
    o = Obj()
    m.put(o, 1)
    m.put(o, 2)
    assert m.get(o) == 2 and dropped == [1] and len(m) == 1


def test_objects_without_weak_references_are_held_a_few_at_most() -> None:
    refused: IdWeakMap[int] = IdWeakMap()
    assert refused.put(7, 1) is False and refused.get(7) is None  # an int has no weakref
    dropped: list[int] = []
    m: IdWeakMap[int] = IdWeakMap(strong=2, on_drop=dropped.append)
    held = [(i, f"x{i}" * 3) for i in range(3)]  # distinct str objects, kept alive here
    for i, s in held:
        assert m.put(s, i)
    assert dropped == [0] and len(m) == 2
    assert m.get(held[0][1]) is None and [m.get(s) for _, s in held[1:]] == [1, 2]
