"""What a long-running server leaves to Python's garbage collector (issue #32).

Measured on the proxy (``benchmarks/results/proxy-cpu.md``, "Garbage collection"): each
full collection traversed the loaded tokenizer (about 350,000 objects on the demo model),
every finished stream's realigner (held in a reference cycle), and every record the
reply memory keeps (a list inside each). A full collection took about 200 ms, every few
seconds under load: a stall of every stream and a fifth of the proxy's CPU per token.

These tests pin the three fixes: a finished realigner is freed by reference counting
alone; the reply memory's records are tuples the collector stops tracking; the server
freezes its start-up heap once the model is loaded.
"""

from __future__ import annotations

import gc
import json
import math
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokentrail.branching import ReplyMemory, record_of
from tokentrail.engines.base import Step
from tokentrail.realign import Realigner
from tokentrail.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "src" / "tokentrail" / "demo_model"
RECORDINGS = REPO / "tests" / "data" / "realign" / "llamacpp_demo"


@pytest.fixture
def no_collector() -> Iterator[None]:
    """Only reference counting frees objects while the test runs."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _chunks(name: str) -> list[dict[str, object]]:
    lines = (RECORDINGS / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.mark.parametrize("name", ["llamacpp_completion_mixed_t15", "llamacpp_v1_chat_cjk_t0"])
def test_a_finished_realigner_is_freed_without_the_collector(name: str, no_collector: None) -> None:
    # Real llama-server recordings on the demo model (one streamed /completion at
    # temperature 1.5, one chat stream): realigned to the end, with the result read.
    events: list[object] = []
    r = Realigner(str(DEMO), on_token=events.append)
    result = r.realign(_chunks(name))
    assert result.tokens > 0 and events
    refs = [weakref.ref(r), weakref.ref(r._feeder)]
    del r
    assert [ref() for ref in refs] == [None, None], "a reference cycle keeps the realigner"
    # The result outlives the realigner and keeps what it said.
    assert result.text and isinstance(result.warnings, list)


def test_reply_records_are_left_alone_by_the_collector() -> None:
    top = [(5, -0.25), (7, -1.5), (11, -3.0)]
    steps = [Step(5, -0.25, list(top), None), Step(7, -1.0, [], None)]
    records = [record_of(s) for s in steps]
    memory = ReplyMemory(limit=100)
    memory.keep([1, 2, 3], SamplingParams(top_logprobs=3), records)
    gc.collect()
    gc.collect()
    assert not any(gc.is_tracked(rec) for rec in records)
    # What the memory gives back is what was kept.
    found = memory.find([1, 2, 3], SamplingParams(top_logprobs=3), [5], 2)
    assert found is not None
    assert [list(rec[2]) for rec in found] == [top, []]
    assert [(rec[0], rec[1]) for rec in found] == [(5, -0.25), (7, -1.0)]


def test_the_server_freezes_its_start_up_heap() -> None:
    code = (
        "import gc, tokentrail.server.cli as c; from tokentrail import load_vocab;"
        f"v = load_vocab({str(DEMO)!r}); assert gc.get_freeze_count() == 0;"
        "d = gc.get_threshold(); c._settle_heap(); print(gc.get_freeze_count(), *d,"
        " *gc.get_threshold())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    frozen, *numbers = map(int, out.stdout.split())
    assert frozen > 10_000  # the interpreter, the modules and the vocabulary
    # Collections come less often than at Python's default thresholds, full ones (the
    # product of the three) far less often.
    default, now = numbers[:3], numbers[3:]
    assert all(a >= b for a, b in zip(now, default, strict=True))
    assert math.prod(now) >= 50 * math.prod(default)
