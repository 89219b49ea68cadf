"""The choices in the batch: requests joined as sequences, each step through its
choice's output stage, and each choice's leaving.

`Choices` is the scheduler's table of what runs (`tokentrail.server.scheduler`): a
request's `n` choices join as sequences of the engine's batch (or beside it, for field
retry: `server.solo`), every engine step goes through its choice's `OutputProcessor`
and its record to the job, and a choice leaves when its reply ends, fails, is cancelled
or its client stops reading, the job recorded once its last choice has left. The
scheduler decides when these run (its passes); this module what each does.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from ..batch import open_sequence
from ..branching import Record, ReplyMemory, record_of
from ..errors import APIError, EngineError
from ..output.processor import OutputProcessor
from ..output.vote import EarlyStop, feed_early
from .admission import Admission
from .config import LoadedModel, ServerConfig
from .jobs import Job, Outbox
from .metrics import Metrics
from .prepare import prepare
from .solo import open_solo

logger = logging.getLogger("tokentrail.server")

__all__ = ["ChoiceState", "Choices"]


@dataclass(eq=False)
class ChoiceState:
    """One sequence of the batch: a choice of a job, and its output stage (the same
    `tokentrail.output.processor.OutputProcessor` that `stream_generate` uses)."""

    job: Job
    choice: int
    out: OutputProcessor
    index: int = 0
    last_step: float = 0.0
    cached: int | None = None
    #: When it joined the engine's batch (time.perf_counter), for the prefill metric.
    added: float = 0.0
    #: The engine records of the steps fed so far, and what they continue (prompt ids,
    #: sampling settings): kept in the scheduler's `ReplyMemory` for later branches.
    records: list[Record] | None = None
    prompt: list[int] | None = None
    params: Any = None
    #: The request's early stop, shared by its `n` choices (None: not asked for).
    early: EarlyStop | None = None
    #: A choice that runs beside the batch (field retry: `server.solo.Solo`), or None.
    solo: Any = None


class Choices:
    """The sequences in the batch by uid (`seqs`; negative uids run beside it), and
    what happens to them: `join`, `advance`, `post`, `reap`, `lost`, `leave`. The
    parts it shares with the scheduler are given once; `loaded` is set when the model
    is."""

    def __init__(
        self,
        config: ServerConfig,
        admission: Admission,
        metrics: Metrics,
        replies: ReplyMemory,
        outbox: Outbox,
    ) -> None:
        self.config = config
        self.admission = admission
        self.metrics = metrics
        self.replies = replies
        self.outbox = outbox
        self.loaded: LoadedModel | None = None
        self.seqs: dict[int, ChoiceState] = {}
        self._solo_uid = 0  # the last uid given to a choice beside the batch (negative)

    def lost(self, batch: Any) -> None:
        """End with an error each sequence the batch no longer holds though its reply
        has not ended (a stream that ended early), instead of waiting for steps that
        never come."""
        for uid, seq in list(self.seqs.items()):
            if seq.solo is None and not batch.holds(uid):
                why = EngineError(
                    "the engine's stream ended before the reply did (no end token, under "
                    "the token limit)", 502, "stream_ended",
                )  # fmt: skip
                logger.info("request %s: %s", seq.job.id, why)
                seq.job.post("error", seq.choice, why)
                self.leave(batch, seq, "failed")

    def join(self, batch: Any, job: Job) -> None:
        """Turn a request into `n` sequences of the batch, or answer it with an error; a
        job the event loop runs (`Job.outside`) takes its place and is told to start."""
        if job.outside and self.admission.hold(job):
            return
        if job.cancelled.is_set():
            self.admission.finish(job, "cancelled")
            return
        req = job.request
        try:
            loaded = self.loaded
            assert loaded is not None
            ready = prepare(
                req, loaded.engine, loaded.tokenizer, self.config, self.replies,
                context_length=loaded.context_length,
            )  # fmt: skip
        except (APIError, ValueError, TypeError) as e:
            logger.info("request %s refused: %s", job.id, e)
            job.post("error", 0, e)
            self.admission.finish(job, "failed")
            return
        except Exception as e:  # a fault in preparing this request: a 500 for it alone
            logger.exception("preparing request %s failed", job.id)
            job.post("error", 0, e)
            self.admission.finish(job, "failed")
            return
        self.admission.start(job)
        job.outbox = self.outbox
        if req.prompt_only:  # echo with max_tokens 0: the prompt alone, nothing to run
            for choice in range(req.n):
                job.post("done", choice, None)
            self.admission.finish(job, "completed")
            return
        branch = ready.branch
        prefix = [] if branch is None else branch.engine_ids[len(ready.ids) :]
        # vLLM's ignore_eos and stop_token_ids: a stop id ends the reply as an end token
        # does (listed, its text left out, "stop"), as vLLM's stop-terminated replies
        eos = (frozenset() if req.ignore_eos else loaded.eos) | frozenset(req.stop_token_ids)
        early = job.early_stop = EarlyStop(req.n) if req.early_stop else None
        try:
            for choice in range(req.n):
                if ready.retry is not None:
                    self._join_solo(job, ready, choice, eos)
                    continue
                uid, state = open_sequence(
                    batch, loaded.engine, loaded.tokenizer, ready.ids, ready.params,
                    ready.limit, req.stop, choice=choice, eos=eos, prefix=prefix,
                    skip_special_tokens=req.skip_special_tokens,
                )  # fmt: skip
                job.live += 1
                now = time.perf_counter()
                out = OutputProcessor(
                    state, calibration=loaded.calibration, **ready.outputs[choice]
                )
                seq = ChoiceState(
                    job, choice, out, last_step=now, added=now, early=early
                )
                seq.records, seq.prompt, seq.params = [], ready.ids, ready.params
                self.seqs[uid] = seq
                if branch is not None:  # the kept prefix, as the original reply had it
                    for replayed in branch.replay:
                        if self.seqs.get(uid) is not seq:
                            break  # it ended inside the prefix (a stop string)
                        self.advance(batch, uid, seq, replayed)
        except (ValueError, TypeError) as e:  # the engine refused the prompt or a setting
            logger.info("request %s refused by the engine: %s", job.id, e)
            job.post("error", 0, e)
            added = [s for s in self.seqs.values() if s.job is job]
            for seq in added:
                self.leave(batch, seq, "failed")  # the last one records the job
            if not added:
                self.admission.finish(job, "failed")
        self.metrics.batch_size.set(len(self.seqs))

    def _join_solo(self, job: Job, ready: Any, choice: int, eos: frozenset[int]) -> None:
        """Choice `choice` beside the batch, on the engine's rewindable steps (field
        retry); its uid is negative, never one the batch gives."""
        loaded = self.loaded
        assert loaded is not None
        solo = open_solo(
            loaded.engine, loaded.tokenizer, ready, choice, job.request.stop, eos,
            loaded.calibration, skip_special_tokens=job.request.skip_special_tokens,
        )  # fmt: skip
        job.live += 1
        now = time.perf_counter()
        self._solo_uid -= 1
        self.seqs[self._solo_uid] = ChoiceState(
            job, choice, solo.retry.processor, last_step=now, added=now, cached=0, solo=solo
        )

    def step_solos(self, batch: Any) -> None:
        """One model step of each choice beside the batch; post what it released."""
        for seq in [s for s in self.seqs.values() if s.solo is not None]:
            try:
                records = seq.solo.advance()
            except Exception as e:
                logger.exception("request %s failed", seq.job.id)
                seq.job.post("error", seq.choice, e)
                self.leave(batch, seq, "failed")
                continue
            for record in records:
                self.post(batch, seq, record)

    def advance(self, batch: Any, uid: int, seq: ChoiceState, engine_step: Any) -> None:
        """Run one batch step through the sequence's output stage; post its record."""
        job = seq.job
        if seq.cached is None:
            seq.cached = int(batch.cached_tokens(uid))
            self.metrics.prompt_cache(seq.cached)
        if isinstance(engine_step, Exception):  # this sequence failed in the engine
            logger.info("request %s failed in the engine: %s", job.id, engine_step)
            job.post("error", seq.choice, engine_step)
            self.leave(batch, seq, "failed")
            return
        if seq.records is not None:
            seq.records.append(record_of(engine_step))
        try:
            if seq.early is None:
                step = seq.out.feed(engine_step, seq.cached)
            else:  # early stop may make this token the choice's last
                step = feed_early(seq.early, seq.choice, seq.out, engine_step, seq.cached)
        except Exception as e:
            logger.exception("request %s failed", job.id)
            job.post("error", seq.choice, e)
            self.leave(batch, seq, "failed")
            return
        self.post(batch, seq, step)

    def post(self, batch: Any, seq: ChoiceState, step: Any) -> None:
        """Hand a sequence's record to its job (and take the sequence out on its last)."""
        job = seq.job
        now = time.perf_counter()
        if seq.index == 0:
            self.metrics.ttft.observe(time.monotonic() - job.submitted)
            self.metrics.prefill.observe(now - seq.added)
        else:
            self.metrics.itl.observe(now - seq.last_step)
        seq.last_step = now
        seq.index += 1
        with self.admission.cond:
            job.generated += 1
            self.metrics.generated_tokens.inc()
        job.post("step", seq.choice, step)
        if step.finish_reason is not None:
            # Out of the batch before the client hears it is done, so its next request
            # finds the room this one leaves.
            self.leave(batch, seq, "completed")
            job.post("done", seq.choice, None)

    def reap(self, batch: Any) -> None:
        """Take cancelled requests and clients that stopped reading out of the batch."""
        now = time.monotonic()
        timeout, most = self.config.client_timeout, self.config.max_buffered
        for seq in list(self.seqs.values()):
            job = seq.job
            if job.cancelled.is_set():
                self.leave(batch, seq, "dropped" if job.dropped else "cancelled")
                continue
            backlog = job.posted - job.read
            stalled = backlog > 0 and now - job.last_read > timeout
            if stalled or backlog > most:
                why = f"not read for {timeout:g} s" if stalled else f"over {most} steps unread"
                logger.info("dropping the client of %s: %s", job.id, why)
                job.reason = "client too slow: " + why
                job.dropped = True
                job.cancelled.set()
                job.post("cancelled", 0, job.reason)
                self.leave(batch, seq, "dropped")

    def leave(self, batch: Any, seq: ChoiceState, outcome: str) -> None:
        """Remove a sequence; when it was its job's last, record the job as `outcome`."""
        for uid, other in list(self.seqs.items()):
            if other is seq:
                if seq.solo is None:
                    batch.remove(uid)
                else:
                    seq.solo.close()
                del self.seqs[uid]
                break
        if outcome == "completed" and seq.records:
            self.replies.keep(seq.prompt or [], seq.params, seq.records)
        job = seq.job
        job.live -= 1
        if outcome != "completed" and job.outcome == "queued":
            job.outcome = outcome  # the first failure decides the job's outcome
        if job.live <= 0:
            final = job.outcome if job.outcome != "queued" else outcome
            if final == "completed" and job.cancelled.is_set():
                final = "dropped" if job.dropped else "cancelled"
            if final == "cancelled":
                job.post("cancelled", 0, job.reason or "cancelled")
            self.admission.finish(job, final)
        self.metrics.batch_size.set(len(self.seqs))
