"""vLLM's continuous batch for the server: every sequence a task on the engine's loop.

`VLLMBatch` is the `Batch` of an `AsyncLLM`-backed `VLLMEngine`. vLLM pushes: its
`AsyncLLM.generate` is an async generator per request, fed by vLLM's own output handler
as its scheduler finishes each step. Each sequence here is one task on the engine's one
event loop (`VLLMEngine.submit`; no thread per sequence, no loop per batch) that reads
its generator and puts the Steps of each output on a queue that `step` drains, so the
scheduler never waits on one sequence and vLLM runs all of them together. Removing a
sequence (its end token or stop string, max tokens, a client gone) cancels its task,
which closes the generator: vLLM aborts the request (`AsyncLLM.abort`) and frees its
slot at once.

Its capacity is vLLM's: the engine's `max_num_seqs` (what vLLM's scheduler runs at
once), so tokentrail queues no request that vLLM would run.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from ...sampling import SamplingParams
from ..batch import PUSH_END, WAKE, BaseBatch, Outcome, drain_pushed
from .steps import distribution_of, steps_from_completion

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_CAPACITY", "VLLMBatch"]

#: Capacity when the engine does not say its `max_num_seqs` (vLLM's own default).
DEFAULT_CAPACITY = 128


class VLLMBatch(BaseBatch):
    """A `Batch` of vLLM requests, each read by a task on the engine's loop (see the module).

    `engine` is an `AsyncLLM`-backed `tokentrail.engines.vllm.engine.VLLMEngine` (its
    `prepare`, `submit`, `max_num_seqs`, and the `AsyncLLM` as `engine`). `max_batch`
    None takes the engine's `max_num_seqs`. `step` returns the Steps that have arrived,
    waiting at most `wait` seconds for the first (`wake` cuts the wait short).
    `cached_tokens(uid)` is the prompt tokens vLLM found in its prefix cache.
    """

    def __init__(self, engine: Any, max_batch: int | None = None, wait: float = 0.02) -> None:
        if max_batch is None:
            max_batch = engine.max_num_seqs or DEFAULT_CAPACITY
        super().__init__(max_batch)
        self.engine = engine
        self.wait = wait
        self._live: dict[int, Future[None]] = {}
        self._cached: dict[int, int] = {}
        self._out: queue.SimpleQueue[tuple[int | None, Any]] = queue.SimpleQueue()
        #: Requests removed before vLLM finished them (so aborted in vLLM): an end token or
        #: stop string of tokentrail's, a client gone.
        self.aborts = 0

    def add(self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None) -> int:
        self._check_room()
        ids, sampling = self.engine.prepare(prompt_ids, params, max_tokens)
        uid = next(self._uids)
        dist = distribution_of(params)
        self._live[uid] = self.engine.submit(
            self._read(uid, ids, sampling, params.top_logprobs, dist)
        )
        return uid

    async def _read(self, uid: int, ids: list[int], sampling: Any, k: int, dist: str) -> None:
        """One request, on the engine's loop: its Steps onto the queue as vLLM pushes them."""
        put = self._out.put
        request_id = f"tokentrail-{uuid.uuid4().hex}"
        stream = self.engine.engine.generate({"prompt_token_ids": ids}, sampling, request_id)
        finished = False
        try:
            # To its end: the generator returns after vLLM's last output, with no abort.
            async for output in stream:
                if uid not in self._cached and uid in self._live:
                    self._cached[uid] = int(getattr(output, "num_cached_tokens", 0) or 0)
                for completion in output.outputs:
                    steps = steps_from_completion(completion, k, dist)
                    if steps:
                        put((uid, steps))
                finished = bool(output.finished)
        except asyncio.CancelledError:
            if not finished:
                self.aborts += 1  # on the loop thread only
            raise  # removed: closing the stream below aborts the request in vLLM
        except Exception as e:  # this sequence failed; the others go on
            put((uid, e))
        finally:
            await stream.aclose()  # aborts the request if vLLM has not finished it
            put((uid, PUSH_END))

    def remove(self, uid: int) -> None:
        task = self._live.pop(uid, None)
        self._cached.pop(uid, None)
        if task is not None:
            task.cancel()  # on the loop: the generator closes, vLLM aborts the request

    def cached_tokens(self, uid: int) -> int:
        return self._cached.get(uid, 0)

    def wake(self) -> None:
        self._out.put(WAKE)

    def step(self) -> list[tuple[int, Outcome]]:
        return drain_pushed(self._out, self.wait, self._live)

    def stats(self) -> dict[str, Any]:
        """The batch's capacity, its live sequences, the requests it aborted in vLLM and
        those vLLM has unfinished (its output processor's count)."""
        processor = getattr(self.engine.engine, "output_processor", None)
        count = getattr(processor, "get_num_unfinished_requests", None)
        return {
            "max_batch": self.max_batch,
            "live": len(self._live),
            "aborts": self.aborts,
            "vllm_unfinished": count() if callable(count) else None,
        }

    def close(self) -> None:
        """Remove every sequence: each task is cancelled on the engine's loop, where
        vLLM aborts its request (the engine's own `shutdown` stops vLLM)."""
        super().close()
