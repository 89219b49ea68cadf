"""What stands between the network and the model: access, limits, bad input, startup.

A real `tokentrail serve --api-key ... --port 0` (the demo model) on loopback, probed with
the official `openai` client, httpx and raw sockets: the API key, the Host check, the
content type, the fuzzing cases (huge integers, lone surrogates, context overflows,
hang-ups mid-body), idle-socket timeouts and the serve command's own errors.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.env import require
from tests.helpers.servers import spawn, start_server

openai = require("openai")
require("mlx_lm")
require("uvicorn")

REPO = Path(__file__).resolve().parents[1]
KEY = "sk-test-4f1c"
READ_TIMEOUT = 1.0
#: Longer than READ_TIMEOUT: an idle keep-alive outlives the read clock.
KEEP_ALIVE = 4.0
MAX_CONNECTIONS = 32
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "Hi"}]


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    url: str
    port: int
    log: Path

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {KEY}"}

    def post(self, path: str, body: Any, **kw: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=self.auth(), timeout=60, **kw)


def _serve(log: Path, *args: str) -> subprocess.Popen[bytes]:
    return spawn([sys.executable, "-m", "tokentrail.server", *args], log)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    log = tmp_path_factory.mktemp("logs") / "hardening.log"
    server = start_server(
        None, log, "--allowed-host", "tokentrail.test",
        "--read-timeout", str(READ_TIMEOUT), "--keep-alive-timeout", str(KEEP_ALIVE),
        "--max-connections", str(MAX_CONNECTIONS), port=0, log_level="info", api_key=KEY,
    )
    assert server.port != 0  # --port 0: the real port is logged
    srv = Served(server.proc, server.url, server.port, log)
    assert httpx.get(srv.url + "/health", timeout=30).status_code == 200  # listening
    yield srv
    server.stop()


# -- access ---------------------------------------------------------------------------------


def test_api_key_guards_the_api(served: Served) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(served.url + "/v1/models", headers=headers, timeout=30)
        assert r.status_code == 401, headers
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
        assert "Authorization: Bearer" in err["message"]
    r = httpx.post(served.url + COMP, json={"prompt": "x"}, timeout=30)
    assert r.status_code == 401
    assert httpx.get(served.url + "/metrics", timeout=30).status_code == 401
    assert httpx.get(served.url + "/metrics", headers=served.auth(), timeout=30).status_code == 200
    # the tokenizer endpoints (`server.tokenize`) too
    assert httpx.get(served.url + "/tokenizer_info", timeout=30).status_code == 401
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert httpx.post(served.url + path, json=body, timeout=30).status_code == 401
        ok = httpx.post(served.url + path, json=body, headers=served.auth(), timeout=30)
        assert ok.status_code == 200, ok.text
    for open_path in ("/", "/health", "/favicon.ico", "/static/page.js"):
        assert httpx.get(served.url + open_path, timeout=30).status_code == 200, open_path
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(model="tokentrail-demo", prompt="A", max_tokens=2)
    assert out.usage.completion_tokens == 2


def test_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokentrail.cli import build_parser

    monkeypatch.setenv("TOKENTRAIL_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("TOKENTRAIL_API_KEY")
    assert build_parser().parse_args(["serve"]).api_key is None


def test_page_asks_for_the_key() -> None:
    js = (REPO / "src/tokentrail/static/page.js").read_text(encoding="utf-8")
    assert "r.status === 401" in js and "Authorization" in js


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("evil.example", 421),
        ("evil.example:8080", 421),
        ("localhost", 200),
        ("127.0.0.1:1234", 200),
        ("[::1]:80", 200),
        ("tokentrail.test", 200),  # --allowed-host
        ("TOKENTRAIL.test.", 200),
    ],
)
def test_host_header_must_name_this_server(served: Served, host: str, status: int) -> None:
    r = httpx.get(
        served.url + "/v1/models", headers={**served.auth(), "Host": host}, timeout=30
    )
    assert r.status_code == status, r.text
    if status == 421:
        assert r.json()["error"]["code"] == "misdirected_request"


@pytest.mark.parametrize(
    ("ctype", "status"),
    [
        (None, 415),
        ("text/plain", 415),
        ("application/x-www-form-urlencoded", 415),
        ("multipart/form-data; boundary=x", 415),
        ("application/json", 200),
        ("Application/JSON; charset=utf-8", 200),
    ],
)
def test_post_bodies_must_be_json(served: Served, ctype: str | None, status: int) -> None:
    headers = served.auth()
    if ctype is not None:
        headers["Content-Type"] = ctype
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    r = httpx.post(served.url + COMP, content=body, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    if status == 415:
        assert r.json()["error"]["code"] == "unsupported_media_type"


# -- bad input found by fuzzing ---------------------------------------------------------------

HUGE = "9" * 5000


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        (COMP, '{"prompt": "x", "max_tokens": HUGE}', "max_tokens"),
        (COMP, '{"prompt": "x", "seed": -HUGE}', "seed"),
        (COMP, '{"prompt": [1, 2, HUGE]}', "prompt"),
        (COMP, '{"prompt": "x", "logit_bias": {"5": HUGE}}', "logit_bias"),
        (CHAT, '{"messages": [{"role": "user", "content": "x"}], "extra": {"a": [HUGE]}}', "extra"),
    ],
)
def test_huge_integers_anywhere_are_400_naming_the_field(
    served: Served, path: str, raw: str, param: str
) -> None:
    r = httpx.post(
        served.url + path, content=raw.replace("HUGE", HUGE).encode(),
        headers={**served.auth(), "Content-Type": "application/json"}, timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert "5000 digits" in err["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMP, {"prompt": "a\ud800b"}, "prompt"),
        (CHAT, {"messages": [{"role": "user", "content": "\udfff"}]}, "messages"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
         "messages"),
        (COMP, {"prompt": "x", "stop": ["ok", "\udc00"]}, "stop"),
    ],
)
def test_lone_surrogates_are_400_with_a_code(
    served: Served, path: str, body: dict[str, Any], param: str
) -> None:
    raw = json.dumps(body)  # json escapes lone surrogates as \\udXXX, as a client would
    r = httpx.post(served.url + path, content=raw.encode(),
                   headers={**served.auth(), "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, "invalid_unicode")


def test_context_overflows_are_400_as_in_vllm(served: Served) -> None:
    card = httpx.get(served.url + "/v1/models/tokentrail-demo", headers=served.auth()).json()
    ctx = card["max_model_len"]
    long_ids = [65] * (ctx + 5)
    r = served.post(COMP, {"prompt": long_ids, "max_tokens": 1})
    assert r.status_code == 400
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (
        "prompt", "context_length_exceeded"
    )
    r = served.post(CHAT, {"messages": [{"role": "user", "content": "word " * ctx}]})
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (
        "messages", "context_length_exceeded"
    )
    r = served.post(COMP, {"prompt": [65, 66], "max_tokens": ctx})
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")
    assert str(ctx - 2) in err["message"]
    # At the limit it is served; left out, max_tokens is cut to the room that is left.
    ok = served.post(COMP, {"prompt": [65] * (ctx - 3), "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 3
    # vLLM's edge cases (vllm-project/vllm tests/v1/e2e/test_context_length.py): a prompt
    # one token short of the context may ask for one token; a full-context prompt may not.
    assert served.post(COMP, {"prompt": [43] * (ctx - 1), "max_tokens": 1}).status_code == 200
    full = served.post(COMP, {"prompt": [43] * ctx, "max_tokens": 1})
    assert (full.status_code, full.json()["error"]["code"]) == (400, "context_length_exceeded")
    cut = served.post(COMP, {"prompt": [65] * (ctx - 2), "logit_bias": {"0": -100, "2": -100}})
    assert cut.status_code == 200 and cut.json()["usage"]["completion_tokens"] == 2


def test_model_by_id(served: Served) -> None:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)
    model = client.models.retrieve("tokentrail-demo")
    assert model.id == "tokentrail-demo" and model.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.body["code"] == "model_not_found"


def test_favicon(served: Served) -> None:
    r = httpx.get(served.url + "/favicon.ico", timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"] == "image/x-icon"
    assert r.content[:4] == b"\x00\x00\x01\x00"  # an ICO file


def _raw(served: Served) -> socket.socket:
    return socket.create_connection(("127.0.0.1", served.port), timeout=30)


def test_hang_up_mid_body_logs_one_info_line(served: Served) -> None:
    mark = len(served.log.read_text())
    sock = _raw(served)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {KEY}\r\nContent-Length: 1000\r\n\r\n".encode()
        + b'{"prompt": "'
    )
    time.sleep(0.3)
    sock.close()
    deadline = time.monotonic() + 30
    while "hung up" not in served.log.read_text()[mark:]:
        assert time.monotonic() < deadline, served.log.read_text()[mark:]
        time.sleep(0.1)
    time.sleep(0.3)
    tail = served.log.read_text()[mark:]
    assert "Traceback" not in tail and "ERROR" not in tail, tail
    assert len([line for line in tail.splitlines() if "hung up" in line]) == 1
    assert " INFO " in next(line for line in tail.splitlines() if "hung up" in line)


# -- sockets that do nothing --------------------------------------------------------------------


def _closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closes `sock` (reading and dropping what it sends)."""
    t0 = time.monotonic()
    sock.settimeout(seconds)
    while sock.recv(65536):
        pass
    return time.monotonic() - t0


@pytest.mark.parametrize(
    "sent",
    [
        b"",  # connects, sends nothing
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n",  # slowloris: headers unfinished
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 50\r\n\r\n{",
    ],
)
def test_idle_and_slow_sockets_are_closed(served: Served, sent: bytes) -> None:
    socks = [_raw(served) for _ in range(20)]
    for s in socks:
        s.sendall(sent)
    try:
        for s in socks:
            assert _closed_within(s, READ_TIMEOUT + 10) <= READ_TIMEOUT + 10
    finally:
        for s in socks:
            s.close()
    assert httpx.get(served.url + "/health", timeout=30).status_code == 200


def test_connection_limit_and_idle_sockets_cannot_pile_up(served: Served) -> None:
    socks = [_raw(served) for _ in range(MAX_CONNECTIONS + 8)]
    try:
        # Over --max-connections, a request is turned away at once (uvicorn's 503) ...
        assert httpx.get(served.url + "/health", timeout=30).status_code == 503
        # ... until the idle ones are closed for sending no request in --read-timeout.
        for s in socks:
            _closed_within(s, READ_TIMEOUT + 10)
    finally:
        for s in socks:
            s.close()
    assert httpx.get(served.url + "/health", timeout=30).status_code == 200


def test_idle_keep_alive_is_closed(served: Served) -> None:
    sock = _raw(served)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    t = _closed_within(sock, KEEP_ALIVE + 10)
    sock.close()
    assert t <= KEEP_ALIVE + 10


HEALTH = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"


def _one_response(sock: socket.socket) -> bytes:
    """One whole HTTP response read from `sock` (its head and its Content-Length body)."""
    got = b""
    while b"\r\n\r\n" not in got:
        more = sock.recv(65536)
        assert more, f"closed before a whole response: {got!r}"
        got += more
    head, _, body = got.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        more = sock.recv(65536)
        assert more, "closed mid-body"
        body += more
    return head


def test_a_keep_alive_idle_past_the_read_timeout_serves_its_next_request(served: Served) -> None:
    """--read-timeout times a request until it has arrived, not the connection: a client
    idle between requests for longer than it (but under --keep-alive-timeout) sends its
    next request on the same connection and is answered. (The clock once ran from the
    connection to the first expiry, and closed an idle keep-alive at that moment: a
    client whose next request crossed that close got no response.)"""
    sock = _raw(served)
    try:
        sock.sendall(HEALTH)
        assert _one_response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(READ_TIMEOUT + 1.0)  # < KEEP_ALIVE
        sock.sendall(HEALTH)
        assert _one_response(sock).startswith(b"HTTP/1.1 200")
    finally:
        sock.close()


def test_a_request_begun_on_a_kept_alive_connection_is_timed(served: Served) -> None:
    """The first bytes of a later request start the clock again: headers left unfinished
    after a served request are closed by --read-timeout (uvicorn drops its keep-alive
    timer once bytes arrive, so nothing else would close it)."""
    mark = len(served.log.read_text())
    sock = _raw(served)
    try:
        sock.sendall(HEALTH)
        assert _one_response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: loc")
        assert _closed_within(sock, READ_TIMEOUT + 10) <= READ_TIMEOUT + 10
    finally:
        sock.close()
    assert "sent no whole request in 1 s (--read-timeout)" in served.log.read_text()[mark:]


# -- the serve command's own errors ----------------------------------------------------------------


def _serve_fails(tmp_path: Path, *args: str) -> tuple[int, str]:
    log = tmp_path / "serve.log"
    proc = _serve(log, *args)
    assert proc.wait(timeout=120) is not None
    return proc.returncode, log.read_text()


def test_bad_port_exits_2_with_one_line(tmp_path: Path) -> None:
    code, out = _serve_fails(tmp_path, "--port", "99999")
    assert code == 2
    assert out.count("\n") == 1 and "99999" in out and "Traceback" not in out


def test_port_in_use_exits_2_and_never_claims_to_serve(tmp_path: Path, served: Served) -> None:
    code, out = _serve_fails(tmp_path, "--port", str(served.port), "--log-level", "info")
    assert code == 2, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and str(served.port) in lines[0], out
    assert "serving" not in out and "Traceback" not in out


def test_requests_without_temperature_use_serve_temp(served: Served) -> None:
    """`serve --temp` (default 0.0, as mlx_lm.server) applies when a request sets none."""
    from tokentrail.cli import build_parser
    from tokentrail.server import parse_completion

    assert build_parser().parse_args(["serve"]).temp == 0.0
    assert parse_completion({"prompt": "x"}, "m", 10, temperature=0.6).temperature == 0.6
    assert parse_completion({"prompt": "x", "temperature": 1}, "m", 10, 0.6).temperature == 1
    body = {"prompt": "Iterators", "max_tokens": 16, "logit_bias": {"0": -100, "2": -100}}
    default = served.post(COMP, body).json()["choices"][0]["text"]
    greedy = served.post(COMP, {**body, "temperature": 0}).json()["choices"][0]["text"]
    assert default == greedy
    code, out = _serve_fails(Path(served.log.parent), "--temp", "3", "--port", "0")
    assert code == 2 and "--temp" in out and out.count("\n") == 1


# -- fuzzing: no body makes the server fail -------------------------------------------------------

_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**80), max_value=10**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(["\ud800", "a\udfffb", "", "🙂", "<|im_end|>"]),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "wizard"]),
         "content": st.one_of(st.text(max_size=12), _JSON)}
    ),
    max_size=3,
)
_FIELDS = {
    "model": st.one_of(st.just("tokentrail-demo"), _JSON),
    "n": st.one_of(st.integers(0, 4), _JSON),
    "stream": st.one_of(st.booleans(), _JSON),
    "stream_options": st.one_of(st.just({"include_usage": True}), _JSON),
    "temperature": st.one_of(st.floats(0, 2), _JSON),
    "top_p": _JSON,
    "seed": st.one_of(st.integers(0, 2**64), _JSON),
    "stop": st.one_of(st.lists(st.text(max_size=3), max_size=3), _JSON),
    "logit_bias": st.one_of(st.dictionaries(st.integers(-5, 4000).map(str), st.floats(-200, 200),
                                            max_size=3), _JSON),
    "logprobs": _JSON,
    "top_logprobs": st.one_of(st.integers(-1, 25), _JSON),
}


@st.composite
def _bodies(draw: Any) -> tuple[str, dict[str, Any]]:
    path = draw(st.sampled_from([CHAT, COMP]))
    body: dict[str, Any] = {"max_tokens": draw(st.one_of(st.integers(1, 3), _JSON))}
    if path == CHAT:
        body["messages"] = draw(st.one_of(_MESSAGES, _JSON))
    else:
        body["prompt"] = draw(st.one_of(st.text(max_size=12), st.lists(st.integers(-2, 4000),
                                                                     max_size=4), _JSON))
    for name in draw(st.sets(st.sampled_from(sorted(_FIELDS)), max_size=5)):
        body[name] = draw(_FIELDS[name])
    return path, body


@settings(
    max_examples=int(os.environ.get("TOKENTRAIL_FUZZ_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(case=_bodies())
def test_no_body_makes_the_server_fail(served: Served, case: tuple[str, dict[str, Any]]) -> None:
    """Whatever the body, the answer is a 2xx or an OpenAI-shaped 4xx naming a field the
    body has (or a required one it lacks), never a 500 or a dropped connection."""
    path, body = case
    raw = json.dumps(body).encode()
    r = httpx.post(served.url + path, content=raw, timeout=120,
                   headers={**served.auth(), "Content-Type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:300], body)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["param"] is None or err["param"] in body or err["param"] in (
            "messages", "prompt"), (err, body)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n") or '"error"' in r.text
    else:
        assert r.json()["choices"]
