"""Hostile structured requests against a real `tokentrail serve` (demo model), each with
a normal greedy stream running beside it (issue #29).

For every class (`CASES`) the script starts the normal stream, sends the hostile request
once the stream is under way, and records: the hostile request's status and time to
answer (or "no answer" within `--timeout`), whether its error message is one line, and
whether the normal stream got the same tokens it gets alone. Results go to
benchmarks/results/hostile.md (or `--out`); `--label` names the run (e.g. "before").

    python benchmarks/hostile_requests.py --label after
    PYTHONPATH=/path/to/other/src python benchmarks/hostile_requests.py --label before
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
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


def _stream_tokens(url: str, out: dict[str, Any]) -> None:
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
                for choice in chunk.get("choices", []):
                    for seg in (choice.get("tokentrail") or {}).get("segments", []):
                        ids += [t["id"] for t in seg.get("tokens", [])]
    except httpx.HTTPError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["ids"] = ids
    out["max_gap"] = max(gaps, default=0.0)
    out["seconds"] = time.monotonic() - t0


def _hostile(url: str, fields: dict[str, Any], timeout: float) -> dict[str, Any]:
    base = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16,
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
        return {"status": "no answer", "seconds": timeout, "message": ""}
    except httpx.HTTPError as e:
        return {"status": type(e).__name__, "seconds": time.monotonic() - t0, "message": ""}
    message = ""
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text
    return {"status": r.status_code, "seconds": time.monotonic() - t0, "message": message}


def run_case(url: str, fields: dict[str, Any], alone: list[int], timeout: float) -> dict[str, Any]:
    """One class beside a normal stream."""
    normal: dict[str, Any] = {}
    thread = threading.Thread(target=_stream_tokens, args=(url, normal))
    thread.start()
    time.sleep(0.3)  # the stream is under way
    result = _hostile(url, fields, timeout)
    thread.join(timeout + 30)
    result["one_line"] = "\n" not in result["message"]
    result["beside_same"] = normal.get("ids") == alone and "error" not in normal
    result["beside_error"] = normal.get("error", "")
    result["beside_max_gap"] = normal.get("max_gap", float("nan"))
    return result


def _healthy(url: str) -> bool:
    """Whether the model still answers (a one-token request within 15 s); /health alone
    answers from the event loop while the model's thread may be stuck."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    try:
        return httpx.post(url + CHAT, json=body, timeout=15).status_code == 200
    except httpx.HTTPError:
        return False


def _start(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    cmd = [sys.executable, "-m", "tokentrail.server", "--port", "0", "--log-level", "info"]
    out = log.open("wb")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        found = re.search(r"serving \S+ on (http://127\.0\.0\.1:\d+)", log.read_text())
        if found:
            url = found.group(1)
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
        if proc.poll() is not None:
            break
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"server did not start:\n{log.read_text()[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="after")
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--only", nargs="*", help="case names (substrings) to run")
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).parent / "results" / "hostile.md")
    args = ap.parse_args()
    log = Path(tempfile.mkdtemp()) / "server.log"
    proc, url = _start(log)
    rows = []
    try:
        alone: dict[str, Any] = {}
        _stream_tokens(url, alone)
        for name, fields in CASES.items():
            if args.only and not any(o in name for o in args.only):
                continue
            if proc.poll() is not None:
                rows.append((name, {"status": "server gone", "seconds": 0, "message": "",
                                    "one_line": True, "beside_same": False,
                                    "beside_error": "", "beside_max_gap": 0}))
                continue
            r = run_case(url, fields, alone["ids"], args.timeout)
            if not _healthy(url):  # the case left the server stuck: the next gets a new one
                r["status"] = f"{r['status']} (server stuck after)"
                proc.kill()
                proc.wait(30)
                proc, url = _start(log)
            rows.append((name, r))
            print(f"{name}: {r['status']} in {r['seconds']:.2f} s; beside same="
                  f"{r['beside_same']} gap={r['beside_max_gap']:.2f}; {r['message'][:120]!r}",
                  flush=True)
    finally:
        proc.kill()
        proc.wait(30)
    lines = [f"\n## {args.label} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n",
             f"Demo model, hostile request max_tokens 16, client timeout {args.timeout:g} s; "
             "beside: a greedy 48-token stream started 0.3 s before.\n",
             "| class | status | seconds | one line | beside: same tokens | beside: longest "
             "wait (s) | message |", "|---|---|---|---|---|---|---|"]
    for name, r in rows:
        msg = r["message"].replace("\n", "\\n").replace("|", "\\|")[:140]
        lines.append(f"| {name} | {r['status']} | {r['seconds']:.2f} | {r['one_line']} | "
                     f"{r['beside_same']} | {r['beside_max_gap']:.2f} | {msg} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    new = not args.out.exists()
    with args.out.open("a") as f:
        if new:
            f.write("# Hostile structured requests (issue #29)\n\nWritten by "
                    "benchmarks/hostile_requests.py.\n")
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
