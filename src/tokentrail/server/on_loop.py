"""The scheduler's passes on the server's own event loop, for a batch whose sequences
are themselves I/O on that loop (the proxy's upstream streams: `batch_on_loop` engines).

The model thread of `tokentrail.server.scheduler` exists so that a model's compute never
blocks the event loop. An upstream's batch computes nothing: its sequences are HTTP
streams. Run on a thread, every token crossed two threads (the reader's bytes to the
scheduler, the scheduler's events to the event loop), each a wake-up through a pipe and
a hand-over of the GIL. `drive` runs the same passes (`Scheduler.run_pass`: admit, reap,
one batch step, the output stage per token, the events handed to their streams) as a
task on the server's loop, and between passes awaits the batch's `arrival`: the next
upstream bytes, a request that arrived (`wake`), or, with sequences running, the batch's
`wait` (so stalled clients are still reaped); it does not wait while a queued request
can be admitted.

While it waits, the steps that arrive do not wake it: the reader task that read them
runs the same pass there (`run_pass`, from the batch's `on_arrival`), so a token
crosses two tasks (the reader, the client's SSE writer), not three. The driver wakes
when the scheduler stops, when a request can be admitted (`wake`, or room the pass
made), at its standing `wait`, and for a pass that failed in a reader, which it raises
as its own. Where reads bring one event each (one client, a model's pace) this saves
about 5% of the proxy's CPU per token; where they bring many, nothing measurable
(``benchmarks/results/proxy-cpu.md``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger("tokentrail.server")

__all__ = ["drive"]


async def drive(scheduler: Any, batch: Any) -> None:
    """Run `scheduler`'s passes over `batch` on this loop until the scheduler stops; then
    close the batch and cancel what is left (`Scheduler.wind_up`)."""
    batch.attach(asyncio.get_running_loop())
    failed: list[Exception] = []
    running = False

    def on_arrival() -> bool | None:
        # Steps arrived while the driver waits: the reader that read them runs the pass
        # (the same `run_pass`), and the driver sleeps on unless the scheduler stops, a
        # request can be admitted, or the pass failed (then it wakes and raises). None:
        # no pass ran here (one is under way, or one failed): the driver wakes.
        nonlocal running
        if running or failed:
            return None
        running = True
        try:
            return not scheduler.run_pass(batch) or scheduler.admissible
        except Exception as e:
            failed.append(e)
            return True
        finally:
            running = False

    batch.on_arrival = on_arrival
    try:
        while not failed and scheduler.run_pass(batch):
            if scheduler.admissible:
                await asyncio.sleep(0)  # room was made: admit at once, after the readers
            else:
                await batch.arrival(batch.wait if scheduler.running else None)
        if failed:
            raise failed[0]
    except Exception:
        logger.exception("the scheduler's loop failed")
        raise
    finally:
        batch.on_arrival = None
        try:
            await batch.aclose()
        finally:
            scheduler.wind_up()
