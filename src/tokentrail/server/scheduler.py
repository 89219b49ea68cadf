"""The scheduler: a request queue and one generation loop over a continuous batch.

One thread owns the model (loading included), so engine state such as MLX streams never
crosses threads. It drives `tokentrail.engines.batch.open_batch(engine, max_batch, ...)`
(`max_batch` None: the engine batch's own capacity): between two batch steps, waiting
requests join (first come, first served) while there is room and finished, cancelled
or stalled ones leave. A request waits in the queue only while the batch is full.
Each sequence has its own sampling settings, stop strings, seed and `Aligner` (fresh
per sequence, continuing its prompt), and goes through the same per-token loop as
`tokentrail.stream_generate`. `/metrics` has the time each request waited in the queue
and each sequence's prompt processing (its first token's wait in the batch) apart.

The loop never waits on a client: it hands each step to its request's event queue on
the asyncio loop and moves on; the events of one batch step go over together, in one
`call_soon_threadsafe` (`jobs.Outbox`), so the event loop wakes once per step, not once
per token. A request whose reader has left output unread for
`client_timeout` seconds, or has more than `max_buffered` steps unread, is dropped
and its sequences leave the batch.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..batch import open_sequence
from ..branching import Record, ReplyMemory, record_of
from ..errors import APIError, EngineError
from ..output.processor import OutputProcessor
from ..output.vote import EarlyStop, feed_early
from ..vocab import Vocab
from .admission import RECENT_JOBS, Admission
from .config import LoadedModel, Loader, ServerConfig, served_name
from .jobs import Courier, Job, Outbox
from .loading import open_model
from .metrics import Metrics
from .prepare import prepare
from .solo import open_solo

logger = logging.getLogger("tokentrail.server")

__all__ = ["RECENT_JOBS", "ChoiceState", "LoadedModel", "Scheduler", "served_name"]


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


class Scheduler:
    """Owns the model; runs queued requests together in a continuous batch.

    Give `model` and `tokenizer` (as `tokentrail.load` returns them), or a `loader`
    returning them (run on the loop thread), or a `config.model_path` for
    `tokentrail.load`. The settings are a `ServerConfig` (`config`), or its fields as
    keywords (`max_batch=4`), which update `config`: `max_batch` sequences decode
    together (None: the capacity of the engine's batch, known once the model is
    loaded); requests beyond that wait, `max_queue` at most (in sequences), and more
    are refused with `QueueFull` (`server.admission`). Each request is made ready by
    `server.prepare.prepare` and each token goes through its sequence's
    `OutputProcessor`; the records go to the event loop through `jobs.Outbox`.
    """

    def __init__(
        self,
        model: Any = None,
        tokenizer: Any = None,
        model_path: str | os.PathLike[str] | None = None,
        *,
        config: ServerConfig | None = None,
        loader: Loader | None = None,
        metrics: Metrics | None = None,
        **settings: Any,
    ) -> None:
        if (model is None) != (tokenizer is None):
            raise ValueError("pass both model and tokenizer, or neither (to load model_path)")
        if model_path is not None:
            settings["model_path"] = model_path
        self.config = config = (config or ServerConfig()).updated(**settings)
        #: What to load: (model, tokenizer) given, or a loader, or config.model_path.
        self._given: tuple[Any, Any, Loader | None] = (model, tokenizer, loader)
        self._loaded: LoadedModel | None = None
        self.metrics = metrics or Metrics()
        self.admission = Admission(config.max_queue, config.max_batch, self.metrics)
        self.model_name = config.model_name or served_name(config.model_path)
        self.created = int(time.time())
        self._seqs: dict[int, ChoiceState] = {}
        self._solo_uid = 0  # the last uid given to a choice beside the batch (negative)
        self._stopping = False
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        #: The batch's `wake` (None until it is open, or where it has none): a request that
        #: arrives while a step waits for I/O (an upstream's next token) joins at once.
        self._wake: Any = None
        #: The batch's own `stats` (None where it has none), for `/health`'s `engine_batch`.
        self._batch_stats: Any = None
        #: Events of the jobs in the batch, handed over once per pass of the loop; with
        #: `_deferred`, the batch hands them over itself (`before_compute`).
        self._outbox = Outbox()
        self._deferred = False
        #: Finished replies' engine records, that a branch request replays.
        self.replies = ReplyMemory()
        #: The batch, where it runs on the server's event loop (an engine with
        #: ``batch_on_loop``: the proxy's upstream streams); `server.on_loop.drive` runs
        #: the passes there. None: the loop thread runs them.
        self.loop_batch: Any = None

    # -- what the loop thread loaded (None before) --

    @property
    def model(self) -> Any:
        return self._given[0] if self._loaded is None else self._loaded.model

    @property
    def tokenizer(self) -> Any:
        return self._given[1] if self._loaded is None else self._loaded.tokenizer

    @property
    def vocab(self) -> Vocab | None:
        return None if self._loaded is None else self._loaded.vocab

    @property
    def calibration(self) -> Any:
        """The checked calibration the replies' confidences go through (None: none)."""
        return None if self._loaded is None else self._loaded.calibration

    @property
    def context_length(self) -> int | None:
        return None if self._loaded is None else self._loaded.context_length

    @property
    def batch_kind(self) -> str | None:
        """The class of the engine's batch (e.g. SerialBatch: one generator per sequence)."""
        return None if self._loaded is None else self._loaded.batch_kind

    @property
    def max_batch(self) -> int | None:
        """Sequences decoded together: the config's, or the engine batch's capacity."""
        return self.admission.capacity

    @property
    def max_queue(self) -> int:
        return self.admission.max_queue

    @property
    def client_timeout(self) -> float:
        return self.config.client_timeout

    # -- lifecycle --

    def start(self, timeout: float | None = None) -> None:
        """Start the loop thread and wait until the model is loaded; re-raise a load error.
        For an engine whose batch runs on the event loop (`loop_batch`), load it here
        and start no thread."""
        if getattr(self._given[0], "batch_on_loop", False):
            with self.admission.cond:
                if not self._ready.is_set():
                    self._stopping = False
                    try:
                        self.loop_batch = self._open()
                    except BaseException as e:
                        self._load_error = e
                    self._ready.set()
            if self._load_error is not None:
                raise self._load_error
            return
        with self.admission.cond:
            if self._thread is None:
                self._stopping = False
                self._thread = threading.Thread(
                    target=self._run, name="tokentrail-generate", daemon=True
                )
                self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the model did not load within {timeout} s")
        if self._load_error is not None:
            raise self._load_error

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel running and queued requests and join the loop thread (a `loop_batch`'s
        driver ends on its own loop: `server.on_loop.drive`)."""
        if self.loop_batch is not None:
            with self.admission.cond:
                self._stopping = True
            self.loop_batch.wake()
            return
        thread = self._thread
        if thread is None:
            return
        with self.admission.cond:
            self._stopping = True
            self.admission.cond.notify_all()
        if self._wake is not None:
            self._wake()
        thread.join(timeout)
        self._thread = None

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._load_error is None

    # -- API used by the HTTP layer --

    def submit(self, job: Job) -> None:
        """Queue `job` (FIFO); raise QueueFull when the batch and the queue are full."""
        self.admission.submit(job)
        if self._wake is not None and not job.waited_for_room:
            self._wake()

    def stats(self) -> dict[str, Any]:
        status = "ok" if self.ready else ("error" if self._load_error else "loading")
        return {
            "status": status,
            "model": self.model_name,
            **self.admission.stats(),
            "batch_size": len(self._seqs),
            "batch_kind": self.batch_kind,
            **({"engine_batch": self._batch_stats()} if self._batch_stats else {}),
        }

    def release(self, job: Job, outcome: str, ttft: float | None = None) -> None:
        """Free the place of an outside job (`--upstream-chat`) and count it as the
        batch's: `outcome`, its `generated` tokens, `ttft` (s). From the event loop;
        only the first call counts."""
        if self.admission.release(job, outcome, ttft) and self._wake is not None:
            self._wake()

    # -- loop thread --

    def _run(self) -> None:
        try:
            batch = self._open()
        except BaseException as e:  # re-raised by start(); the loop has nothing to do
            logger.debug("loading the model failed", exc_info=True)
            self._load_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            while self._pass(batch):
                pass
        finally:
            batch.close()
            self.wind_up()

    def wind_up(self) -> None:
        """Once the batch is closed: cancel every request still queued or running and
        hand their last events over."""
        adm = self.admission
        with adm.cond:
            for job in [*adm.pending, *adm.running.values()]:
                job.post("cancelled", 0, "server shutting down")
            adm.pending.clear()
            adm.running.clear()
            self._seqs.clear()
        self._outbox.flush()
        if self._outbox.courier is not None:
            self._outbox.courier.close()
            self._outbox.courier = None

    def _open(self) -> Any:
        """Load the model and open the engine's batch (on the loop thread,
        `server.loading.open_model`); wire the batch's hooks to the outbox."""
        from ..engines.batch import batch_capacity

        self._loaded, batch = open_model(self.config, *self._given, self.admission.capacity)
        self.admission.capacity = batch_capacity(batch)
        # A batch that says when a step's graph is built gets the previous step's
        # events handed over there, so the event loop formats them while the model
        # computes rather than while this thread builds the next step.
        self._deferred = hasattr(batch, "before_compute")
        if self._deferred:
            batch.before_compute = self._outbox.flush
        elif getattr(batch, "compute_releases_gil", False):
            # Its step is one long call without the GIL: events go to the event loop
            # from the courier thread, which runs during that call (`jobs.Courier`).
            self._outbox.courier = Courier()
        self._wake = getattr(batch, "wake", None)
        self._batch_stats = getattr(batch, "stats", None)
        return batch

    def _pass(self, batch: Any) -> bool:
        """One pass of the loop thread: wait until there is something to do, then
        `run_pass`; False once stopping."""
        adm = self.admission
        with adm.cond:
            while not self._stopping and not self._seqs and not adm.admissible(0):
                adm.cond.wait()
        return self.run_pass(batch)

    def run_pass(self, batch: Any) -> bool:
        """Admit, reap, one batch step (which waits only as long as the batch's `step`
        does); False once stopping. The events it posted go to the event loop when it
        ends, or, with a batch that has `before_compute` and sequences left, during the
        next step's compute (before that pass admits anybody, if it does)."""
        adm = self.admission
        try:
            with adm.cond:
                if self._stopping:
                    return False
                admit = adm.take(len(self._seqs))
            if admit:
                self._outbox.flush()  # preparing prompts takes a while: deliver first
            for job in admit:
                self._join(batch, job)
            self._reap(batch)
            if self._seqs:
                self._step(batch)
            return True
        finally:
            if not (self._deferred and self._seqs):
                self._outbox.flush()

    @property
    def running(self) -> int:
        """Sequences in the batch now."""
        return len(self._seqs)

    @property
    def admissible(self) -> bool:
        """Whether a queued request could join the batch now."""
        with self.admission.cond:
            return self.admission.admissible(len(self._seqs))

    def _step(self, batch: Any) -> None:
        """One batch step, each sequence's token through its own output stage; and one
        step of each choice beside the batch."""
        if any(s.solo is not None for s in self._seqs.values()):
            self._step_solos(batch)
            if all(s.solo is not None for s in self._seqs.values()):
                self._outbox.flush()
                return
        self.metrics.batch_size.set(len(self._seqs))
        tic = time.perf_counter()
        try:
            steps = batch.step()
        except Exception as e:  # the engine failed: every sequence in it is lost
            self._outbox.flush()
            logger.exception("a batch step failed")
            for seq in list(self._seqs.values()):
                seq.job.post("error", seq.choice, e)
                self._leave(batch, seq, "failed")
            return
        self._outbox.flush()  # what `before_compute` did not hand over (no decoding step)
        if steps:
            self.admission.step_seconds.append(time.perf_counter() - tic)
        for uid, engine_step in steps:
            seq = self._seqs.get(uid)
            if seq is not None:
                self._advance(batch, uid, seq, engine_step)
        if len(batch) < len(self._seqs):  # fewer in the batch than here (or a solo)
            self._lost(batch)

    def _lost(self, batch: Any) -> None:
        """End with an error each sequence the batch no longer holds though its reply
        has not ended (a stream that ended early), instead of waiting for steps that
        never come."""
        for uid, seq in list(self._seqs.items()):
            if seq.solo is None and not batch.holds(uid):
                why = EngineError(
                    "the engine's stream ended before the reply did (no end token, under "
                    "the token limit)", 502, "stream_ended",
                )  # fmt: skip
                logger.info("request %s: %s", seq.job.id, why)
                seq.job.post("error", seq.choice, why)
                self._leave(batch, seq, "failed")

    def _join(self, batch: Any, job: Job) -> None:
        """Turn a request into `n` sequences of the batch, or answer it with an error; a
        job the event loop runs (`Job.outside`) takes its place and is told to start."""
        if job.outside and self.admission.hold(job):
            return
        if job.cancelled.is_set():
            self.admission.finish(job, "cancelled")
            return
        req = job.request
        try:
            loaded = self._loaded
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
        job.outbox = self._outbox
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
                self._seqs[uid] = seq
                if branch is not None:  # the kept prefix, as the original reply had it
                    for replayed in branch.replay:
                        if self._seqs.get(uid) is not seq:
                            break  # it ended inside the prefix (a stop string)
                        self._advance(batch, uid, seq, replayed)
        except (ValueError, TypeError) as e:  # the engine refused the prompt or a setting
            logger.info("request %s refused by the engine: %s", job.id, e)
            job.post("error", 0, e)
            added = [s for s in self._seqs.values() if s.job is job]
            for seq in added:
                self._leave(batch, seq, "failed")  # the last one records the job
            if not added:
                self.admission.finish(job, "failed")
        self.metrics.batch_size.set(len(self._seqs))

    def _join_solo(self, job: Job, ready: Any, choice: int, eos: frozenset[int]) -> None:
        """Choice `choice` beside the batch, on the engine's rewindable steps (field
        retry); its uid is negative, never one the batch gives."""
        loaded = self._loaded
        assert loaded is not None
        solo = open_solo(
            loaded.engine, loaded.tokenizer, ready, choice, job.request.stop, eos,
            loaded.calibration, skip_special_tokens=job.request.skip_special_tokens,
        )  # fmt: skip
        job.live += 1
        now = time.perf_counter()
        self._solo_uid -= 1
        self._seqs[self._solo_uid] = ChoiceState(
            job, choice, solo.retry.processor, last_step=now, added=now, cached=0, solo=solo
        )

    def _step_solos(self, batch: Any) -> None:
        """One model step of each choice beside the batch; post what it released."""
        for seq in [s for s in self._seqs.values() if s.solo is not None]:
            try:
                records = seq.solo.advance()
            except Exception as e:
                logger.exception("request %s failed", seq.job.id)
                seq.job.post("error", seq.choice, e)
                self._leave(batch, seq, "failed")
                continue
            for record in records:
                self._post(batch, seq, record)

    def _advance(self, batch: Any, uid: int, seq: ChoiceState, engine_step: Any) -> None:
        """Run one batch step through the sequence's output stage; post its record."""
        job = seq.job
        if seq.cached is None:
            seq.cached = int(batch.cached_tokens(uid))
            self.metrics.prompt_cache(seq.cached)
        if isinstance(engine_step, Exception):  # this sequence failed in the engine
            logger.info("request %s failed in the engine: %s", job.id, engine_step)
            job.post("error", seq.choice, engine_step)
            self._leave(batch, seq, "failed")
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
            self._leave(batch, seq, "failed")
            return
        self._post(batch, seq, step)

    def _post(self, batch: Any, seq: ChoiceState, step: Any) -> None:
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
            self._leave(batch, seq, "completed")
            job.post("done", seq.choice, None)

    def _reap(self, batch: Any) -> None:
        """Take cancelled requests and clients that stopped reading out of the batch."""
        now = time.monotonic()
        timeout, most = self.config.client_timeout, self.config.max_buffered
        for seq in list(self._seqs.values()):
            job = seq.job
            if job.cancelled.is_set():
                self._leave(batch, seq, "dropped" if job.dropped else "cancelled")
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
                self._leave(batch, seq, "dropped")

    def _leave(self, batch: Any, seq: ChoiceState, outcome: str) -> None:
        """Remove a sequence; when it was its job's last, record the job as `outcome`."""
        for uid, other in list(self._seqs.items()):
            if other is seq:
                if seq.solo is None:
                    batch.remove(uid)
                else:
                    seq.solo.close()
                del self._seqs[uid]
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
        self.metrics.batch_size.set(len(self._seqs))
