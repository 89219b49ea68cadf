"""The scheduler: a request queue and one generation loop over a continuous batch.

One thread owns the model (loading included), so engine state such as MLX streams never
crosses threads. It drives `tokentrail.engines.batch.open_batch(engine, max_batch, ...)`
(`max_batch` None: the engine batch's own capacity): between two batch steps, waiting
requests join (first come, first served) while there is room and finished, cancelled
or stalled ones leave. A request waits in the queue only while the batch is full.
Each sequence has its own sampling settings, stop strings, seed and `Aligner` (fresh
per sequence, continuing its prompt), and goes through the same per-token loop as
`tokentrail.stream_generate` (what happens to each sequence: `server.choices`).
`/metrics` has the time each request waited in the queue and each sequence's prompt
processing (its first token's wait in the batch) apart.

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
from typing import Any

from ..branching import ReplyMemory
from ..vocab import Vocab
from .admission import RECENT_JOBS, Admission
from .choices import Choices
from .config import LoadedModel, Loader, ServerConfig, served_name
from .jobs import Courier, Job, Outbox
from .loading import open_model
from .metrics import Metrics

logger = logging.getLogger("tokentrail.server")

__all__ = ["RECENT_JOBS", "LoadedModel", "Scheduler", "served_name"]


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
        #: The sequences in the batch and what happens to each (`server.choices`).
        self.choices = Choices(config, self.admission, self.metrics, self.replies, self._outbox)
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
            "batch_size": len(self.choices.seqs),
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
            self.choices.seqs.clear()
        self._outbox.flush()
        if self._outbox.courier is not None:
            self._outbox.courier.close()
            self._outbox.courier = None

    def _open(self) -> Any:
        """Load the model and open the engine's batch (on the loop thread,
        `server.loading.open_model`); wire the batch's hooks to the outbox."""
        from ..engines.batch import batch_capacity

        self._loaded, batch = open_model(self.config, *self._given, self.admission.capacity)
        self.choices.loaded = self._loaded
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
            while not self._stopping and not self.choices.seqs and not adm.admissible(0):
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
                admit = adm.take(len(self.choices.seqs))
            if admit:
                self._outbox.flush()  # preparing prompts takes a while: deliver first
            for job in admit:
                self.choices.join(batch, job)
            self.choices.reap(batch)
            if self.choices.seqs:
                self._step(batch)
            return True
        finally:
            if not (self._deferred and self.choices.seqs):
                self._outbox.flush()

    @property
    def running(self) -> int:
        """Sequences in the batch now."""
        return len(self.choices.seqs)

    @property
    def admissible(self) -> bool:
        """Whether a queued request could join the batch now."""
        with self.admission.cond:
            return self.admission.admissible(len(self.choices.seqs))

    def _step(self, batch: Any) -> None:
        """One batch step, each sequence's token through its own output stage; and one
        step of each choice beside the batch."""
        if any(s.solo is not None for s in self.choices.seqs.values()):
            self.choices.step_solos(batch)
            if all(s.solo is not None for s in self.choices.seqs.values()):
                self._outbox.flush()
                return
        self.metrics.batch_size.set(len(self.choices.seqs))
        tic = time.perf_counter()
        try:
            steps = batch.step()
        except Exception as e:  # the engine failed: every sequence in it is lost
            self._outbox.flush()
            logger.exception("a batch step failed")
            for seq in list(self.choices.seqs.values()):
                seq.job.post("error", seq.choice, e)
                self.choices.leave(batch, seq, "failed")
            return
        self._outbox.flush()  # what `before_compute` did not hand over (no decoding step)
        if steps:
            self.admission.step_seconds.append(time.perf_counter() - tic)
        choices = self.choices
        seqs = choices.seqs
        for uid, engine_step in steps:
            seq = seqs.get(uid)
            if seq is not None:
                choices.advance(batch, uid, seq, engine_step)
        if len(batch) < len(seqs):  # fewer in the batch than here (or a solo)
            self.choices.lost(batch)

