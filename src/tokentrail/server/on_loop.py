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
    try:
        while scheduler.run_pass(batch):
            if scheduler.admissible:
                await asyncio.sleep(0)  # room was made: admit at once, after the readers
            else:
                await batch.arrival(batch.wait if scheduler.running else None)
    except Exception:
        logger.exception("the scheduler's loop failed")
        raise
    finally:
        try:
            await batch.aclose()
        finally:
            scheduler.wind_up()
