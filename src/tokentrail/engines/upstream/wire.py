"""An upstream's answer read without I/O: the bytes of its response in, `Step`s out.

`StepReader` is what the sync `UpstreamEngine.generate` (httpx, one stream) and the
async batch (`tokentrail.engines.upstream.stream`, many streams on one event loop) share:
it splits server-sent events, parses each ``data:`` line, feeds the realigner
(`tokentrail.realign.core.Realigner`) and turns every token the realigner gives its
aligner into an `UpstreamStep`; `finish` settles the end of the stream (the token limit,
an end token, or an upstream that ended the text without sending its end token).
`status_error` turns an upstream's error answer into an `UpstreamError`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ...errors import UpstreamError
from ...fastjson import loads
from ...realign.core import Realigner
from ...realign.result import RealignError, TokenEvent
from ...vocab import Vocab
from ..base import DISTRIBUTIONS, Step


@dataclass(slots=True)
class UpstreamStep(Step):
    """A `Step` from an upstream; `refused` (when not None) says why its token id is
    a stand-in that only spells the right bytes: the upstream did not identify it."""

    refused: str | None = None


class Upstream(Protocol):
    """What a `StepReader` needs of its engine
    (`tokentrail.engines.upstream.engine.UpstreamEngine`)."""

    url: str
    dialect: str
    vocab: Vocab
    eos_ids: tuple[int, ...]

    def filler(self) -> int: ...


@dataclass(slots=True)
class ReadCost:
    """Where a reader's time went (time.perf_counter seconds): `parse` (SSE and JSON),
    `realign` (the realigner and its aligner), for `tokens` steps in `chunks` chunks."""

    parse: float = 0.0
    realign: float = 0.0
    tokens: int = 0
    chunks: int = 0

    def add(self, other: ReadCost) -> None:
        self.parse += other.parse
        self.realign += other.realign
        self.tokens += other.tokens
        self.chunks += other.chunks

    def to_dict(self) -> dict[str, Any]:
        per = 1e6 / self.tokens if self.tokens else None  # JSON: no NaN
        return {
            "tokens": self.tokens,
            "chunks": self.chunks,
            "parse_s": self.parse,
            "realign_s": self.realign,
            "parse_us_per_token": None if per is None else self.parse * per,
            "realign_us_per_token": None if per is None else self.realign * per,
        }


class StepReader:
    """One upstream response (`body` as sent) read into steps (see the module).

    `feed(data)` takes the next bytes of the response and returns the steps they
    completed; `finish()` returns the last ones, or raises `UpstreamError` for a stream
    that ended wrong. `done` turns True once the stream's ``[DONE]`` line was read.
    `distribution` labels every step (`Step.distribution`): "masked" where the upstream
    masks before it reports logprobs (`UpstreamEngine.distribution`); None: each frame
    names it (another tokentrail's extension ``distribution``; "raw" until one does).
    """

    def __init__(
        self,
        engine: Upstream,
        body: Mapping[str, Any],
        prompt_ids: Sequence[int],
        max_tokens: int | None,
        distribution: str | None = "raw",
    ) -> None:
        self.engine = engine
        self.distribution = distribution or "raw"  # what the steps' logprobs come from
        self._told = distribution is None  # the frames say it (their extension's)
        self.streamed = bool(body.get("stream", True))
        self.max_tokens = max_tokens
        #: Asked to go on past end tokens (vLLM's ``ignore_eos``): one does not end it.
        self.ignore_eos = bool(body.get("ignore_eos"))
        self.done = False
        self.cost = ReadCost()
        self._events: list[TokenEvent] = []
        self._realigner = Realigner(
            engine.vocab,
            skip_special_tokens=True,
            prompt_ids=prompt_ids,
            on_token=self._events.append,
            alternatives=False,  # the output stage's aligner builds them from the steps
            segments=False,  # only the events are read: the output stage makes its own
        )
        self._tail = b""
        self._n = 0
        self._finish: str | None = None
        self._last: int | None = None

    def prime(self) -> None:
        """Set up what the first token needs while the upstream computes it (the
        realigner's aligner over the prompt: `Realigner.prime`)."""
        self._realigner.prime()

    def feed(self, data: bytes) -> list[Step]:
        """The steps that the next `data` of the response completes (maybe none)."""
        if self.done:
            return []  # the rest of the response after [DONE] (its end)
        tic = time.perf_counter()
        if not self.streamed:
            self._tail += data
            self.cost.parse += time.perf_counter() - tic
            return []
        lines = (self._tail + data).split(b"\n") if self._tail else data.split(b"\n")
        self._tail = lines.pop()
        chunks = []
        for line in lines:
            payload = _payload(line)
            if payload is None:
                continue
            if payload == b"[DONE]":
                self.done = True
                break
            chunks.append(_loads(payload))
        toc = time.perf_counter()
        self.cost.parse += toc - tic
        for chunk in chunks:
            self._chunk(chunk)
        steps = self._drain()
        self.cost.realign += time.perf_counter() - toc
        return steps

    def finish(self) -> list[Step]:
        """The stream has ended: its last steps (see `UpstreamEngine.generate`)."""
        if self.streamed:
            rest = _payload(self._tail) if not self.done else None
            if rest is not None and rest != b"[DONE]":
                self._chunk(_loads(rest))
        else:
            self._chunk(_loads(self._tail))
        try:
            self._realigner.finish()
        except RealignError as e:
            raise UpstreamError(
                f"the upstream ({self.engine.dialect} dialect) sent no per-token data: {e}"
            ) from e
        steps = self._drain()
        if self.max_tokens is not None and self._n >= self.max_tokens:
            return steps
        eos = () if self.ignore_eos else self.engine.eos_ids
        if self._last is not None and self._last in eos:
            return steps
        if self._finish == "stop" and eos:
            # The upstream ended the text without sending its end token (it left it out
            # of its logprobs): one step stands for it, marked as not identified.
            why = (
                "the upstream ended the text (finish_reason 'stop') without sending its "
                "end token; the tokenizer's EOS stands for it"
            )
            stand_in = UpstreamStep(eos[0], math.nan, [], None,
                                    distribution=self.distribution, refused=why)
            return [*steps, stand_in]
        raise UpstreamError(
            f"the upstream stopped after {self._n} token(s) (finish_reason {self._finish!r}) "
            "before the token limit and "
            + ("though asked to ignore end tokens" if self.ignore_eos else "without an end token"),
        )

    def _chunk(self, chunk: Any) -> None:
        self.cost.chunks += 1
        if self._told:
            ext = chunk.get("tokentrail") if isinstance(chunk, dict) else None
            said = ext.get("distribution") if isinstance(ext, dict) else None
            if said in DISTRIBUTIONS:
                self.distribution = said
        self._finish = finish_reason(chunk) or self._finish
        r = self._realigner
        try:
            r.feed(chunk)
        except RealignError as e:
            raise UpstreamError(f"the upstream sent what cannot be read: {e}") from e
        if r.errors:
            raise UpstreamError(f"the upstream reported an error: {r.errors[0]}")

    def _drain(self) -> list[Step]:
        """A step for every token the realigner gave its aligner since the last drain."""
        if not self._events:
            return []
        steps: list[Step] = []
        dist = self.distribution
        for e in self._events:
            tid, why = e.id, e.reason
            if tid is None:
                tid = self.engine.filler()
                why = f"{why}; it added no text, and a special token stands for it"
            lp = math.nan if e.logprob is None else float(e.logprob)
            steps.append(UpstreamStep(tid, lp, list(e.top or ()), None,
                                      distribution=dist, refused=why))
        self._events.clear()
        self._n += len(steps)
        self._last = steps[-1].token
        self.cost.tokens += len(steps)
        return steps


def _payload(line: bytes) -> bytes | None:
    """The data of one SSE line (None: not a ``data:`` line)."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    return line[5:].strip()


def _loads(payload: bytes) -> Any:
    try:
        return loads(payload)
    except ValueError as e:
        shown = payload[:80].decode("utf-8", "replace")
        raise UpstreamError(f"the upstream sent a line that is not JSON: {shown!r}") from e


def status_error(status: int, text: str, where: str) -> UpstreamError:
    """The `UpstreamError` for an upstream's error answer (its 4xx passed on, else 502)."""
    try:
        err = json.loads(text).get("error")
        message = err.get("message") if isinstance(err, Mapping) else err
    except (ValueError, AttributeError):
        message = text[:300]
    if 400 <= status < 500 and status not in (401, 403):
        return UpstreamError(
            f"the upstream rejected the request: {message}", status, "upstream_rejected"
        )
    return UpstreamError(f"the upstream {where} answered {status}: {message}", 502)


def finish_reason(chunk: Any) -> str | None:
    """The finish reason a chunk states (OpenAI's, or llama.cpp's ``stop_type``)."""
    if not isinstance(chunk, Mapping):
        return None
    for ch in chunk.get("choices") or []:
        if isinstance(ch, Mapping) and ch.get("finish_reason"):
            return str(ch["finish_reason"])
    if chunk.get("stop") is True:
        kind = chunk.get("stop_type")
        return "length" if kind == "limit" else "stop"
    return None
