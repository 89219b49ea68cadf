"""Time to first token: the batch's size follows the engine, requests wait in the queue
only when it is full, `/metrics` has queue wait and prefill apart, and a sequence that
joins a running batch neither drops nor reorders another's tokens.

No wall-clock asserts: what is checked is who waited (counters) and what was streamed.
The servers are real `python -m tokentrail.server` processes on loopback, driven with the
official `openai` client. `_start` is a small local starter for now (the shared server
helpers are moving to `tests/helpers/`).
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.net import free_port
from tests.helpers.servers import Server, launch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("mlx_lm")
pytest.importorskip("uvicorn")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

import tokentrail  # noqa: E402
from tokentrail.engines.batch import SerialBatch, batch_capacity, open_batch  # noqa: E402
from tokentrail.server import ServerConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEMO = Path(tokentrail.__file__).resolve().parent / "demo_model"
STARTUP_TIMEOUT = 300.0

if not (DEMO / "config.json").is_file():
    pytest.skip("the built-in demo model is not installed", allow_module_level=True)


# -- the server, started by the shared helper, with what these tests read -------------------


class _Server(Server):
    """The shared helper's server handle, plus what these tests read from it."""

    def get(self, path: str) -> Any:
        r = httpx.get(self.url + path, timeout=30)
        assert r.status_code == 200, r.text
        return r

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, parsed by prometheus_client's own parser."""
        out: dict[str, float] = {}
        text = self.get("/metrics").text
        for family in prometheus_parser.text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return out

    def client(self) -> Any:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)


def _start(log: Path, *args: str) -> _Server:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tokentrail.server", "--port", str(port),
           "--log-level", "warning", *args]
    started = launch(cmd, log, url)
    return _Server(started.proc, url, log)


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Server]:
    """`tokentrail serve` with its default flags (the demo model, the engine's batch)."""
    srv = _start(tmp_path_factory.mktemp("logs") / "default.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def one_seat(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Server]:
    """A batch of one: every other request waits for room."""
    srv = _start(tmp_path_factory.mktemp("logs") / "one.log", "--max-batch", "1")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def no_eos() -> dict[str, int]:
    """logit_bias keeping the model from ending (its special tokens, EOS among them)."""
    import json

    data = json.loads((DEMO / "tokenizer.json").read_text(encoding="utf-8"))
    return {str(t["id"]): -100 for t in data.get("added_tokens", []) if t.get("special")}


def _body(content: str, max_tokens: int, no_eos: dict[str, int]) -> dict[str, Any]:
    return {
        "model": "tokentrail-demo",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logit_bias": no_eos,
        "logprobs": True,
        "top_logprobs": 5,
    }


async def _stream(client: Any, body: dict[str, Any], started: asyncio.Event | None = None,
                  after: int = 1) -> list[tuple[int, int]]:
    """(index, id) of every streamed token; `started` is set after `after` tokens."""
    stream = await client.chat.completions.create(stream=True, **body)
    out = []
    async for chunk in stream:
        token = chunk.model_extra["tokentrail"]["token"]
        out.append((token["index"], token["id"]))
        if started is not None and len(out) == after:
            started.set()
    return out


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


# -- the batch's size follows the engine -----------------------------------------------------


def test_default_batch_is_the_engines_capacity(default_server: _Server) -> None:
    from mlx_lm.generate import BatchGenerator

    health = default_server.get("/health").json()
    assert health["batch_kind"] == "MLXBatch"
    own = inspect.signature(BatchGenerator).parameters["completion_batch_size"].default
    assert health["max_batch"] == own
    assert ServerConfig().max_batch is None  # "the engine's", decided when it loads


def test_open_batch_without_a_size_opens_at_capacity() -> None:
    from mlx_lm.generate import BatchGenerator

    model, _ = tokentrail.load()
    from tokentrail.engines import engine_for

    batch = open_batch(engine_for(model))
    try:
        own = inspect.signature(BatchGenerator).parameters["completion_batch_size"].default
        assert batch.max_batch == batch_capacity(batch) == own
    finally:
        batch.close()
    sized = open_batch(engine_for(model), 3)
    try:
        assert sized.max_batch == 3
    finally:
        sized.close()


def test_a_serial_engine_has_room_for_one() -> None:
    class Serial:  # an engine without batched decoding of its own
        vocab_size = 10
        context_length = 100

        def generate(self, prompt_ids: Any, params: Any, max_tokens: Any) -> Any:
            return iter(())

    batch = open_batch(Serial())  # type: ignore[arg-type]
    assert isinstance(batch, SerialBatch)
    assert batch.max_batch == batch_capacity(batch) == 1
    assert open_batch(Serial(), 4).max_batch == 4  # type: ignore[arg-type]
    assert batch_capacity(object()) == 1


# -- who waits in the queue ----------------------------------------------------------------


def test_below_capacity_nobody_waits_for_room(default_server: _Server,
                                              no_eos: dict[str, int]) -> None:
    n = 6
    assert n < default_server.get("/health").json()["max_batch"]
    before = default_server.metrics()

    async def run() -> list[list[tuple[int, int]]]:
        async with default_server.client() as client:
            return await asyncio.gather(*(
                _stream(client, _body(f"Say something about {i}.", 12, no_eos))
                for i in range(n)
            ))

    streams = asyncio.run(run())
    after = default_server.metrics()
    assert all(len(s) == 12 for s in streams)
    assert _delta(before, after, "tokentrail_queued_for_room_total") == 0
    assert default_server.get("/health").json()["queued_for_room"] == 0
    # Every request was taken from the queue, and every sequence's prompt processed,
    # each observed once.
    assert _delta(before, after, "tokentrail_queue_wait_seconds_count") == n
    assert _delta(before, after, "tokentrail_prefill_seconds_count") == n
    assert _delta(before, after, "tokentrail_time_to_first_token_seconds_count") == n
    assert _delta(before, after, "tokentrail_queue_wait_seconds_sum") >= 0
    assert _delta(before, after, "tokentrail_prefill_seconds_sum") > 0


def test_a_full_batch_makes_newcomers_wait(one_seat: _Server, no_eos: dict[str, int]) -> None:
    before = one_seat.metrics()

    async def run() -> list[list[tuple[int, int]]]:
        async with one_seat.client() as client:
            started = asyncio.Event()
            first = asyncio.create_task(
                _stream(client, _body("Tell a long story.", 64, no_eos), started)
            )
            await started.wait()  # the one seat is taken: the next two must queue
            rest = asyncio.gather(
                *(_stream(client, _body(f"Question {i}?", 4, no_eos)) for i in range(2))
            )
            return [await first, *await rest]

    streams = asyncio.run(run())
    after = one_seat.metrics()
    assert [len(s) for s in streams] == [64, 4, 4]
    assert _delta(before, after, "tokentrail_queued_for_room_total") == 2
    assert _delta(before, after, "tokentrail_queue_wait_seconds_count") == 3
    assert _delta(before, after, "tokentrail_prefill_seconds_count") == 3
    # Queue wait and prefill are separate series, both exposed with their buckets.
    assert "tokentrail_queue_wait_seconds_bucket{le=+Inf}" in after
    assert "tokentrail_prefill_seconds_bucket{le=+Inf}" in after


def test_n_beyond_the_batch_is_refused(one_seat: _Server) -> None:
    r = httpx.post(one_seat.url + "/v1/completions",
                   json={"prompt": "A list is", "max_tokens": 2, "n": 2}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "n"


# -- newcomers join without disturbing the running sequences ------------------------------


def test_newcomers_neither_drop_nor_reorder_a_running_stream(
    default_server: _Server, no_eos: dict[str, int]
) -> None:
    long = _body("Explain the with statement.", 48, no_eos)
    short = [_body(f"What is {w}?", 16, no_eos) for w in ("a list", "a dict", "a set")]

    async def alone() -> list[list[tuple[int, int]]]:
        async with default_server.client() as client:
            return [await _stream(client, b) for b in (long, *short)]

    async def together() -> list[list[tuple[int, int]]]:
        async with default_server.client() as client:
            started = asyncio.Event()
            running = asyncio.create_task(_stream(client, long, started, after=8))
            await started.wait()  # the long one is mid-stream when the others join
            joined = await asyncio.gather(*(_stream(client, b) for b in short))
            return [await running, *joined]

    solo = asyncio.run(alone())
    mixed = asyncio.run(together())
    for got, want in zip(mixed, solo, strict=True):
        assert [i for i, _ in got] == list(range(len(want)))  # no gap, no repeat
        assert got == want  # the same tokens, in the same order, as alone


# -- the engine batch: a joining sequence's first token ---------------------------------


def _ids(tok: Any, text: str) -> list[int]:
    from tokentrail.prompting import prompt_ids

    return prompt_ids(tok, [{"role": "user", "content": text}], None)


def test_a_newcomers_first_token_comes_from_the_step_that_samples_it() -> None:
    from tokentrail.engines import engine_for
    from tokentrail.sampling import make_params

    model, tok = tokentrail.load()
    engine = engine_for(model)
    params = make_params(top_logprobs=3)
    prompts = [_ids(tok, t) for t in ("A list is", "Explain generators.", "Hi", "Why?")]
    limits = [9, 5, 1, 7]

    def alone(i: int) -> list[int]:
        batch = open_batch(engine, 4, prompt_cache_bytes=0)
        try:
            batch.add(prompts[i], params, limits[i])
            out, steps = [], 0
            while len(batch):
                steps += 1
                out += [s.token for _, s in batch.step()]
                if steps == 2:
                    # read its prompt in step 1; its first token is out in step 2, not
                    # one batch step later when mlx-lm's BatchGenerator reports it
                    assert len(out) == 1
            return out
        finally:
            batch.close()

    want = [alone(i) for i in range(len(prompts))]
    assert [len(w) for w in want] == limits
    batch = open_batch(engine, 4, prompt_cache_bytes=0)
    try:
        got: dict[int, list[int]] = {}
        uids = [batch.add(prompts[0], params, limits[0])]
        for step in range(40):
            if step in (3, 4, 6):  # newcomers join a running batch
                i = len(uids)
                uids.append(batch.add(prompts[i], params, limits[i]))
            for uid, s in batch.step():
                assert len(s.top_logprobs) == 3
                got.setdefault(uid, []).append(s.token)
            if len(uids) == len(prompts) and not len(batch):
                break
        assert [got[u] for u in uids] == want  # nothing dropped, repeated or reordered
    finally:
        batch.close()


def test_llamacpp_capacity_is_its_sequence_slots() -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    from types import SimpleNamespace

    from tokentrail.engines.llamacpp.batch import DEFAULT_SLOTS, slots

    def engine(n_seq_max: int) -> Any:
        return SimpleNamespace(llama=SimpleNamespace(
            context_params=SimpleNamespace(n_seq_max=n_seq_max)))

    assert slots(engine(1)) == DEFAULT_SLOTS  # loaded for one sequence: the default
    assert slots(engine(6)) == 6  # loaded with slots of its own: those
    limit = llama_cpp.llama_max_parallel_sequences()
    assert slots(engine(limit + 1)) == limit  # never past llama.cpp's own limit
