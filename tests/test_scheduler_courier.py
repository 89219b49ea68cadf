"""The courier thread: a batch whose step is one GIL-free call (llama.cpp's `llama_decode`)
has its events handed to the event loop from another thread, so that waking the event
loop never makes the model thread wait for the GIL the event loop takes.

What must hold: every event reaches its reader, in the order it was posted, including
what is still queued when the courier closes; the wake-ups (`call_soon_threadsafe`) come
from the courier thread, never from the loop thread; and a real `Scheduler` over a real
llama.cpp model still gives each request llama-cpp-python's own greedy tokens. Real
asyncio loops and threads, no HTTP, no wall-clock asserts.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from tests.helpers.scheduler import LoopCalls, submit_completions
from tokentrail.server.jobs import Courier, Outbox


async def produce(n_passes: int, per_pass: int, close_at_once: bool) -> tuple[list[Any], Any]:
    """A producer thread posts `n_passes` passes of events for three readers through an
    Outbox with a courier; returns what each reader got and the loop's callers."""
    loop = asyncio.get_running_loop()
    calls = LoopCalls(loop)
    queues: list[asyncio.Queue[Any]] = [asyncio.Queue() for _ in range(3)]
    courier = Courier()
    outbox = Outbox(courier)

    def producer() -> None:
        for p in range(n_passes):
            for k in range(per_pass):
                for r, q in enumerate(queues):
                    outbox.add(loop, q, (r, p, k))
            outbox.flush()
        if close_at_once:
            courier.close()

    thread = threading.Thread(target=producer, name="producer")
    thread.start()
    want = n_passes * per_pass
    try:
        got = [[await asyncio.wait_for(q.get(), 30) for _ in range(want)] for q in queues]
    finally:
        await asyncio.to_thread(thread.join)
        if not close_at_once:
            courier.close()
        calls.restore()
    return got, calls.callers("_deliver")


@pytest.mark.parametrize("close_at_once", [False, True], ids=["open", "closed-after-posting"])
def test_every_event_arrives_in_order_and_only_the_courier_wakes_the_loop(
    close_at_once: bool,
) -> None:
    got, callers = asyncio.run(produce(50, 3, close_at_once))
    for r, events in enumerate(got):
        assert events == [(r, p, k) for p in range(50) for k in range(3)]
    assert callers, "the event loop was never woken"
    assert set(callers) == {"tokentrail-courier"}
    assert len(callers) <= 50  # at most one wake-up per pass


def test_a_closed_courier_ends_its_thread() -> None:
    courier = Courier()
    courier.close()
    assert not any(t.name == "tokentrail-courier" and t.is_alive() for t in threading.enumerate())


# -- a real Scheduler over llama.cpp --------------------------------------------------------------

PROMPTS = ["The list", "A generator", "import this"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def llama_scheduler(demo_gguf: Any) -> Any:
    pytest.importorskip("prometheus_client")
    from tokentrail.server.scheduler import Scheduler

    sched = Scheduler(model_path=str(demo_gguf), engine="llamacpp", max_batch=len(PROMPTS))
    sched.start(timeout=300)
    yield sched
    sched.stop()


async def run_jobs(scheduler: Any, prompts: list[str]) -> tuple[list[list[int]], list[str]]:
    """Submit one completion per prompt together; each one's tokens, and the threads that
    handed events to the event loop meanwhile."""
    from tokentrail.server.jobs import Job

    calls = LoopCalls(asyncio.get_running_loop())
    try:
        jobs = submit_completions(scheduler, prompts, MAX_TOKENS)

        async def drain(job: Job) -> list[int]:
            tokens = []
            while True:
                kind, _, value = await asyncio.wait_for(job.next_event(), 120)
                if kind != "step":
                    assert kind == "done", value
                    return tokens
                assert value.index == len(tokens)  # in order, none twice
                tokens.append(value.token)

        results = await asyncio.gather(*(drain(job) for job in jobs))
    finally:
        calls.restore()
    return list(results), calls.callers("_deliver")


def test_a_llamacpp_scheduler_delivers_through_the_courier(
    llama_scheduler: Any, demo_ref: Any
) -> None:
    assert any(t.name == "tokentrail-courier" for t in threading.enumerate())
    got, callers = asyncio.run(run_jobs(llama_scheduler, PROMPTS))
    assert set(callers) == {"tokentrail-courier"}
    from tokentrail.prompting import prompt_ids

    engine_vocab = llama_scheduler.vocab.size
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        ids = prompt_ids(llama_scheduler.tokenizer, prompt, engine_vocab, None)
        demo_ref.reset()
        want = []
        for tok in demo_ref.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            want.append(int(tok))
            if len(want) == MAX_TOKENS:
                break
        assert tokens == want, prompt
