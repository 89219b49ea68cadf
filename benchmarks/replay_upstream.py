"""A recording upstream for benchmarks where the proxy, not the model, must be the limit.

On a 2-CPU machine every real upstream spends more CPU per token than the proxy does
(llama-server on a 2.2M-parameter model: about 500 µs per streamed token, mostly its
HTTP and sampling work), so a proxy scaled to more workers only takes cores away from
it. A GPU upstream spends its own hardware instead. This stands in for that hardware,
not for the upstream's behaviour: it forwards each request it has not seen (method,
path and body) to the real server given by `--target`, records the response, and
answers every later identical request with the recorded bytes: the same status, the
same headers' content type and, for an event stream, the same events one by one (each
event its own chunk, the loop yielding between events, so concurrent streams
interleave as they would from a batching server). Greedy requests with fixed prompts
repeat exactly, so after one warm-up every request is answered from the recording at
a few microseconds of CPU per event.

`--pace MS` spaces each stream's events by MS milliseconds, as a model producing one
token every MS ms per sequence would: then each read of the proxy brings one event, the
low-load case where the cost per event (a read, a write and the task switches between)
shows, with no model's CPU on the same cores. Without it the events go out as fast as
they are read.

    python benchmarks/replay_upstream.py --target http://127.0.0.1:8081 --port 8090 [--pace 5]

`GET /_replay/stats` answers `{"hits": n, "misses": n, "recorded": n}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass

import aiohttp


@dataclass
class Recording:
    status: int
    reason: str
    content_type: str
    events: list[bytes]  # an event stream's events, each with its blank line; else one body
    stream: bool


class Replay:
    def __init__(self, target: str, pace: float = 0.0) -> None:
        self.target = target.rstrip("/")
        self.pace = pace  # seconds between one stream's events
        self.recorded: dict[tuple[str, str, bytes], Recording] = {}
        self.hits = 0
        self.misses = 0
        self.session: aiohttp.ClientSession | None = None

    async def fetch(self, method: str, path: str, ctype: str, body: bytes) -> Recording:
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        headers = {"Content-Type": ctype} if ctype else {}
        async with self.session.request(method, self.target + path, data=body or None,
                                        headers=headers) as r:  # fmt: skip
            data = await r.read()
            kind = r.headers.get("Content-Type", "application/octet-stream")
            stream = kind.startswith("text/event-stream")
            if stream:
                events = [e + b"\n\n" for e in data.replace(b"\r\n", b"\n").split(b"\n\n") if e]
            else:
                events = [data]
            return Recording(r.status, r.reason or "OK", kind, events, stream)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                fields = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        fields[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(fields.get("content-length") or 0))
                if path == "/_replay/stats":
                    stats = {"hits": self.hits, "misses": self.misses,
                             "recorded": len(self.recorded)}  # fmt: skip
                    rec = Recording(200, "OK", "application/json",
                                    [json.dumps(stats).encode()], False)  # fmt: skip
                else:
                    key = (method, path, body)
                    rec = self.recorded.get(key)
                    if rec is None:
                        self.misses += 1
                        rec = await self.fetch(method, path, fields.get("content-type", ""), body)
                        if rec.status == 200:
                            self.recorded[key] = rec
                    else:
                        self.hits += 1
                await self.answer(writer, rec)
        finally:
            writer.close()

    async def answer(self, writer: asyncio.StreamWriter, rec: Recording) -> None:
        start = f"HTTP/1.1 {rec.status} {rec.reason}\r\nContent-Type: {rec.content_type}\r\n"
        if not rec.stream:
            body = rec.events[0]
            writer.write(f"{start}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
            return
        writer.write(f"{start}Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
                     .encode())  # fmt: skip
        for event in rec.events:
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(self.pace)  # (0: let the other streams' events go out)
        writer.write(b"0\r\n\r\n")
        await writer.drain()


async def serve(target: str, host: str, port: int, pace: float) -> None:
    replay = Replay(target, pace)
    server = await asyncio.start_server(replay.handle, host, port, backlog=1024)
    print(f"replaying {target} on http://{host}:{port}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="the real upstream's base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pace", type=float, default=0.0, help="ms between a stream's events")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.target, args.host, args.port, args.pace / 1000))


if __name__ == "__main__":
    main()
