"""Hostile structured requests (issue #29) and a normal stream to run beside them, for
tests/test_hostile_server.py and benchmarks/hostile_requests.py.

`CASES` maps each class to the constraint fields of a small chat request; `run_case`
sends one while a greedy stream (`NORMAL`) runs, and says how both went.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx

CHAT = "/v1/chat/completions"
#: A case's key for constraint fields given as raw JSON text (too deep for json.dumps).
RAW = "__raw__"
NORMAL = {
    "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
    "max_tokens": 48, "temperature": 0, "stream": True, "logprobs": True,
}


def _nested(depth: int) -> dict[str, Any]:
    """A schema `depth` arrays deep, as raw JSON text (json.dumps would recurse)."""
    schema = '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth
    return {RAW: '"response_format": {"type": "json_schema", "json_schema": {"name": "x", '
                 f'"schema": {schema}}}}}'}


def _left_recursive(rules: int) -> str:
    lines = ["start: r0"]
    lines += [f'r{i}: r{i} "+" r{i + 1} | r{i + 1}' for i in range(rules)]
    lines.append(f'r{rules}: "x"')
    return "\n".join(lines)


def _schema(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}


def _tools(n: int) -> dict[str, Any]:
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "parameters": {"type": "object",
                                            "properties": {"a": {"type": "string"}}}}}
             for i in range(n)]
    return {"tools": tools, "tool_choice": "required"}


#: name -> the hostile request's constraint fields (merged into a small chat request).
CASES: dict[str, dict[str, Any]] = {
    "self-referencing $ref": _schema(
        {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
    "dangling $ref": _schema({"$ref": "#/$defs/missing"}),
    "50,000-value enum": _schema({"enum": [f"value{i}" for i in range(50_000)]}),
    "pattern ^(a+)+$": _schema({"type": "string", "pattern": "^(a+)+$"}),
    "regex a{1000000}": {"structured_outputs": {"regex": "a{1000000}"}},
    r"regex [\s\S]{0,200000}x": {"structured_outputs": {"regex": r"[\s\S]{0,200000}x"}},
    "bad regex (ab": {"structured_outputs": {"regex": "(ab"}},
    "20,000-way choice": {"structured_outputs": {"choice": [f"c{i}" for i in range(20_000)]}},
    "left-recursive grammar": {"structured_outputs": {"grammar": _left_recursive(2_000)}},
    "minLength 1e9": _schema({"type": "string", "minLength": 1_000_000_000}),
    "maxItems 1e9, minItems 5e8": _schema(
        {"type": "array", "items": {"type": "integer"}, "minItems": 500_000_000,
         "maxItems": 1_000_000_000}),
    "nesting 900 deep": _nested(900),
    "nesting 5,000 deep": _nested(5_000),
    "1,000 tools": _tools(1_000),
    "tool_choice not in tools": {**_tools(2), "tool_choice": {
        "type": "function", "function": {"name": "nope"}}},
}


def stream_tokens(url: str, out: dict[str, Any]) -> None:
    """The normal stream: its token ids (from the extension's segments) and errors."""
    ids: list[int] = []
    t0 = time.monotonic()
    gaps: list[float] = []
    last = t0
    try:
        with httpx.stream("POST", url + CHAT, json=NORMAL, timeout=300) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = chunk["error"].get("message", "")
                    break
                token = (chunk.get("tokentrail") or {}).get("token")
                if token is not None:  # each step's token, in the extension
                    ids.append(token["id"])
    except httpx.HTTPError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["ids"] = ids
    out["max_gap"] = max(gaps, default=0.0)
    out["seconds"] = time.monotonic() - t0


def send(
    url: str, fields: dict[str, Any], timeout: float, max_tokens: int = 16
) -> dict[str, Any]:
    """Post a small greedy chat request with `fields`: its status, time, error."""
    base = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens,
            "temperature": 0}
    if RAW in fields:
        text = json.dumps(base)[:-1] + ", " + fields[RAW] + "}"
    else:
        text = json.dumps({**base, **fields})
    t0 = time.monotonic()
    try:
        r = httpx.post(url + CHAT, content=text, timeout=timeout,
                       headers={"Content-Type": "application/json"})
    except httpx.TimeoutException:
        return {"status": "no answer", "seconds": timeout, "message": "", "param": None}
    except httpx.HTTPError as e:
        return {"status": type(e).__name__, "seconds": time.monotonic() - t0, "message": "",
                "param": None}
    message, param, body = "", None, None
    try:
        body = r.json()
    except ValueError:
        message = r.text
    if r.status_code != 200 and isinstance(body, dict):
        error = body.get("error") or {}
        message, param = str(error.get("message", r.text)), error.get("param")
    return {"status": r.status_code, "seconds": time.monotonic() - t0, "message": message,
            "param": param, "body": body}


def run_case(url: str, fields: dict[str, Any], alone: list[int], timeout: float) -> dict[str, Any]:
    """One class beside a normal stream."""
    normal: dict[str, Any] = {}
    thread = threading.Thread(target=stream_tokens, args=(url, normal))
    thread.start()
    time.sleep(0.3)  # the stream is under way
    result = send(url, fields, timeout)
    thread.join(timeout + 30)
    result["one_line"] = "\n" not in result["message"]
    result["beside_same"] = normal.get("ids") == alone and "error" not in normal
    result["beside_error"] = normal.get("error", "")
    result["beside_max_gap"] = normal.get("max_gap", float("nan"))
    return result
