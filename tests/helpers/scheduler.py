"""Driving a real `Scheduler` from a real asyncio loop in tests, without HTTP: submitting
completion jobs, and recording who wakes the event loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class LoopCalls:
    """Records every `call_soon_threadsafe` on `loop` while installed: the calling thread's
    name and the callback's name, in order. `restore()` takes the recorder off."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.calls: list[tuple[str, str]] = []
        real = loop.call_soon_threadsafe

        def recorded(callback: Any, *args: Any, **kwargs: Any) -> Any:
            name = getattr(callback, "__name__", type(callback).__name__)
            self.calls.append((threading.current_thread().name, name))
            return real(callback, *args, **kwargs)

        loop.call_soon_threadsafe = recorded  # type: ignore[method-assign]

    def callers(self, callback: str) -> list[str]:
        """The threads that scheduled `callback` (by name), one entry per call."""
        return [thread for thread, name in self.calls if name == callback]

    def restore(self) -> None:
        del self.loop.call_soon_threadsafe


def submit_completions(scheduler: Any, prompts: list[str], max_tokens: int) -> list[Any]:
    """One greedy completion job per prompt, made on the running loop, all submitted."""
    from tokentrail.server.jobs import Job
    from tokentrail.server.protocol import parse_completion

    loop = asyncio.get_running_loop()
    jobs = []
    for i, prompt in enumerate(prompts):
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        req = parse_completion(body, "m", scheduler.vocab.size)
        jobs.append(Job(id=f"job-{i}", request=req, loop=loop))
    for job in jobs:
        scheduler.submit(job)
    return jobs
