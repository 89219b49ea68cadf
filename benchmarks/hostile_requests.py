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
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.helpers

from tests.helpers.hostile import CASES, CHAT, run_case, stream_tokens


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
        stream_tokens(url, alone)
        for name, fields in CASES.items():
            if args.only and not any(o in name for o in args.only):
                continue
            if proc.poll() is not None:
                rows.append((name, {"status": "server gone", "seconds": 0, "message": "",
                                    "one_line": True, "beside_same": False,
                                    "beside_error": "", "beside_max_gap": 0}))
                continue
            r = run_case(url, fields, alone["ids"], args.timeout)
            stuck = not _healthy(url)
            if stuck or not r["beside_same"]:  # each case starts on a sound server
                r["status"] = f"{r['status']} ({'server stuck' if stuck else 'restarted'} after)"
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
             "beside: a greedy 48-token stream started 0.3 s before. A case that left the "
             "server stuck or harmed the stream beside it is followed by a fresh server.\n",
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
