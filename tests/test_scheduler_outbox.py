"""The scheduler hands a batch step's events to the event loop in one go.

The loop thread posts one event per token; it used to wake the event loop once per event
(`call_soon_threadsafe` writes to the loop's self-pipe each time). Now each pass of the
loop (one batch step) wakes it once. What must not change: every request gets all of
its tokens, in order, each exactly what the same request gets when it runs alone, and
those are mlx-lm's own greedy tokens for the prompt.

A real `Scheduler` on the built-in demo model and a real asyncio loop, no HTTP; no
wall-clock asserts (what is counted is wake-ups and events).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("prometheus_client")

import tokentrail
from tests.helpers.scheduler import LoopCalls, submit_completions
from tokentrail.server.jobs import Job
from tokentrail.server.scheduler import Scheduler

PROMPTS = ["The list", "A generator", "import this", "With a file"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def loaded() -> tuple[Any, Any]:
    return tokentrail.load()


@pytest.fixture(scope="module")
def scheduler(loaded: tuple[Any, Any]) -> Any:
    model, tokenizer = loaded
    sched = Scheduler(model, tokenizer, max_batch=len(PROMPTS))
    sched.start(timeout=300)
    yield sched
    sched.stop()


def mlx_lm_tokens(loaded: tuple[Any, Any], prompt: str) -> list[int]:
    """The oracle: mlx-lm's own greedy generation for the prompt's ids."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model, tokenizer = loaded
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    out = []
    for token, _ in generate_step(mx.array(ids), model, max_tokens=MAX_TOKENS):
        out.append(int(token))
    return out


async def run_jobs(scheduler: Any, prompts: list[str]) -> tuple[list[list[Any]], int]:
    """Submit one completion per prompt together; every job's events, and how many times
    the loop thread woke the event loop meanwhile."""
    calls = LoopCalls(asyncio.get_running_loop())
    try:
        jobs = submit_completions(scheduler, prompts, MAX_TOKENS)

        async def drain(job: Job) -> list[Any]:
            events = []
            while True:
                event = await asyncio.wait_for(job.next_event(), 120)
                events.append(event)
                if event[0] != "step":
                    return events

        results = await asyncio.gather(*(drain(job) for job in jobs))
    finally:
        calls.restore()
    return list(results), len(calls.calls)


def tokens_of(events: list[Any]) -> list[int]:
    assert [e[0] for e in events] == ["step"] * MAX_TOKENS + ["done"]
    steps = [e[2] for e in events[:-1]]
    assert [s.index for s in steps] == list(range(MAX_TOKENS))  # in order, none twice
    return [s.token for s in steps]


def test_events_of_a_step_wake_the_event_loop_once(scheduler: Any, loaded: Any) -> None:
    alone = {}
    for prompt in PROMPTS:
        (events,), _ = asyncio.run(run_jobs(scheduler, [prompt]))
        alone[prompt] = tokens_of(events)
        assert alone[prompt] == mlx_lm_tokens(loaded, prompt)

    together, wakeups = asyncio.run(run_jobs(scheduler, PROMPTS))
    for prompt, events in zip(PROMPTS, together, strict=True):
        assert tokens_of(events) == alone[prompt]
    posted = sum(len(events) for events in together)
    # One wake-up per pass of the loop, not per event: the four sequences decode side
    # by side for most of their steps, so there are far fewer wake-ups than events.
    assert wakeups <= posted // 2, (wakeups, posted)


def test_events_taken_together_count_as_read() -> None:
    """A stream writes every event that has already arrived in one send
    (`Job.ready_event`); taking them so is reading: the unread backlog falls and the
    reader's clock restarts, so a client that keeps up is never reaped as stalled
    (`Scheduler._reap` drops a job with a backlog not read for `client_timeout`)."""

    async def main() -> tuple[int, float, float, Any]:
        job = Job(id="j", request=None, loop=asyncio.get_running_loop())  # type: ignore[arg-type]
        for i in range(3):
            job.post("step", 0, i)
        await asyncio.sleep(0)  # the posts land on the loop
        taken = [await job.next_event()]
        job.last_read -= 3600.0  # as if that first read had been an hour ago
        stale = job.last_read
        while (event := job.ready_event()) is not None:
            taken.append(event)
        return job.posted - job.read, stale, job.last_read, taken

    backlog, stale, last_read, taken = asyncio.run(main())
    assert [e[2] for e in taken] == [0, 1, 2]
    assert backlog == 0 and last_read > stale + 3000
