"""Admission: the queue in front of the batch, and the bookkeeping `/health` shows.

A request takes a place for each of its `n` sequences. It joins the batch at once while
there is room; otherwise it waits, first come first served, up to `max_queue`
sequences, and beyond that it is refused (`QueueFull`, a 429 with `Retry-After` from
recent request durations). The batch's capacity is known once the engine's batch is
open (`capacity`); until then every request waits. One lock (`cond`) guards the queue,
the running requests and the recent outcomes; the loop thread waits on it for work.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Any

from ..errors import APIError, QueueFull
from .jobs import Job
from .metrics import Metrics

__all__ = ["RECENT_JOBS", "Admission"]

#: How many finished requests /health remembers.
RECENT_JOBS = 32


class Admission:
    """Who waits, who runs and who was refused; see the module."""

    def __init__(self, max_queue: int, capacity: int | None, metrics: Metrics) -> None:
        self.max_queue = max_queue
        #: Sequences decoded together (None until the engine's batch is open).
        self.capacity = capacity
        self.metrics = metrics
        self.cond = threading.Condition()
        self.pending: deque[Job] = deque()
        self.running: dict[str, Job] = {}
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_JOBS)
        #: Recent batch-step durations and request lengths, for `Retry-After`.
        self.step_seconds: deque[float] = deque(maxlen=64)
        self.job_tokens: deque[int] = deque(maxlen=64)
        #: Places held by admitted jobs the event loop runs (`Job.outside`).
        self.outside = 0

    def submit(self, job: Job) -> None:
        """Queue `job` (FIFO); raise QueueFull when the batch and the queue are full."""
        n = job.request.n
        capacity = self.capacity
        if capacity is not None and n > capacity:
            raise self.too_many(n, capacity)
        with self.cond:
            self.purge()
            busy = sum(j.request.n for j in self.pending) + sum(
                j.request.n for j in self.running.values()
            )
            room = 0 if capacity is None else capacity  # not loaded yet: all of it waits
            if busy + n > room + self.max_queue:
                self.metrics.request_outcome("rejected")
                raise QueueFull(len(self.pending), self.retry_after())
            if capacity is not None and busy + n > room:  # the batch is full: it waits
                job.waited_for_room = True
                self.metrics.queued_for_room.inc()
            self.pending.append(job)
            self.metrics.queue_depth.set(len(self.pending))
            self.cond.notify_all()

    @staticmethod
    def too_many(n: int, capacity: int) -> APIError:
        return APIError(
            400,
            f"'n' is {n} but this server decodes at most {capacity} sequences "
            "together (--max-batch)",
            param="n",
            code="unsupported_value",
        )

    def purge(self) -> None:
        """Forget queued requests whose clients have gone (caller holds the lock)."""
        for job in [j for j in self.pending if j.cancelled.is_set()]:
            self.pending.remove(job)
            self.finish(job, "cancelled")

    def take(self, live: int) -> list[Job]:
        """The queued requests the batch (with `live` sequences in it) has room for,
        first come first served (caller holds the lock); a request for more sequences
        than the batch ever holds is answered with an error."""
        self.purge()
        capacity = self.capacity or 1
        admit = []
        free = capacity - live - self.outside
        now = time.monotonic()
        while self.pending and self.pending[0].request.n <= free:
            job = self.pending.popleft()
            free -= job.request.n
            admit.append(job)
            self.metrics.queue_wait.observe(now - job.submitted)
        if self.pending and self.pending[0].request.n > capacity:  # submitted early
            job = self.pending.popleft()
            job.post("error", 0, self.too_many(job.request.n, capacity))
            self.finish(job, "failed")
        self.metrics.queue_depth.set(len(self.pending))
        return admit

    def admissible(self, live: int) -> bool:
        """Whether the first queued request can be taken now, with `live` sequences in
        the batch (caller holds the lock): a request that never fits is taken (to be
        refused)."""
        if not self.pending:
            return False
        capacity = self.capacity or 1
        n = self.pending[0].request.n
        return n > capacity or n <= capacity - live - self.outside

    def hold(self, job: Job) -> bool:
        """Give an outside job (`Job.outside`, run by the event loop) its place and tell
        it to start; False when it was cancelled first (checked under the lock, as
        `release` is)."""
        with self.cond:
            if job.cancelled.is_set():
                return False
            self.running[job.id] = job
            self.outside += 1
            job.post("admitted")
            return True

    def release(self, job: Job, outcome: str, ttft: float | None = None) -> bool:
        """Free an outside job's place and record it: `outcome`, its `generated` tokens,
        `ttft` (s). From the event loop; only the first call counts (True)."""
        with self.cond:
            if self.running.get(job.id) is not job:
                return False
            self.outside -= 1
            if job.generated:
                self.metrics.generated_tokens.inc(job.generated)
            if ttft is not None:
                self.metrics.ttft.observe(ttft)
            self.finish(job, outcome)
            self.cond.notify_all()
        return True

    def start(self, job: Job) -> None:
        """`job` has sequences in the batch now."""
        with self.cond:
            self.running[job.id] = job

    def finish(self, job: Job, outcome: str) -> None:
        """Record a finished request."""
        with self.cond:
            self.running.pop(job.id, None)
            job.outcome = outcome
            self.recent.append(
                {"id": job.id, "outcome": outcome, "generated_tokens": job.generated}
            )
            self.metrics.request_outcome(outcome)  # with /health's lock: counts match recent
            if job.generated:
                self.job_tokens.append(job.generated)

    def retry_after(self) -> int:
        """Seconds until a slot is likely free, from recent request durations."""
        if not self.step_seconds or not self.job_tokens:
            return 1
        per_step = sum(self.step_seconds) / len(self.step_seconds)
        per_job = sum(self.job_tokens) / len(self.job_tokens)
        return max(1, min(60, math.ceil(per_step * per_job)))

    def stats(self) -> dict[str, Any]:
        """The queue's part of `/health`."""
        with self.cond:
            running = [
                {"id": j.id, "generated_tokens": j.generated} for j in self.running.values()
            ]
            return {
                "active": len(running),
                "queued": len(self.pending),
                "max_queue": self.max_queue,
                "max_batch": self.capacity,
                **self.metrics.outcome_counts(),
                "queued_for_room": self.metrics.waited_for_room(),
                "generated_tokens": self.metrics.tokens_generated(),
                "running": running[0] if running else None,
                "batch": running,
                "recent": list(self.recent),
            }
