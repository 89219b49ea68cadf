"""`tokentrail check URL`: the contract checks on hand-made frames, a deliberately broken
server of this file's own (one violation per mode, each named in the report), and real
servers started here: `tokentrail serve` (demo model, must pass), llama.cpp's
`llama-server` (SmolLM2) and `mlx_lm.server` (demo model), plus the proxy's startup check
at ``GET /tokentrail/upstream``.

The server starters here are small local ones (the shared helpers are being moved to
`tests/helpers/`).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.helpers.env import REPO, require
from tests.helpers.llamacpp import find_smollm2, llama_server_binary
from tests.helpers.net import free_port
from tests.helpers.servers import launch

httpx = require("httpx")
require("rich")

from tokentrail.check import contract  # noqa: E402
from tokentrail.check.contract import FAIL, PASS, SKIP, WARN  # noqa: E402
from tokentrail.cli import main  # noqa: E402

DEMO = REPO / "src" / "tokentrail" / "demo_model"


def check_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    """Run `tokentrail check ... --json` in this process: (exit status, report)."""
    rc = main(["check", *args, "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out) if out.strip() else {}


def failed(report: dict[str, Any]) -> set[str]:
    return {name for name, status in report["contract"].items() if status == FAIL}


# -- the checks, on hand-made frames ------------------------------------------------------------


def chat_chunk(content: str, entries: list[tuple[str, bytes]], finish: str | None = None) -> dict:
    lps = [{"token": t, "logprob": -0.5, "bytes": list(b), "top_logprobs": []} for t, b in entries]
    return {"choices": [{"index": 0, "delta": {"content": content},
                         "logprobs": {"content": lps}, "finish_reason": finish}]}  # fmt: skip


def usage_chunk(n: int) -> dict:
    return {"choices": [], "usage": {"completion_tokens": n, "prompt_tokens": 3}}


def test_held_back_tokens_listed_late_still_join() -> None:
    lead, tail = "你".encode()[:2], "你".encode()[2:]
    s = contract.read_stream([
        chat_chunk("", []),
        chat_chunk("你", [("\ufffd", lead), ("\ufffd", tail)]),
        chat_chunk("", [("", b"")], "stop"),
        usage_chunk(3),
    ])  # fmt: skip
    found = {f.check: f.status for f in contract.check_join("p", s)}
    assert found == {"join": PASS, "special_tokens": PASS}
    assert contract.check_usage("p", [s]).status == PASS


def test_an_end_token_listed_with_its_text_is_named() -> None:
    s = contract.read_stream([chat_chunk("Hi", [("Hi", b"Hi")]),
                              chat_chunk("", [("<|im_end|>", b"<|im_end|>")], "stop")])
    found = {f.check: f for f in contract.check_join("eos", s)}
    assert found["special_tokens"].status == FAIL and "<|im_end|>" in found["special_tokens"].detail
    assert found["join"].status == PASS
    # Listed with no bytes but its name: still text it did not produce.
    s = contract.read_stream([chat_chunk("Hi", [("Hi", b"Hi"), ("<|im_end|>", b"")], "stop")])
    assert {f.check: f.status for f in contract.check_join("eos", s)}["special_tokens"] == FAIL


def test_bytes_that_do_not_join_fail_with_where() -> None:
    s = contract.read_stream([chat_chunk("Hello", [("Help", b"Help")])])
    (f,) = contract.check_join("p", s)
    assert f.status == FAIL and "byte 3" in f.detail


def test_usage_counts_an_unlisted_end_token_as_a_warning_and_folds_as_failures() -> None:
    s = contract.read_stream([chat_chunk("Hi", [("Hi", b"Hi")], "stop"), usage_chunk(2)])
    assert contract.check_usage("p", [s]).status == WARN
    s = contract.read_stream([chat_chunk("Hi", [("Hi", b"Hi")], "length"), usage_chunk(3)])
    assert contract.check_usage("p", [s]).status == FAIL


BASE = [" The", " cat", " sat", " on", " the", " warm", " mat", "."]


def baseline() -> contract.Stream:
    return contract.read_stream([chat_chunk(t, [(t, t.encode())]) for t in BASE])


def test_a_stop_string_ending_mid_token_is_planned_and_checked() -> None:
    plan = contract.plan_stop(baseline())
    assert plan is not None
    # It starts inside one token (which straddles it) and ends inside the next.
    k = plan.listed
    assert plan.stop == BASE[k - 1][-1] + BASE[k][:-1]
    assert plan.content == "".join(BASE)[: "".join(BASE).index(plan.stop)]
    straddler = BASE[k - 1]
    shown = straddler[:-1]
    good = [chat_chunk(t, [(t, t.encode())]) for t in BASE[: k - 1]]
    good.append(chat_chunk(shown, [(straddler, straddler.encode())], "stop"))
    checks = {f.check: f.status for f in contract.check_stop("stop", plan, contract.read_stream(
        [*good, usage_chunk(k + 1)]))}  # fmt: skip
    assert checks == {"join": PASS, "stop_tokens": PASS, "usage": PASS}
    # The token inside the stop string listed too: named.
    listed = [*good, chat_chunk("", [(BASE[k], BASE[k].encode())]), usage_chunk(k + 1)]
    checks = {f.check: f.status for f in contract.check_stop("stop", plan,
                                                             contract.read_stream(listed))}
    assert checks["stop_tokens"] == FAIL and checks["join"] == PASS
    # The straddler cut to the content (llama.cpp): its real bytes are lost.
    cut = [*good[:-1], chat_chunk(shown, [(shown, shown.encode())], "stop"), usage_chunk(k + 1)]
    checks = {f.check: f.status for f in contract.check_stop("stop", plan,
                                                             contract.read_stream(cut))}
    assert checks["join"] == FAIL


def test_error_shapes() -> None:
    ok = json.dumps({"error": {"message": "bad", "type": "invalid_request_error"}})
    assert contract.check_error("e", 400, ok).status == PASS
    assert contract.check_error("e", 400, json.dumps({"error": "bad"})).status == FAIL
    assert contract.check_error("e", 200, ok).status == FAIL
    assert contract.check_error("e", 500, "<html>").status == FAIL


# -- a deliberately broken server: one violation per mode -----------------------------------------

TOKENS = ["The", " café", " is", " naïve", ",", " 你好", " world", " again", "."]
END = "<|im_end|>"
MODES = ("join", "stop_tokens", "special_tokens", "usage", "stream_whole", "errors")


def generation(body: dict[str, Any], mode: str, streamed: bool) -> dict[str, Any]:
    """What the fake model says: its tokens, content, entries and usage for `body`."""
    tokens = list(TOKENS)
    if mode == "stream_whole" and not streamed:
        tokens[2] = " was"
    limit = int(body.get("max_tokens") or 100)
    text = "".join(tokens)
    stops = [s for s in body.get("stop") or [] if s in text]
    cut = min((text.index(s) for s in stops), default=None)
    out, pos, finish = [], 0, "stop"
    for k, t in enumerate(tokens):
        if k >= limit:
            finish = "length"
            break
        start, pos = pos, pos + len(t)
        if cut is not None and pos >= cut + min(len(s) for s in stops):
            out.append((t, start))
            break
        out.append((t, start))
    generated = len(out)
    ended = finish == "stop" and cut is None and generated == len(tokens)
    if cut is None:
        listed = [(t, t) for t, _ in out]
        content = "".join(t for t, _ in out)
    else:
        content = text[:cut]
        inside = mode == "stop_tokens"
        listed = [(t, text[s:cut][: len(t)]) for t, s in out if s < cut or inside]
    entries = [{"token": t, "bytes": list(t.encode()), "logprob": -0.1, "top_logprobs": []}
               for t, _ in listed]  # fmt: skip
    shown = [c for _, c in listed]
    if mode == "join" and len(entries) > 2:
        entries[1]["bytes"] = list(b" cafe")
    if ended:
        generated += 1
        if mode == "special_tokens":
            entries.append({"token": END, "bytes": list(END.encode()), "logprob": -0.1,
                            "top_logprobs": []})  # fmt: skip
            shown.append("")
        else:
            generated -= 1  # the end token is neither listed nor counted
    n = generated + (2 if mode == "usage" else 0)
    return {"content": content, "entries": entries, "shown": shown, "finish": finish,
            "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}}


class Broken(BaseHTTPRequestHandler):
    mode = "none"
    # Not "BaseHTTP/...": that is how the proxy (and the check) tell mlx_lm.server.
    server_version = "Broken/1.0"
    sys_version = ""

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, message: str) -> None:
        err: Any = {"message": message, "type": "invalid_request_error"}
        if self.mode == "errors":
            err = message
        self._send(400, json.dumps({"error": err}).encode())

    def do_GET(self) -> None:
        self._send(200, json.dumps({"data": [{"id": "fake", "owned_by": "fake"}]}).encode())

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/chat/completions":
            return self._error(f"no route {self.path}")
        if not isinstance(body.get("messages"), list):
            return self._error("'messages' must be a list")
        if int(body.get("max_tokens") or 1) < 1:
            return self._error("'max_tokens' must be at least 1")
        if body.get("tools") or body.get("response_format"):
            return self._error("not supported")
        g = generation(body, self.mode, bool(body.get("stream")))
        if not body.get("stream"):
            whole = {"choices": [{"index": 0, "message": {"role": "assistant",
                                                          "content": g["content"]},
                                  "logprobs": {"content": g["entries"]},
                                  "finish_reason": g["finish"]}], "usage": g["usage"]}  # fmt: skip
            return self._send(200, json.dumps(whole).encode())
        events = []
        for k, (e, shown) in enumerate(zip(g["entries"], g["shown"], strict=True)):
            last = k == len(g["entries"]) - 1
            events.append({"choices": [{"index": 0, "delta": {"content": shown},
                                        "logprobs": {"content": [e]},
                                        "finish_reason": g["finish"] if last else None}]})
        events.append({"choices": [], "usage": g["usage"]})
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        self._send(200, sse.encode(), "text/event-stream")


@pytest.fixture(scope="module")
def broken() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Broken)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_broken_server_in_good_mode_passes(broken: str, capsys: Any) -> None:
    Broken.mode = "none"
    rc, report = check_json(capsys, broken)
    assert rc == 0, report["findings"]
    assert failed(report) == set()
    assert report["dialect"] == "openai" and report["sources"] == ["logprob-bytes"]
    assert report["capabilities"]["bytes"]["status"] == "yes"
    assert report["capabilities"]["tool_calls"]["status"] == "no"
    assert report["contract"]["stop_tokens"] == PASS and report["stop"] == "d agai"


@pytest.mark.parametrize("mode", MODES)
def test_each_violation_is_named(broken: str, capsys: Any, mode: str) -> None:
    Broken.mode = mode
    try:
        rc, report = check_json(capsys, broken)
    finally:
        Broken.mode = "none"
    assert rc == 1
    assert failed(report) == {mode}, report["findings"]


def test_table_output_names_the_failure(broken: str, capsys: Any) -> None:
    Broken.mode = "special_tokens"
    try:
        rc = main(["check", broken, "--quick"])
    finally:
        Broken.mode = "none"
    out = capsys.readouterr().out
    assert rc == 1
    assert "special_tokens" in out and "fail" in out and "<|im_end|>" in out
    assert "BREAKS its contract" in out


def test_unreachable_url_and_bad_usage_exit_2(capsys: Any) -> None:
    assert main(["check", f"http://127.0.0.1:{free_port()}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot reach" in err
    assert main(["check", "localhost:8000"]) == 2
    assert "http(s)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["check"])
    assert e.value.code == 2


# -- real servers ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokentrail_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require("mlx_lm", "the demo model runs on MLX")
    require("uvicorn")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("logs") / "tokentrail.log"
    server = launch([sys.executable, "-m", "tokentrail", "serve", "--port", str(port)], log, url,
                    path="/v1/models")
    yield url
    server.stop()


def test_tokentrail_serve_keeps_its_contract(tokentrail_server: str, capsys: Any) -> None:
    rc, report = check_json(capsys, tokentrail_server, "--tokenizer", str(DEMO))
    assert rc == 0, [f for f in report["findings"] if f["status"] == FAIL]
    assert report["dialect"] == "tokentrail"
    caps = {k: v["status"] for k, v in report["capabilities"].items()}
    assert caps["extension"] == caps["bytes"] == caps["top_k"] == caps["n"] == "yes"
    assert caps["usage_in_stream"] == caps["seed"] == caps["stop"] == "yes"
    assert caps["prompt_logprobs"] == "yes"  # `echo` with logprobs, on MLX
    # The two things it used to break (stop-string tokens, <|im_end|> listed) pass now.
    assert report["contract"]["stop_tokens"] == report["contract"]["special_tokens"] == PASS
    assert report["contract"]["errors"] == PASS
    assert all(r["exact"] for r in report["realign"].values()), report["realign"]


def test_the_proxy_checks_its_upstream_at_startup(tokentrail_server: str) -> None:
    from starlette.testclient import TestClient

    from tokentrail.server.proxy import create_upstream_app

    app = create_upstream_app(tokentrail_server, str(DEMO))
    with TestClient(app) as client:
        deadline = time.monotonic() + 240
        while (r := client.get("/tokentrail/upstream").json())["status"] == "running":
            assert time.monotonic() < deadline
            time.sleep(0.5)
    assert r["status"] == "done", r
    assert r["quick"] and r["dialect"] == "tokentrail" and r["ok"]
    assert set(r["realign"]) >= {"multibyte", "stop", "eos"}


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary, gguf = llama_server_binary(), find_smollm2()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-c", "2048", "-np", "1", "-t", "2", "--no-webui"]  # fmt: skip
    server = launch(cmd, tmp_path_factory.mktemp("logs") / "llama.log", url, path="/v1/models")
    yield url
    server.stop()


def test_llama_server_report(llama_server: str, capsys: Any) -> None:
    rc, report = check_json(capsys, llama_server, "--quick")
    assert report["dialect"] == "llamacpp" and report["sources"] == ["llama.cpp-ids"]
    caps = {k: v["status"] for k, v in report["capabilities"].items()}
    assert caps["bytes"] == caps["top_k"] == caps["token_ids"] == "yes"
    # Its end-of-turn token is counted but not listed: said, not failed.
    assert report["contract"]["usage"] in (WARN, PASS)
    assert report["contract"]["errors"] == PASS
    # At a stop string it folds the straddling token's shown text into the entry of the
    # token inside the stop string: named, so the check fails.
    stop = {f["check"]: f for f in report["findings"] if f["probe"] == "stop"}
    if not stop or stop["join"]["status"] == SKIP:
        pytest.skip(f"the greedy output gave no usable stop string: {report['notes']}")
    assert stop["stop_tokens"]["status"] == FAIL and "inside the stop string" in (
        stop["stop_tokens"]["detail"]
    )
    assert rc == 1


@pytest.fixture(scope="module")
def mlx_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require("mlx_lm", "mlx_lm.server")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(DEMO), "--host", "127.0.0.1",
           "--port", str(port)]  # fmt: skip
    server = launch(cmd, tmp_path_factory.mktemp("logs") / "mlx.log", url, path="/v1/models")
    yield url
    server.stop()


def test_mlx_lm_server_report(mlx_server: str, capsys: Any) -> None:
    rc, report = check_json(capsys, mlx_server, "--quick")
    assert report["dialect"] == "mlx"
    assert report["capabilities"]["logprobs"]["status"] == "no"
    assert report["contract"]["join"] == SKIP
    # Its errors are {"error": "text"}, not OpenAI's shape.
    assert report["contract"]["errors"] == FAIL and rc == 1
