"""Checks on what the OpenAI-compatible server sends: SSE framing, the tokentrail
extension, token bytes and attribution (shared by the server test modules)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from tests.helpers.servers import Server

if TYPE_CHECKING:
    import httpx


def ext(obj: Any) -> dict[str, Any]:
    """The tokentrail extension of an openai-client object or a plain dict."""
    if isinstance(obj, dict):
        return obj["tokentrail"]
    return obj.model_extra["tokentrail"]


def extension_ids(completion: Any) -> list[int]:
    """A response's token ids in order, from its extension's segments (a token whose
    text two segments share is listed in both: each index once)."""
    out: dict[int, int] = {}
    for seg in ext(completion)["segments"]:
        for t in seg["tokens"]:
            out.setdefault(t["index"], t["id"])
    return [out[i] for i in sorted(out)]


def check_token_bytes(tok: Any, specials: set[int], ids: list[int], raw: list[bytes]) -> None:
    """`raw` are the real bytes of `ids`: they decode as the tokenizer decodes them."""
    assert len(ids) == len(raw)
    plain = [(i, b) for i, b in zip(ids, raw, strict=True) if i not in specials]
    for i, b in plain:
        assert tok.decode([i]) == b.decode("utf-8", "replace"), (i, b)
    joined = b"".join(b for _, b in plain)
    assert joined.decode("utf-8", "replace") == tok.decode(ids, skip_special_tokens=True)


def check_attribution(chunk_exts: list[dict[str, Any]], n_tokens: int) -> None:
    """Every generated token appears, in order, in the segments (or the stop tokens)."""
    seen: list[int] = []
    for e in chunk_exts:
        for seg in e["segments"]:
            for t in seg["tokens"]:
                if not seen or seen[-1] != t["index"]:
                    seen.append(t["index"])
            assert seg["confidence"] is not None
            assert seg["confidence"]["n_tokens"] == len(seg["tokens"])
        for t in e.get("stop", {}).get("tokens", []):
            if not seen or seen[-1] != t["index"]:
                seen.append(t["index"])
    assert seen == list(range(n_tokens))


def wait_until_finished(server: Server, job_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Poll /health until job `job_id` is among the finished ones; return it and /health."""
    deadline = time.monotonic() + 120
    while True:
        h = server.health()
        done = [j for j in h["recent"] if j["id"] == job_id]
        if done:
            return done[0], h
        assert time.monotonic() < deadline, f"generation never stopped: {h}"
        time.sleep(0.05)


def sse_events(raw: bytes) -> list[str]:
    """Split an SSE body into its data payloads, checking the framing strictly."""
    assert raw.endswith(b"\n\n"), raw[-200:]
    events = raw[:-2].split(b"\n\n")
    out = []
    for event in events:
        assert event.startswith(b"data: "), event[:200]
        assert b"\n" not in event, event[:200]
        out.append(event[len(b"data: ") :].decode("utf-8"))
    return out


def stream_raw(url: str, path: str, body: dict[str, Any]) -> tuple[httpx.Response, list[Any]]:
    import httpx

    with httpx.Client(timeout=300) as c, c.stream("POST", url + path, json=body) as r:
        raw = r.read()
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    return r, [json.loads(e) for e in events[:-1]]
