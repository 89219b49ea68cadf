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
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..batch import open_sequence
from ..errors import APIError, ContextOverflow, QueueFull
from ..prompting import eos_ids, prompt_ids, room, stop_matcher, vocab_for
from ..sampling import SamplingError, check_max_tokens
from ..sequence import SequenceState
from ..vocab import Vocab
from .config import (  # noqa: F401  (DEFAULT_*: their old home)
    DEFAULT_CLIENT_TIMEOUT,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_BUFFERED,
    Loader,
    ServerConfig,
)
from .formatting import step_of
from .jobs import Courier, EventKind, Job, Outbox  # noqa: F401  (EventKind, Job: their old home)
from .metrics import Metrics
from .protocol import GenRequest
from .structured import bound, open_structure
from .tool_calls import tool_parser_for

logger = logging.getLogger("tokentrail.server")

#: How many finished requests /health remembers.
RECENT_JOBS = 32


@dataclass(eq=False)
class ChoiceState:
    """One sequence of the batch: a choice of a job, and its per-token state (the same
    `tokentrail.sequence.SequenceState` that `stream_generate` and `batch_generate` use)."""

    job: Job
    choice: int
    state: SequenceState
    index: int = 0
    last_step: float = 0.0
    cached: int | None = None
    #: When it joined the engine's batch (time.perf_counter), for the prefill metric.
    added: float = 0.0
    #: index -> why, for tokens the engine could not identify (an upstream's lossy data)
    refused: dict[int, str] = field(default_factory=dict)
    #: Reasoning channels and JSON fields (`tokentrail.server.structured`), or None.
    structure: Any = None


def served_name(model_path: str | os.PathLike[str] | None) -> str:
    """The model id served for a folder (its name), or tokentrail-demo for the demo."""
    if model_path is None:
        return "tokentrail-demo"
    return Path(model_path).resolve().name or str(model_path)


class Scheduler:
    """Owns the model; runs queued requests together in a continuous batch.

    Give `model` and `tokenizer` (as `tokentrail.load` returns them), or a `loader`
    returning them (run on the loop thread), or a `config.model_path` for
    `tokentrail.load`. The settings are a `ServerConfig` (`config`), or its fields as
    keywords (`max_batch=4`), which update `config`: `max_batch` sequences decode
    together (None: the capacity of the engine's batch, known once the model is
    loaded); requests beyond that wait, `max_queue` at most (in sequences), and more
    are refused with `QueueFull`.
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
        self.model = model
        self.tokenizer = tokenizer
        self.model_path = config.model_path
        self.engine_name = config.engine
        self.load_options = dict(config.load_options)
        self.loader = loader
        self.max_queue = config.max_queue
        #: Sequences decoded together: the config's, or (when it says None) the engine
        #: batch's capacity once the batch is open.
        self.max_batch: int | None = config.max_batch
        self.prompt_cache_bytes = config.prompt_cache_bytes
        self.client_timeout = config.client_timeout
        self.max_buffered = config.max_buffered
        self.metrics = metrics or Metrics()
        self.model_name = config.model_name or served_name(config.model_path)
        self.created = int(time.time())
        self.vocab: Vocab | None = None
        #: The checked calibration (`config.calibration`), once the model is loaded.
        self.calibration: Any = None
        self.context_length: int | None = None
        #: The class of the engine's batch (e.g. SerialBatch: one generator per sequence).
        self.batch_kind: str | None = None
        self._cond = threading.Condition()
        self._pending: deque[Job] = deque()
        self._running: dict[str, Job] = {}
        self._seqs: dict[int, ChoiceState] = {}
        self._stopping = False
        self._ready = threading.Event()
        #: The batch's `wake` (None until it is open, or where it has none): a request that
        #: arrives while a step waits for I/O (an upstream's next token) joins at once.
        self._wake: Any = None
        self._load_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._recent: deque[dict[str, Any]] = deque(maxlen=RECENT_JOBS)
        self._step_seconds: deque[float] = deque(maxlen=64)
        self._job_tokens: deque[int] = deque(maxlen=64)
        #: Events of the jobs in the batch, handed over once per pass of the loop.
        self._outbox = Outbox()
        #: Whether the batch hands the events over itself (`before_compute`).
        self._deferred = False

    # -- lifecycle --

    def start(self, timeout: float | None = None) -> None:
        """Start the loop thread and wait until the model is loaded; re-raise a load error."""
        with self._cond:
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
        """Cancel running and queued requests and join the loop thread."""
        thread = self._thread
        if thread is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
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
        n = job.request.n
        capacity = self.max_batch
        if capacity is not None and n > capacity:
            raise self._too_many(n, capacity)
        with self._cond:
            self._purge()
            busy = sum(j.request.n for j in self._pending) + sum(
                j.request.n for j in self._running.values()
            )
            room = 0 if capacity is None else capacity  # not loaded yet: all of it waits
            if busy + n > room + self.max_queue:
                self.metrics.request_outcome("rejected")
                raise QueueFull(len(self._pending), self._retry_after())
            if capacity is not None and busy + n > room:  # the batch is full: it waits
                job.waited_for_room = True
                self.metrics.queued_for_room.inc()
            self._pending.append(job)
            self.metrics.queue_depth.set(len(self._pending))
            self._cond.notify_all()
        if self._wake is not None and not job.waited_for_room:
            self._wake()

    @staticmethod
    def _too_many(n: int, capacity: int) -> APIError:
        return APIError(
            400,
            f"'n' is {n} but this server decodes at most {capacity} sequences "
            "together (--max-batch)",
            param="n",
            code="unsupported_value",
        )

    def _purge(self) -> None:
        """Forget queued requests whose clients have gone (caller holds the lock)."""
        for job in [j for j in self._pending if j.cancelled.is_set()]:
            self._pending.remove(job)
            self._finish(job, "cancelled")

    def stats(self) -> dict[str, Any]:
        with self._cond:
            running = [
                {"id": j.id, "generated_tokens": j.generated} for j in self._running.values()
            ]
            return {
                "status": "ok" if self.ready else ("error" if self._load_error else "loading"),
                "model": self.model_name,
                "active": len(running),
                "queued": len(self._pending),
                "max_queue": self.max_queue,
                "max_batch": self.max_batch,
                "batch_size": len(self._seqs),
                "batch_kind": self.batch_kind,
                **self.metrics.outcome_counts(),
                "queued_for_room": self.metrics.waited_for_room(),
                "generated_tokens": self.metrics.tokens_generated(),
                "running": running[0] if running else None,
                "batch": running,
                "recent": list(self._recent),
            }

    def _retry_after(self) -> int:
        """Seconds until a slot is likely free, from recent request durations."""
        if not self._step_seconds or not self._job_tokens:
            return 1
        per_step = sum(self._step_seconds) / len(self._step_seconds)
        per_job = sum(self._job_tokens) / len(self._job_tokens)
        return max(1, min(60, math.ceil(per_step * per_job)))

    # -- loop thread --

    def _run(self) -> None:
        try:
            self._load()
            from ..engines.batch import batch_capacity, open_batch

            options = {}
            if self.prompt_cache_bytes is not None:
                options["prompt_cache_bytes"] = self.prompt_cache_bytes
            batch = open_batch(self._engine, self.max_batch, **options)
            self.batch_kind = type(batch).__name__
            self.max_batch = batch_capacity(batch)
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
        except BaseException as e:  # re-raised by start(); the loop has nothing to do
            logger.debug("loading the model failed", exc_info=True)
            self._load_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(batch)
        finally:
            batch.close()
            with self._cond:
                for job in [*self._pending, *self._running.values()]:
                    job.post("cancelled", 0, "server shutting down")
                self._pending.clear()
                self._running.clear()
                self._seqs.clear()
            self._outbox.flush()
            if self._outbox.courier is not None:
                self._outbox.courier.close()
                self._outbox.courier = None

    def _load(self) -> None:
        from .. import generate
        from ..engines import engine_for

        if self.model is None:
            if self.loader is not None:
                self.model, self.tokenizer = self.loader()
            else:
                logger.debug("loading model %s", self.model_path or "(built-in demo model)")
                self.model, self.tokenizer = generate.load(
                    self.model_path, engine=self.engine_name, **self.load_options
                )
        self._engine = engine_for(self.model)
        self.vocab = vocab_for(self.tokenizer)
        if self.config.calibration is not None:
            from ..calibrate.fingerprint import calibration_for

            self.calibration = calibration_for(self.config.calibration, self.model, self.tokenizer)
        self.context_length = self._engine.context_length
        self._eos = eos_ids(self.tokenizer)

    def _loop(self, batch: Any) -> None:
        while self._pass(batch):
            pass

    def _pass(self, batch: Any) -> bool:
        """One pass of the loop: admit, reap, one batch step; False once stopping. The
        events it posted go to the event loop when it ends, or, with a batch that has
        `before_compute` and sequences left, during the next step's compute (before that
        pass admits anybody, if it does)."""
        try:
            with self._cond:
                if self._stopping:
                    return False
                while not self._stopping and not self._seqs and not self._pending:
                    self._cond.wait()
                if self._stopping:
                    return False
                admit = self._admit()
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

    def _step(self, batch: Any) -> None:
        """One batch step, each sequence's token through its own per-token loop."""
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
            self._step_seconds.append(time.perf_counter() - tic)
        for uid, engine_step in steps:
            seq = self._seqs.get(uid)
            if seq is not None:
                self._advance(batch, uid, seq, engine_step)

    def _admit(self) -> list[Job]:
        """Take the queued requests the batch has room for, first come first served
        (caller holds the lock); a request for more sequences than the batch ever holds
        is answered with an error."""
        self._purge()
        capacity = self.max_batch or 1
        admit = []
        free = capacity - len(self._seqs)
        now = time.monotonic()
        while self._pending and self._pending[0].request.n <= free:
            job = self._pending.popleft()
            free -= job.request.n
            admit.append(job)
            self.metrics.queue_wait.observe(now - job.submitted)
        if self._pending and self._pending[0].request.n > capacity:  # submitted early
            job = self._pending.popleft()
            job.post("error", 0, self._too_many(job.request.n, capacity))
            self._finish(job, "failed")
        self.metrics.queue_depth.set(len(self._pending))
        return admit

    def _join(self, batch: Any, job: Job) -> None:
        """Turn a request into `n` sequences of the batch, or answer it with an error."""
        if job.cancelled.is_set():
            self._finish(job, "cancelled")
            return
        req = job.request
        try:
            ids = prompt_ids(self.tokenizer, req.prompt, self._engine.vocab_size, req.tools)
            limit = self._limit(req, len(ids))
            stop_matcher(req.stop)
            chat = req.kind == "chat"
            constraint = bound(req.structure, self.tokenizer, self.config.reasoning, chat)
            params = req.params(self._engine.vocab_size, constraint)
            structures = [self._structure(req, ids) for _ in range(req.n)]
        except SamplingError as e:  # e.g. a logit_bias id past the engine's vocabulary
            job.post("error", 0, APIError(400, str(e), param=e.param, code="invalid_value"))
            self._finish(job, "failed")
            return
        except (APIError, ValueError, TypeError) as e:
            logger.info("request %s refused: %s", job.id, e)
            job.post("error", 0, e)
            self._finish(job, "failed")
            return
        with self._cond:
            self._running[job.id] = job
        job.outbox = self._outbox
        try:
            for choice in range(req.n):
                uid, state = open_sequence(
                    batch,
                    self._engine,
                    self.tokenizer,
                    ids,
                    params,
                    limit,
                    req.stop,
                    choice=choice,
                    eos=self._eos,
                )
                job.live += 1
                now = time.perf_counter()
                self._seqs[uid] = ChoiceState(
                    job, choice, state, last_step=now, added=now, structure=structures[choice]
                )
        except (ValueError, TypeError) as e:  # the engine refused the prompt or a setting
            logger.info("request %s refused by the engine: %s", job.id, e)
            job.post("error", 0, e)
            added = [s for s in self._seqs.values() if s.job is job]
            for seq in added:
                self._leave(batch, seq, "failed")  # the last one records the job
            if not added:
                self._finish(job, "failed")
        self.metrics.batch_size.set(len(self._seqs))

    def _structure(self, req: GenRequest, ids: list[int]) -> Any:
        """One choice's `StructuredStream` (None: plain text); fields get alternatives
        from the engine's scorer where it has one (one forward pass per enum leaf)."""

        def scorer(output_ids: list[int]) -> Any:
            from ..engines.scoring import scorer_for

            found, why = scorer_for(self._engine, self.tokenizer, ids, output_ids, {})
            if found is None:
                logger.debug("fields without alternatives: %s", why)
            return found

        if req.structure.tool_choice is not None:  # before the first event: the app reads it
            req.tool_parser = tool_parser_for(
                req.structure.tool_choice, self.config.tool_call_parser, self.tokenizer
            )
        reasoning = self.config.reasoning
        return open_structure(req.structure, reasoning, req.kind == "chat", scorer, gated=True)[0]

    def _limit(self, req: GenRequest, n_prompt: int) -> int:
        """The token limit for a prompt of `n_prompt` tokens, or APIError (context).

        The server's rule, as OpenAI and vLLM answer: a `max_tokens` the client gave
        must fit the room the prompt leaves; the default is cut to it."""
        overflow = "raise" if req.max_tokens_given else "cap"
        try:
            limit = room(self.context_length, n_prompt, req.max_tokens, overflow=overflow)
        except ContextOverflow as e:
            prompt = "messages" if req.kind == "chat" else "prompt"
            raise APIError(
                400,
                str(e).replace("max_tokens is", "'max_tokens' is", 1),
                param=prompt if e.param == "prompt" else "max_tokens",
                code="context_length_exceeded",
            ) from None
        checked = check_max_tokens(limit)
        return req.max_tokens if checked is None else checked

    def _advance(self, batch: Any, uid: int, seq: ChoiceState, engine_step: Any) -> None:
        """Run one batch step through the sequence's own per-token loop; post it."""
        job = seq.job
        if seq.cached is None:
            seq.cached = int(batch.cached_tokens(uid))
            self.metrics.prompt_cache(seq.cached)
        if isinstance(engine_step, Exception):  # this sequence failed in the engine
            logger.info("request %s failed in the engine: %s", job.id, engine_step)
            job.post("error", seq.choice, engine_step)
            self._leave(batch, seq, "failed")
            return
        reason = getattr(engine_step, "refused", None)
        if reason is not None:
            seq.refused[seq.index] = reason
        try:
            response = seq.state.feed(engine_step)
            if seq.structure is not None:
                seq.structure.apply(response)
            if self.calibration is not None:
                self.calibration.apply(response)
        except Exception as e:
            logger.exception("request %s failed", job.id)
            job.post("error", seq.choice, e)
            self._leave(batch, seq, "failed")
            return
        now = time.perf_counter()
        if seq.index == 0:
            self.metrics.ttft.observe(time.monotonic() - job.submitted)
            self.metrics.prefill.observe(now - seq.added)
        else:
            self.metrics.itl.observe(now - seq.last_step)
        seq.last_step = now
        refused: tuple[dict[str, Any], ...] = ()
        if seq.refused:
            spans = (*response.last_segment_tokens, *response.stop_tokens)
            refused = tuple(
                {"index": t.index, "id": t.id, "reason": seq.refused[t.index]}
                for t in spans
                if t.index in seq.refused
            )
        step = step_of(response, seq.index, seq.cached, refused, engine_step)
        seq.index += 1
        with self._cond:
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
        for seq in list(self._seqs.values()):
            job = seq.job
            if job.cancelled.is_set():
                self._leave(batch, seq, "dropped" if job.dropped else "cancelled")
                continue
            backlog = job.posted - job.read
            stalled = backlog > 0 and now - job.last_read > self.client_timeout
            if stalled or backlog > self.max_buffered:
                why = (
                    f"not read for {self.client_timeout:g} s"
                    if stalled
                    else f"over {self.max_buffered} steps unread"
                )
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
                batch.remove(uid)
                del self._seqs[uid]
                break
        job = seq.job
        job.live -= 1
        if outcome != "completed" and job.outcome == "queued":
            job.outcome = outcome  # the first failure decides the job's outcome
        if job.live <= 0:
            if job.generated:
                self._job_tokens.append(job.generated)
            final = job.outcome if job.outcome != "queued" else outcome
            if final == "completed" and job.cancelled.is_set():
                final = "dropped" if job.dropped else "cancelled"
            if final == "cancelled":
                job.post("cancelled", 0, job.reason or "cancelled")
            self._finish(job, final)

    def _finish(self, job: Job, outcome: str) -> None:
        """Record a finished request."""
        with self._cond:
            self._running.pop(job.id, None)
            job.outcome = outcome
            self._recent.append(
                {"id": job.id, "outcome": outcome, "generated_tokens": job.generated}
            )
            self.metrics.request_outcome(outcome)  # with /health's lock: counts match recent
        self.metrics.batch_size.set(len(self._seqs))
