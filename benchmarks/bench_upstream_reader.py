"""What reading an upstream's stream costs, by HTTP client (issue #32).

The proxy reads one SSE event per token from its upstream. This measures the client
side alone: `--clients` concurrent streamed requests to llama-server's ``/completion``
(the demo model's GGUF, as `bench_proxy_cpu.py` runs it; ``n_probs`` 5,
``return_tokens``, end tokens suppressed), read to the end and thrown away, with

- ``httpx``: ``AsyncClient.stream`` + ``aiter_bytes`` (what the proxy used before);
- ``aiohttp``: ``ClientSession.post`` + ``content.iter_any`` (what it uses now);
- ``raw``: an asyncio ``Protocol`` feeding httptools' response parser: no client
  library at all, the floor of reading these bytes in Python on this machine.

Reported: this process's CPU time per chunk read (user + system, every thread),
medians over alternating rounds, on uvloop (as the proxy runs).

    python benchmarks/bench_upstream_reader.py [--server $TOKENTRAIL_LLAMA_SERVER]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench_proxy_cpu import gguf_path, start_llama


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _body(k: int, n: int) -> dict[str, Any]:
    return {
        "prompt": f"Write poem number {k} about the sea.",
        "n_predict": n,
        "stream": True,
        "return_tokens": True,
        "n_probs": 5,
        "temperature": 0,
        "logit_bias": [[0, False], [2, False]],
    }


async def with_httpx(url: str, clients: int, n: int) -> int:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:

        async def one(k: int) -> int:
            chunks = 0
            async with client.stream("POST", "/completion", json=_body(k, n)) as r:
                async for _ in r.aiter_bytes():
                    chunks += 1
            return chunks

        return sum(await asyncio.gather(*(one(k) for k in range(clients))))


async def with_aiohttp(url: str, clients: int, n: int) -> int:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(k: int) -> int:
            chunks = 0
            async with session.post(url + "/completion", json=_body(k, n)) as r:
                async for _ in r.content.iter_any():
                    chunks += 1
            return chunks

        return sum(await asyncio.gather(*(one(k) for k in range(clients))))


async def with_raw(url: str, clients: int, n: int) -> int:
    import httptools

    where = urlsplit(url)
    loop = asyncio.get_running_loop()

    class Reader(asyncio.Protocol):
        def __init__(self) -> None:
            self.chunks = 0
            self.done: asyncio.Future[int] = loop.create_future()
            self.parser = httptools.HttpResponseParser(self)

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_body(self, body: bytes) -> None:
            self.chunks += 1

        def on_message_complete(self) -> None:
            self.done.set_result(self.chunks)

    async def one(k: int) -> int:
        transport, reader = await loop.create_connection(Reader, where.hostname, where.port)
        body = json.dumps(_body(k, n)).encode()
        head = b"POST /completion HTTP/1.1\r\nHost: %s\r\n" % (where.netloc.encode())
        head += b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        transport.write(head + body)
        try:
            return await reader.done
        finally:
            transport.close()

    return sum(await asyncio.gather(*(one(k) for k in range(clients))))


CLIENTS = {"httpx": with_httpx, "aiohttp": with_aiohttp, "raw": with_raw}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", type=Path, default=os.environ.get("TOKENTRAIL_LLAMA_SERVER"))
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.server is None:
        raise SystemExit("give --server or set TOKENTRAIL_LLAMA_SERVER")
    import uvloop

    args.gguf, args.slots, args.threads = gguf_path(), 64, 1
    up, url = start_llama(args, Path(tempfile.mkdtemp(prefix="bench-reader-")))
    per_chunk: dict[str, list[float]] = {k: [] for k in CLIENTS}
    try:
        uvloop.run(with_aiohttp(url, 2, 8))  # warm up the server
        for _ in range(args.repeat):
            for name, read in CLIENTS.items():
                c0 = _cpu()
                chunks = uvloop.run(read(url, args.clients, args.max_tokens))
                per_chunk[name].append(1e6 * (_cpu() - c0) / chunks)
    finally:
        up.terminate()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{args.clients} streams x {args.max_tokens} tokens, medians of {args.repeat} "
          f"alternating rounds, {os.cpu_count()} CPUs, run {when}\n")  # fmt: skip
    print("| client | CPU µs per chunk read | rounds |\n|---|---:|---|")
    for name, values in per_chunk.items():
        rounds = ", ".join(f"{v:.0f}" for v in values)
        print(f"| {name} | {statistics.median(values):.0f} | {rounds} |")


if __name__ == "__main__":
    sys.exit(main())
