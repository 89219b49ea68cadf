"""The proxy's upstream reading: `StepReader` (bytes in, steps out) and
`AsyncUpstreamBatch` (many streams on one event loop) against a real llama-server.

- However a response's bytes are cut into reads, the steps are the same, and they are
  the recording's own ids (the recordings of tests/data/realign, made with each
  tokenizer's library);
- the batch's capacity is the upstream's slots (`llama-server -np 4`); its streams give
  llama-server's own greedy tokens for the same prompt ids, also on connections kept
  alive after streams that were cut short;
- through `tokentrail serve --upstream`, more concurrent clients than slots are queued,
  none answered 429: the proxy's default queue is far past the upstream's slots;
- `wake` (what the scheduler calls when a request arrives) ends a step that waits for
  the upstream's next bytes at once, so the request joins then, not when a token comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.env import require
from tests.helpers.llamacpp import find_smollm2, llama_server_binary
from tests.helpers.servers import Server, llama_greedy, start_llama_server, start_server

DATA = Path(__file__).resolve().parent / "data" / "realign"
SLOTS = 4


def recordings() -> list[dict[str, Any]]:
    manifest = json.loads((DATA / "MANIFEST.json").read_text("utf-8"))
    return [e for e in manifest if not e["lossy"]]


def sse(entry: dict[str, Any]) -> bytes:
    lines = (DATA / entry["file"]).read_text("utf-8").splitlines()
    return ("".join(f"data: {line}\n\n" for line in lines) + "data: [DONE]\n\n").encode()


def read(engine: Any, data: bytes, cuts: list[int], n: int) -> list[int]:
    from tokentrail.engines.upstream.wire import StepReader

    reader = StepReader(engine, {"stream": True}, [], n)
    steps = []
    bounds = [0, *sorted(set(cuts)), len(data)]
    for a, b in itertools.pairwise(bounds):
        steps += reader.feed(data[a:b])
    steps += reader.finish()
    return [s.token for s in steps]


@pytest.fixture(scope="module")
def engines(corpus: Path) -> dict[str, Any]:
    from tokentrail import load_vocab
    from tokentrail.engines.upstream.engine import UpstreamEngine

    out = {}
    for e in recordings():
        vocab = load_vocab(corpus / "tokenizers" / e["tokenizer"])
        # A named dialect and model: nothing is asked of the (absent) server.
        out[e["name"]] = UpstreamEngine("http://127.0.0.1:9", vocab, dialect="vllm", model="m")
    return out


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_cut_of_the_bytes_reads_the_same_steps(engines: dict[str, Any], data: Any) -> None:
    entry = data.draw(st.sampled_from(recordings()))
    raw = sse(entry)
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=30))
    engine = engines[entry["name"]]
    assert read(engine, raw, cuts, len(entry["ids"])) == entry["ids"]


def test_a_line_that_is_not_json_is_an_upstream_error(engines: dict[str, Any]) -> None:
    from tokentrail.engines.upstream.wire import StepReader
    from tokentrail.errors import UpstreamError

    reader = StepReader(next(iter(engines.values())), {"stream": True}, [], 4)
    with pytest.raises(UpstreamError, match="not JSON"):
        reader.feed(b'data: {"choices": [\n\n')


# -- a real llama-server with 4 slots ----------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    llama_server_binary()
    log = tmp_path_factory.mktemp("logs") / "llama-server.log"
    server = start_llama_server(find_smollm2(), log, parallel=SLOTS)
    yield server
    server.stop()


def collect(batch: Any, uids: set[int], cut: dict[int, int]) -> dict[int, list[int]]:
    """Steps per uid until every uid left; a uid in `cut` is removed after that many."""
    got: dict[int, list[int]] = {u: [] for u in uids}
    deadline = time.monotonic() + 120
    while len(batch) and time.monotonic() < deadline:
        for uid, step in batch.step():
            assert not isinstance(step, Exception), step
            got[uid].append(step.token)
            if uid in cut and len(got[uid]) >= cut[uid]:
                batch.remove(uid)
    assert not len(batch), "the batch did not finish in time"
    return got


@pytest.mark.parametrize("kind", ["AsyncUpstreamBatch", "ThreadedBatch"])
def test_wake_ends_a_step_that_waits_for_the_upstream(engines: dict[str, Any], kind: str) -> None:
    import threading

    from tokentrail.engines.batch import ThreadedBatch
    from tokentrail.engines.upstream.stream import AsyncUpstreamBatch

    engine = next(iter(engines.values()))
    # A wait no test would sit out: without `wake` this step would return after 10 min.
    batch = (AsyncUpstreamBatch if kind == "AsyncUpstreamBatch" else ThreadedBatch)(
        engine, 4, wait=600.0
    )
    done: list[Any] = []
    try:
        waiting = threading.Thread(target=lambda: done.append(batch.step()), daemon=True)
        waiting.start()
        time.sleep(0.2)  # the step is waiting on its queue by now
        assert not done
        batch.wake()
        waiting.join(30)
        assert done == [[]], "wake did not end the waiting step"
    finally:
        batch.close()


def test_batch_runs_the_upstreams_slots_and_its_tokens(llama: Server) -> None:
    from tokentrail.engines.upstream.engine import UpstreamEngine
    from tokentrail.engines.upstream.stream import AsyncUpstreamBatch
    from tokentrail.sampling import SamplingParams
    from tokentrail.server.proxy import load_tokenizer

    engine = UpstreamEngine(llama.url, load_tokenizer(str(llama.model_dir)), eos_ids=[2])
    assert engine.dialect == "llamacpp" and engine.capacity == SLOTS
    prompts = [
        engine.tokenizer.encode(p) for p in ("The sea is", "A list in Python", "你好", "1, 2,")
    ]
    n = 12
    batch = engine.open_batch(None)
    try:
        assert isinstance(batch, AsyncUpstreamBatch) and batch.max_batch == SLOTS
        params = SamplingParams(temp=0.0, top_logprobs=2, logit_bias={2: -100.0})
        uids = {batch.add(p, params, n): i for i, p in enumerate(prompts)}
        with pytest.raises(RuntimeError, match="full"):
            batch.add(prompts[0], params, n)
        got = collect(batch, set(uids), {})
        oracle = [llama_greedy(llama, p, n) for p in prompts]
        assert [got[u] for u in sorted(uids, key=uids.get)] == oracle
        # Streams cut short, then whole ones, on the same kept-alive client: each whole
        # one is still exactly llama-server's.
        for _ in range(3):
            cut = batch.add(prompts[0], params, 200)
            whole = batch.add(prompts[1], params, n)
            out = collect(batch, {cut, whole}, {cut: 2})
            assert out[whole] == oracle[1]
        assert batch.stats()["tokens"] >= 4 * n
    finally:
        batch.close()
        engine.close()


class DroppingFront:
    """A TCP front to `target` (host, port) that reads the first `drops` connections'
    requests and closes them without a word, as an upstream does to a kept-alive
    connection it has already let go; later connections are relayed byte for byte."""

    def __init__(self, target: tuple[str, int], drops: int) -> None:
        import socket
        import threading

        self.target, self.drops, self.seen = target, drops, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.seen += 1
            if self.seen <= self.drops:
                data = b""
                while b"\r\n\r\n" not in data and (part := conn.recv(65536)):
                    data += part
                conn.close()
                continue
            up = socket.create_connection(self.target)
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: Any, b: Any) -> None:
        import socket

        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()


def test_a_stale_kept_alive_connection_is_retried_once_on_a_fresh_one(llama: Server) -> None:
    """An upstream that closes a connection without answering (a kept-alive one it had
    already let go; aiohttp raises ServerDisconnectedError): the request never ran, so
    the batch sends it once more and the stream is still exactly llama-server's. A
    second drop is the sequence's error."""
    from urllib.parse import urlsplit

    from tokentrail.engines.upstream.engine import UpstreamEngine
    from tokentrail.sampling import SamplingParams
    from tokentrail.server.proxy import load_tokenizer

    prompt = "The sea is"
    where = urlsplit(llama.url)
    tokenizer = load_tokenizer(str(llama.model_dir))
    for drops in (1, 2):
        engine = UpstreamEngine(llama.url, tokenizer, eos_ids=[2])
        front = DroppingFront((where.hostname or "127.0.0.1", where.port or 80), drops)
        engine.url = front.url  # found out what it is from llama-server; now through the front
        batch = engine.open_batch(None)
        try:
            params = SamplingParams(temp=0.0, top_logprobs=2, logit_bias={2: -100.0})
            uid = batch.add(engine.tokenizer.encode(prompt), params, 8)
            if drops == 1:
                assert collect(batch, {uid}, {})[uid] == llama_greedy(
                    llama, engine.tokenizer.encode(prompt), 8)
                assert front.seen == 2
            else:
                with pytest.raises(Exception, match="disconnected"):
                    collect(batch, {uid}, {})
                assert front.seen == 2
        finally:
            batch.close()
            engine.close()
            front.close()


def test_more_clients_than_slots_are_queued_not_refused(
    llama: Server, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`serve --upstream` in front of 4 slots, with its default queue: 24 concurrent
    streams (6 per slot, more than a model server's default queue of 16 lets wait) all
    complete, none 429, as they would sent to llama-server directly; the proxy's batch is
    the upstream's 4 slots."""
    require("uvicorn")
    log = tmp_path_factory.mktemp("logs") / "proxy.log"
    args = ("--upstream", llama.url, "--tokenizer", str(llama.model_dir))
    proxy = start_server(None, log, *args)
    clients, n = 6 * SLOTS, 16
    try:
        health = proxy.health()
        assert health["max_batch"] == SLOTS and health["batch_kind"] == "AsyncUpstreamBatch"
        statuses = asyncio.run(_clients(proxy, clients, n))
        streams = _streams(proxy, clients * n)
    finally:
        proxy.stop()
    assert statuses == [(200, n)] * clients, statuses
    # What reading the upstream costs is served, per token (JSON numbers).
    assert streams["max_batch"] == SLOTS and streams["tokens"] == clients * n, streams
    assert streams["realign_us_per_token"] > 0 and streams["parse_us_per_token"] > 0


def _streams(proxy: Server, tokens: int) -> dict[str, Any]:
    """``streams`` of the proxy's GET /tokentrail/upstream, once `tokens` were read (the
    last sequence's count lands as its task ends, just after its last step)."""
    deadline = time.monotonic() + 10
    while True:
        r = httpx.get(proxy.url + "/tokentrail/upstream", timeout=30)
        assert r.status_code == 200, r.text
        streams = r.json()["streams"]
        if streams["tokens"] >= tokens or time.monotonic() > deadline:
            return dict(streams)
        time.sleep(0.2)


async def _clients(proxy: Server, k: int, n: int) -> list[tuple[int, int]]:
    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, int]:
        body = {
            "model": proxy.model,
            "messages": [{"role": "user", "content": f"Count to {i + 5}."}],
            "max_tokens": n,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logit_bias": {"2": -100},
        }
        async with client.stream("POST", proxy.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, 0
            used = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    used = usage["completion_tokens"] if usage else used
            return 200, used

    async with httpx.AsyncClient(timeout=300) as client:
        return list(await asyncio.gather(*(one(client, i) for i in range(k))))


def test_a_wait_with_nothing_arriving_ends_within_its_limit(engines: dict[str, Any]) -> None:
    """The scheduler relies on a pass every `wait` seconds while sequences run (to reap
    stalled clients): the limit is one standing timer, and every wait ends within it,
    on the batch's own loop and attached to a running one."""
    from tokentrail.engines.upstream.stream import AsyncUpstreamBatch

    engine = next(iter(engines.values()))
    import threading

    batch = AsyncUpstreamBatch(engine, 4, wait=0.3)
    try:
        for _ in range(3):  # each after the previous tick fired
            done: list[Any] = []
            waiting = threading.Thread(target=lambda d=done: d.append(batch.step()), daemon=True)
            waiting.start()
            waiting.join(5.0)
            assert done == [[]], "a step with nothing arriving outlived its wait"
    finally:
        batch.close()

    async def attached() -> list[float]:
        batch = AsyncUpstreamBatch(engine, 4, wait=0.3)
        batch.attach(asyncio.get_running_loop())
        took = []
        try:
            for _ in range(4):
                t0 = time.monotonic()
                await asyncio.wait_for(batch.arrival(batch.wait), 5.0)
                took.append(time.monotonic() - t0)
                await asyncio.sleep(0.1)  # a pass in between: the tick may fire meanwhile
            t0 = time.monotonic()
            never = asyncio.ensure_future(batch.arrival(None))  # no limit: only a wake
            await asyncio.sleep(0.8)
            assert not never.done()
            batch.wake()
            await asyncio.wait_for(never, 5)
            took.append(time.monotonic() - t0)
        finally:
            await batch.aclose()
        return took

    took = asyncio.run(attached())
    assert all(t <= 0.3 + 1.0 for t in took[:4]), took  # within its limit (+ a loaded machine)
    assert took[4] >= 0.8, took
