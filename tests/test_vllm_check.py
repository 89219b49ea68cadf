"""The proxy's startup check (`tokentrail check --quick`) in front of a real vLLM: it asks
for vLLM's token ids (`return_token_ids`) as the proxy's own requests do, and reports
them. vLLM's own answer to the same request is the oracle. (The vLLM and proxy fixtures
are tests/test_vllm_server.py's; vLLM's start takes minutes on 2 CPUs.)"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from tests.test_vllm_server import NAME, Server, model_dir, proxy, vllm, vpy  # noqa: F401


def vllm_stream_ids(server: Server) -> list[int]:
    """The token ids vLLM itself streams for a chat request with return_token_ids."""
    body: dict[str, Any] = {
        "model": NAME,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    ids: list[int] = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices") or []:
                    ids += choice.get("token_ids") or []
    return ids


def test_startup_check_asks_vllm_for_its_token_ids_and_reports_them(
    proxy: Server,  # noqa: F811
    vllm: Server,  # noqa: F811
) -> None:
    assert vllm_stream_ids(vllm), "vLLM streams no token_ids even when asked"
    deadline = time.monotonic() + 600
    while True:
        report = httpx.get(proxy.url + "/tokentrail/upstream", timeout=30).json()
        if report["status"] not in ("running", "not run") or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert report["status"] == "done", report
    assert report["dialect"] == "vllm"
    ids = report["capabilities"]["token_ids"]
    assert ids["status"] == "yes" and "token_ids" in ids["detail"], ids
    assert "vllm-token-ids" in report["sources"], report  # the realigner's name for them
    # Realigned with those ids, every probe's stream is exact.
    assert report["realign"] and all(r["exact"] for r in report["realign"].values()), report
    assert not any("no vLLM runs here" in n for n in report["notes"])
