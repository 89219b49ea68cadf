"""`realign.wire.entry` reads llama.cpp's plain entries on a fast path (issue #32): for
any entry, well-formed or not, it gives what the checking path gives (the same
`WireToken`, or a `RealignError`). The checking path is the one a read-only mapping
(not a dict) takes."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tokentrail.realign.result import RealignError
from tokentrail.realign.wire import entry

odd = st.none() | st.booleans() | st.text(max_size=3) | st.integers(-2, 300)
number = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-3, 0) | odd
byte_lists = st.lists(st.integers(0, 255), max_size=4) | st.lists(st.integers(-1, 300), max_size=3)


def entries(top: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    fields = {
        "id": st.integers(0, 50000) | odd,
        "token": st.text(max_size=4) | odd,
        "logprob": st.floats(-20, 0) | st.just(-1e30) | number,
        "bytes": byte_lists | odd,
        "top_logprobs": top,
        "prob": st.floats(0, 1),
        "top_probs": st.just([]),
    }
    return st.fixed_dictionaries(
        {k: v for k, v in fields.items() if k in ("id", "token", "logprob", "bytes")},
        optional={k: v for k, v in fields.items() if k in ("top_logprobs", "prob", "top_probs")},
    )


plain_top = st.lists(entries(st.none()), max_size=3) | odd


def read(e: Any) -> Any:
    try:
        return entry(e, "e", "llama.cpp")
    except RealignError as err:
        return ("error", str(err))


@settings(max_examples=400)
@given(entries(plain_top))
def test_fast_path_reads_as_the_checking_path(e: dict[str, Any]) -> None:
    assert read(e) == read(MappingProxyType(e))


def test_plain_llamacpp_entry() -> None:
    e = {"id": 7, "token": "a", "logprob": -0.5, "bytes": [97],
         "top_logprobs": [{"id": 8, "token": "b", "logprob": -1.5, "bytes": [98]}]}  # fmt: skip
    w = entry(e, "e", "llama.cpp")
    assert (w.id, w.token, w.raw, w.logprob, w.source) == (7, "a", b"a", -0.5, "llama.cpp-ids")
    assert w.top is not None and [(t.id, t.raw, t.logprob) for t in w.top] == [(8, b"b", -1.5)]
