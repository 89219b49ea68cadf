"""The proxy's passes run where the upstream's steps arrive (`server.on_loop.drive`).

While the driver waits, the reader task that read a stream's steps runs the
scheduler's pass itself (`Scheduler.run_pass`, from the batch's `on_arrival`): one task
hop fewer per token. Against a real llama-server (SmolLM2-135M-Instruct), with
`tokentrail serve --upstream` as a process and, where a pass is made to fail, the real
app on a uvicorn thread:

- one client's tokens are passed on by its reader (``reader_passes`` in
  ``GET /tokentrail/upstream``'s ``streams``), and they are llama-server's own greedy ids
  for the same prompt ids;
- clients one after another each get their whole, exact answer: the place a reader's
  pass frees is taken by the next request;
- a pass that fails in a reader ends the request in flight unfinished (an error status
  before its first token, else a stream cut short without ``[DONE]``) and the log names
  the failure, as a failed pass of the driver does: no client waits forever.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.helpers.env import require
from tests.helpers.llamacpp import find_smollm2, llama_server_binary
from tests.helpers.servers import Server, llama_greedy, llama_with_proxy

uvicorn = require("uvicorn")

N = 24


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    """llama-server on SmolLM2 and `tokentrail serve --upstream` in front of it."""
    llama_server_binary()
    with llama_with_proxy(find_smollm2(), tmp_path_factory.mktemp("logs")) as pair:
        yield pair


def prompt_ids(llama: Server, text: str) -> list[int]:
    """`text`'s ids by llama-server's own tokenizer."""
    r = httpx.post(llama.url + "/tokenize", json={"content": text}, timeout=30)
    return list(r.raise_for_status().json()["tokens"])


def stream(url: str, ids: list[int], n: int, timeout: float = 120) -> tuple[list[int], list[str]]:
    """(token ids by index from the extension's segments, errors) of one streamed
    completion of prompt `ids` through the proxy at `url`: the error events' messages,
    "no [DONE]" for a stream cut short (how the server ends a cancelled one), or for a
    request that ended before its stream began, its HTTP status."""
    body = {"prompt": ids, "max_tokens": n, "temperature": 0, "stream": True,
            "logprobs": 2, "logit_bias": {"2": -100}}  # fmt: skip
    by_index: dict[int, int] = {}
    errors: list[str] = []
    done = False
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            return [], [f"HTTP {r.status_code}"]
        for line in r.iter_lines():
            done = done or line == "data: [DONE]"
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(str(chunk["error"].get("message")))
                continue
            for seg in (chunk.get("tokentrail") or {}).get("segments") or []:
                for tok in seg["tokens"]:
                    by_index[tok["index"]] = tok["id"]
    if not done:
        errors.append("no [DONE]")
    return [by_index[i] for i in sorted(by_index)], errors


def streams(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/tokentrail/upstream", timeout=30)
    return dict(r.raise_for_status().json()["streams"])


def test_one_clients_tokens_are_passed_on_by_its_reader(servers: tuple[Server, Server]) -> None:
    llama, proxy = servers
    ids = prompt_ids(llama, "The three primary colours are")
    before = streams(proxy.url)["reader_passes"]
    got, errors = stream(proxy.url, ids, N)
    assert errors == []
    assert got == llama_greedy(llama, ids, N)
    passes = streams(proxy.url)["reader_passes"] - before
    # Tokens arrive one frame at a time, about 10 ms apart: the driver waits between
    # them, so nearly every one is run through by the task that read it.
    assert passes >= N // 2, passes


def test_clients_one_after_another_each_get_their_whole_answer(
    servers: tuple[Server, Server],
) -> None:
    """The place a reader's pass frees (its sequence ended there) is taken by the next
    request: twelve requests in a row on llama-server's one slot, each exact."""
    llama, proxy = servers
    texts = ["Name a fruit:", "2 + 2 =", "The capital of France is", "Once upon a time"]
    for k in range(12):
        ids = prompt_ids(llama, texts[k % len(texts)])
        got, errors = stream(proxy.url, ids, 8, timeout=60)
        assert errors == [] and got == llama_greedy(llama, ids, 8), (k, got, errors)


class InProcess:
    """`create_upstream_app` in front of `llama` on a uvicorn thread of this process."""

    def __init__(self, llama: Server) -> None:
        from tokentrail.server.proxy import create_upstream_app

        app = create_upstream_app(llama.url, str(llama.model_dir), check_upstream=False)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> InProcess:
        self.thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError("the in-process proxy did not start")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def test_a_pass_that_fails_in_a_reader_ends_the_request_unfinished(
    servers: tuple[Server, Server], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    llama = servers[0]
    from tokentrail.server.scheduler import Scheduler

    calls = []
    run_pass = Scheduler.run_pass

    def broken(self: Scheduler, batch: Any) -> bool:
        task = asyncio.current_task()
        if task is not None and task.get_coro().__qualname__ == "AsyncUpstreamBatch._stream":
            calls.append(task)  # a pass in a reader's task: it breaks
            raise RuntimeError("output stage broke")
        return run_pass(self, batch)

    monkeypatch.setattr(Scheduler, "run_pass", broken)
    ids = prompt_ids(llama, "Once upon a time")
    with caplog.at_level(logging.ERROR, logger="tokentrail.server"), InProcess(llama) as p:
        t0 = time.monotonic()
        got, errors = stream(p.url, ids, 200, timeout=60)
        took = time.monotonic() - t0
    assert calls, "no pass ran in a reader's task"
    # It ended, unfinished: before its stream began (its status) or cut short (no
    # [DONE]), depending on whether the driver's own pass had handed a token on first.
    assert errors and took < 30, (errors, took)
    assert len(got) < 200, got
    assert any("the scheduler's loop failed" in r.getMessage() and r.exc_info
               and "output stage broke" in str(r.exc_info[1]) for r in caplog.records)  # fmt: skip
