"""The official `openai` client against `tokentrail serve`: segments and their tokens.

    python examples/openai_client.py [--base-url URL] [PROMPT]

Without --base-url the example starts `tokentrail serve` on the built-in demo model, on
a free loopback port, and stops it at the end. It streams a chat completion with
`logprobs`, prints one JSON object per segment of tokentrail's extension (the text, the
tokens behind it as [index, id, start, end], its probability), then the whole streamed
content. Every chunk is an ordinary OpenAI chunk: `chunk.choices[0].delta.content` is the text, and
`chunk.model_extra["tokentrail"]` carries the segments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

from openai import OpenAI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def demo_server(timeout: float = 180.0) -> Iterator[str]:
    """Run `tokentrail serve` on loopback until the block ends; yield its base URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokentrail", "serve", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tokentrail serve exited: {proc.stderr.read().decode()}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        yield url + "/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(base_url: str, prompt: str) -> None:
    client = OpenAI(base_url=base_url, api_key="unused")  # the key is not checked
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}],
        stream=True, logprobs=True, top_logprobs=3, max_tokens=120, temperature=0,
    )
    content = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            content.append(chunk.choices[0].delta.content)
        extension = (chunk.model_extra or {}).get("tokentrail") or {}
        for segment in extension.get("segments", []):
            confidence = segment.get("confidence") or {}
            print(json.dumps({
                "text": segment["text"],
                "tokens": [[t["index"], t["id"], t["start"], t["end"]] for t in segment["tokens"]],
                "p": confidence.get("probability"),
            }, ensure_ascii=False))
    print("content:", json.dumps("".join(content), ensure_ascii=False))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", nargs="?", default="Translate water into French.")
    parser.add_argument("--base-url", help="a running server's /v1 URL (default: start one)")
    args = parser.parse_args()
    if args.base_url:
        run(args.base_url, args.prompt)
    else:
        with demo_server() as url:
            run(url, args.prompt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
