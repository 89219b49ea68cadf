"""A sequence its batch lets go of before its reply has ended gets an error, not a wait.

A batch drops a sequence on its own when the engine's stream for it ends (an upstream
that closed its stream, vLLM finishing a request): the sequence's state has normally
ended with its last step, and the scheduler has taken it out. Where the state has not
(no end token it knows, under the token limit), the scheduler used to wait for steps
that never came, and the client with it. Now the request ends with a 502 error event.

A real `Scheduler` on the built-in demo model (MLX, its real batch) and a real asyncio
loop; the fault is injected by having the batch let go of one sequence after three
steps, as an engine whose stream ended would. The other request is unharmed: its tokens
are those it gets alone.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("prometheus_client")

import tokentrail
from tests.helpers.scheduler import submit_completions
from tokentrail.server.jobs import Job
from tokentrail.server.scheduler import Scheduler

PROMPTS = ["The list", "A generator"]
MAX_TOKENS = 12


async def _drain(job: Job) -> list[Any]:
    events = []
    while True:
        event = await asyncio.wait_for(job.next_event(), 120)
        events.append(event)
        if event[0] != "step":  # done, error or cancelled
            return events


def _run(dropping: bool) -> list[list[Any]]:
    model, tokenizer = tokentrail.load()
    sched = Scheduler(model, tokenizer, max_batch=len(PROMPTS))
    opened = sched._open
    seen: dict[int, int] = {}

    def open_dropping() -> Any:
        batch = opened()
        step = batch.step

        def step_and_drop() -> Any:
            out = step()
            for uid, _ in out:
                seen[uid] = seen.get(uid, 0) + 1
                if dropping and uid == min(seen) and seen[uid] == 3:
                    batch.remove(uid)  # the engine let go of it mid-reply
            return out

        batch.step = step_and_drop
        return batch

    sched._open = open_dropping  # type: ignore[method-assign]
    sched.start(timeout=300)
    try:

        async def main() -> list[list[Any]]:
            jobs = submit_completions(sched, PROMPTS, MAX_TOKENS)
            return list(await asyncio.gather(*(_drain(job) for job in jobs)))

        return asyncio.run(main())
    finally:
        sched.stop()


def test_a_sequence_the_batch_let_go_of_ends_with_an_error_and_the_other_goes_on() -> None:
    alone = _run(dropping=False)
    events = _run(dropping=True)
    kinds = [[e[0] for e in job] for job in events]
    lost = next(i for i, k in enumerate(kinds) if k[-1] == "error")
    error = events[lost][-1][2]
    assert getattr(error, "status", None) == 502 and "ended before the reply" in str(error)
    assert kinds[lost].count("step") == 3
    other = 1 - lost
    assert kinds[other][-1] == "done"
    assert [e[2].token for e in events[other] if e[0] == "step"] == [
        e[2].token for e in alone[other] if e[0] == "step"
    ]
