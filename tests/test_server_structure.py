"""Structured output over HTTP (issue 18): constraints, the logprobs distribution, JSON
fields and reasoning channels, on a real `tokentrail serve` through the `openai` client.

Oracles are independent of the code under test: `jsonschema` validates constrained
output, `json.JSONDecoder.raw_decode` parses each field at its reported offset, the
vocabulary bytes the extension lists are joined by hand, and reasoning markers are
cut out of the model's own greedy output with `str.index`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.env import require

openai = require("openai", "the official client reads the server's responses")
httpx = require("httpx")
require("llguidance", "constraints compile through llguidance")

from tests.helpers.servers import Server, pick_model_dir, start_server  # noqa: E402

MSG = [{"role": "user", "content": "Tell me about Paris."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "big": {"type": "boolean"},
        "mood": {"enum": ["calm", "busy"]},
        "rank": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["city", "big", "mood", "rank"],
    "additionalProperties": False,
}
#: The model id the servers serve (the demo's, or the tiny model's): set by `server`.
SERVED = ["tokentrail-demo"]
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "place", "schema": SCHEMA, "strict": True},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return pick_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Any) -> Iterator[Server]:
    srv = start_server(model_dir, tmp_path_factory.mktemp("logs") / "plain.log", "--max-batch", "2")
    SERVED[0] = srv.model
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _ext(obj: Any) -> dict[str, Any]:
    return obj.model_extra["tokentrail"]


def _token_bytes(segments: list[dict[str, Any]]) -> dict[int, bytes]:
    return {t["index"]: bytes(t["bytes"]) for s in segments for t in s["tokens"]}


def _check_fields(text: str, fields: list[dict[str, Any]], vocab: dict[int, bytes]) -> None:
    """Each field parses at its offset to its value and text; its tokens' byte ranges
    join to exactly its text."""
    decoder = json.JSONDecoder()
    assert fields
    for f in fields:
        value, end = decoder.raw_decode(text, f["start"])
        assert (value, end) == (f["value"], f["end"]), f
        assert text[f["start"] : end] == f["text"]
        joined = b"".join(vocab[t["index"]][t["start"] : t["end"]] for t in f["tokens"])
        assert joined == f["text"].encode("utf-8"), f


def _leaves(value: Any, path: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_leaves(v, f"{path}/{k.replace('~', '~0').replace('/', '~1')}"))
        return out
    if isinstance(value, list):
        out = {}
        for i, v in enumerate(value):
            out.update(_leaves(v, f"{path}/{i}"))
        return out
    return {path: value}


# -- constraints ---------------------------------------------------------------------------


def test_json_schema_output_validates_and_fields_join(client: Any) -> None:
    jsonschema = require("jsonschema")
    r = client.chat.completions.create(
        model=SERVED[0], messages=MSG, max_tokens=80, response_format=RESPONSE_FORMAT, logprobs=True
    )
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    parsed = json.loads(text)
    jsonschema.validate(parsed, SCHEMA)
    ext = _ext(r)
    assert ext["distribution"] == "raw"
    fields = ext["fields"]
    assert {f["path"]: f["value"] for f in fields} == _leaves(parsed)
    _check_fields(text, fields, _token_bytes(ext["segments"]))
    by_path = {f["path"]: f for f in fields}
    for path, allowed in (("/big", [True, False]), ("/mood", ["calm", "busy"])):
        alts = by_path[path]["alternatives"]
        if alts is None:  # an engine without logits in process says why
            assert by_path[path].get("reason")
            continue
        assert sorted(a["value"] for a in alts) == sorted(allowed)
        assert all(0.0 <= a["probability"] <= 1.0 for a in alts)
    # every token of constrained output reports the mass the grammar allowed, and a raw
    # logprob is at most that mass (the token is one of the allowed ones)
    for seg in ext["segments"]:
        for t in seg["tokens"]:
            mass = t["allowed_mass"]
            assert mass is not None and 0.0 < mass <= 1.0 + 1e-6
            assert t["logprob"] <= math.log(mass) + 1e-4


def test_streamed_fields_arrive_with_their_last_token(client: Any) -> None:
    whole = client.chat.completions.create(
        model=SERVED[0], messages=MSG, max_tokens=80, response_format=RESPONSE_FORMAT
    )
    stream = client.chat.completions.create(
        model=SERVED[0], messages=MSG, max_tokens=80, response_format=RESPONSE_FORMAT, stream=True
    )
    text, seen, segments = "", [], []
    for chunk in stream:
        ext = _ext(chunk)
        text += chunk.choices[0].delta.content or ""
        segments += ext["segments"]
        assert ext["distribution"] == "raw"
        for f in ext.get("fields", []):
            last = max(t["index"] for t in f["tokens"])
            assert last <= ext["token"]["index"]  # never before its last token
            seen.append(f)
    assert text == whole.choices[0].message.content
    assert seen == _ext(whole)["fields"]
    _check_fields(text, seen, _token_bytes(segments))


@pytest.mark.parametrize(
    ("field", "body"),
    [
        (
            "response_format",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "bogus"}},
                }
            },
        ),
        ("response_format", {"response_format": {"type": "yaml"}}),
        ("structured_outputs", {"structured_outputs": {"regex": "(unclosed"}}),
        ("structured_outputs", {"structured_outputs": {"choice": []}}),
        ("json_schema", {"json_schema": {"type": "object", "minProperties": "x"}}),
        ("grammar", {"grammar": "root ::= ("}),
        (
            "json_schema",
            {
                "json_schema": {"type": "object"},  # two constraints
                "structured_outputs": {"regex": "a"},
            },
        ),
    ],
)
def test_bad_constraint_is_a_400_naming_the_field(
    server: Server, field: str, body: dict[str, Any]
) -> None:
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": MSG, "max_tokens": 4, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field
    assert field in err["message"]


def test_bad_schema_through_the_openai_client(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=SERVED[0],
            messages=MSG,
            max_tokens=4,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"type": "nope"}},
            },
        )
    assert info.value.param == "response_format"
    assert "nope" in str(info.value)


def test_structured_outputs_choice_and_raw_vs_processed(client: Any) -> None:
    choices = ["yes", "no", "maybe"]
    out = {}
    for mode in ("raw", "processed"):
        r = client.chat.completions.create(
            model=SERVED[0],
            messages=MSG,
            max_tokens=8,
            logprobs=True,
            extra_body={
                "structured_outputs": {"choice": choices},
                "tokentrail": {"logprobs": mode},
            },
        )
        assert r.choices[0].message.content in choices
        assert _ext(r)["distribution"] == mode
        out[mode] = r
    raw, processed = out["raw"], out["processed"]
    assert raw.choices[0].message.content == processed.choices[0].message.content
    raw_lps = [c.logprob for c in raw.choices[0].logprobs.content]
    proc_lps = [c.logprob for c in processed.choices[0].logprobs.content]
    # the mask only removes tokens: the drawn-from distribution gives the chosen token
    # at least the probability the raw distribution gave it
    assert len(raw_lps) == len(proc_lps)
    assert all(p >= r - 1e-4 for r, p in zip(raw_lps, proc_lps, strict=True))


def test_structured_outputs_regex_and_llamacpp_fields(client: Any) -> None:
    r = client.chat.completions.create(
        model=SERVED[0],
        messages=MSG,
        max_tokens=12,
        extra_body={"structured_outputs": {"regex": "[a-d]{3}-[0-9]{2}"}},
    )
    assert re.fullmatch("[a-d]{3}-[0-9]{2}", r.choices[0].message.content)
    g = client.chat.completions.create(
        model=SERVED[0],
        messages=MSG,
        max_tokens=12,
        extra_body={"grammar": 'root ::= "up" | "down"'},
    )
    assert g.choices[0].message.content in ("up", "down")
    c = client.completions.create(
        model=SERVED[0],
        prompt="Paris is",
        max_tokens=40,
        extra_body={
            "json_schema": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": False,
            }
        },
    )
    assert isinstance(json.loads(c.choices[0].text)["ok"], bool)
    assert [f["path"] for f in _ext(c)["fields"]] == ["/ok"]


def test_unconstrained_reply_has_no_mass_and_fields_on_request(client: Any) -> None:
    r = client.chat.completions.create(model=SERVED[0], messages=MSG, max_tokens=12)
    ext = _ext(r)
    assert ext["distribution"] == "raw" and "fields" not in ext
    assert all("allowed_mass" not in t for s in ext["segments"] for t in s["tokens"])
    f = client.chat.completions.create(
        model=SERVED[0], messages=MSG, max_tokens=12, extra_body={"tokentrail": {"fields": True}}
    )
    text = f.choices[0].message.content
    try:
        json.loads(text)
    except json.JSONDecodeError:
        assert _ext(f)["fields"] == [] and _ext(f)["fields_error"]
    else:
        assert _ext(f)["fields"]


# -- reasoning -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy(client: Any) -> str:
    r = client.chat.completions.create(model=SERVED[0], messages=MSG, max_tokens=24)
    text = r.choices[0].message.content
    if len(text) < 12:
        pytest.skip(f"the model's greedy reply is too short to split: {text!r}")
    return text


def _end_marker(text: str) -> tuple[int, str]:
    """A marker from the middle of `text` whose first occurrence is there."""
    for at in range(len(text) // 3, len(text) - 3):
        marker = text[at : at + 3]
        if marker.strip() and text.index(marker) == at:
            return at, marker
    pytest.skip(f"no marker in {text!r}")


@pytest.fixture(scope="module")
def reasoning_server(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Any, greedy: str
) -> Iterator[tuple[Server, str, str, str]]:
    at, end = _end_marker(greedy)
    srv = start_server(
        model_dir,
        tmp_path_factory.mktemp("logs") / "reasoning.log",
        "--reasoning-markers",
        "",
        end,
    )
    yield srv, greedy[:at], end, greedy[at + len(end) :]
    srv.stop()


def _channel_bytes(segments: list[dict[str, Any]], channel: str) -> bytes:
    return b"".join(
        bytes(t["bytes"])[t["start"] : t["end"]]
        for s in segments
        if s["channel"] == channel
        for t in s["tokens"]
    )


def test_reasoning_streams_in_both_fields(reasoning_server: Any) -> None:
    srv, reasoning, _, content = reasoning_server
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    got = {"reasoning": "", "reasoning_content": "", "content": ""}
    segments: list[dict[str, Any]] = []
    for chunk in c.chat.completions.create(
        model=SERVED[0], messages=MSG, max_tokens=24, stream=True
    ):
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        assert extra.get("reasoning") == extra.get("reasoning_content")
        got["reasoning"] += extra.get("reasoning") or ""
        got["reasoning_content"] += extra.get("reasoning_content") or ""
        got["content"] += delta.content or ""
        segments += _ext(chunk)["segments"]
    assert got == {"reasoning": reasoning, "reasoning_content": reasoning, "content": content}
    assert _channel_bytes(segments, "reasoning") == reasoning.encode()
    assert _channel_bytes(segments, "content") == content.encode()
    assert {s["channel"] for s in segments} <= {"reasoning", "content", "markup"}


def test_reasoning_in_the_message(reasoning_server: Any) -> None:
    srv, reasoning, end, content = reasoning_server
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = c.chat.completions.create(model=SERVED[0], messages=MSG, max_tokens=24)
    msg = r.choices[0].message
    assert msg.content == content
    assert msg.model_extra["reasoning_content"] == msg.model_extra["reasoning"] == reasoning
    segs = _ext(r)["segments"]
    assert _channel_bytes(segs, "markup") == end.encode()
    assert set(_ext(r)["channel_confidence"]) >= {"reasoning", "content"}
    off = c.chat.completions.create(
        model=SERVED[0],
        messages=MSG,
        max_tokens=24,
        extra_body={"tokentrail": {"reasoning": False}},
    )
    assert off.choices[0].message.content == reasoning + end + content
    # llama-server's own switch, as its users send it: the same reply
    none = c.chat.completions.create(
        model=SERVED[0], messages=MSG, max_tokens=24, extra_body={"reasoning_format": "none"}
    )
    assert none.choices[0].message.content == reasoning + end + content
    assert "reasoning_content" not in (none.choices[0].message.model_extra or {})


def test_reasoning_in_a_response(reasoning_server: Any) -> None:
    """/v1/responses (`server.responses`): the reasoning is a ``reasoning`` item before
    the message, whole and streamed, the markup in neither."""
    srv, reasoning, _end, content = reasoning_server
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = c.responses.create(model=SERVED[0], input=MSG, max_output_tokens=24)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == reasoning and r.output_text == content
    events = list(c.responses.create(model=SERVED[0], input=MSG, max_output_tokens=24,
                                     stream=True))  # fmt: skip
    said = {t: "".join(e.delta for e in events if e.type == t)
            for t in ("response.reasoning_text.delta", "response.output_text.delta")}  # fmt: skip
    assert said == {"response.reasoning_text.delta": reasoning,
                    "response.output_text.delta": content}  # fmt: skip
    assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]


def test_constraint_after_the_servers_reasoning_format(reasoning_server: Any) -> None:
    """`--reasoning-markers '' END` on the server and `response_format` in the request: the
    reasoning is the model's own greedy text up to END (no mask while it reasons), and
    the content after END validates against the schema."""
    jsonschema = require("jsonschema")
    srv, reasoning, _end, _ = reasoning_server
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"messages": MSG, "max_tokens": 120, "response_format": RESPONSE_FORMAT},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] == reasoning
    assert message.get("reasoning") == reasoning
    jsonschema.validate(json.loads(message["content"]), SCHEMA)


def _lp_bytes(entries: list[Any]) -> bytes:
    return b"".join(bytes(e["bytes"] if isinstance(e, dict) else e.bytes) for e in entries)


def test_constraint_after_per_request_reasoning(client: Any) -> None:
    """`response_format` with `"tokentrail": {"reasoning": ["", END]}`: END is two tokens
    of the model's own greedy reply (read from its logprobs), so the reasoning is that
    reply's text before END and the content after it validates. `logprobs.content`
    lists exactly the content's tokens, `logprobs.reasoning_content` the reasoning's."""
    jsonschema = require("jsonschema")
    free = client.chat.completions.create(
        model=SERVED[0], messages=MSG, max_tokens=16, logprobs=True
    )
    toks = [bytes(t.bytes).decode("utf-8", "replace") for t in free.choices[0].logprobs.content]
    text = "".join(toks)
    for i in range(1, len(toks) - 2):
        end = toks[i] + toks[i + 1]
        if end.strip() and text.index(end) == len("".join(toks[:i])):
            break
    else:
        pytest.skip(f"no early marker in {text!r}")
    body = {"tokentrail": {"reasoning": ["", end]}}
    r = client.chat.completions.create(
        model=SERVED[0],
        messages=MSG,
        max_tokens=80,
        logprobs=True,
        response_format=RESPONSE_FORMAT,
        extra_body=body,
    )
    msg, lp = r.choices[0].message, r.choices[0].logprobs
    reasoning = text[: text.index(end)]
    assert msg.model_extra["reasoning_content"] == reasoning
    jsonschema.validate(json.loads(msg.content), SCHEMA)
    assert _lp_bytes(lp.content) == msg.content.encode()
    assert _lp_bytes(lp.model_extra["reasoning_content"]) == reasoning.encode()
    segs = _ext(r)["segments"]
    assert all(t.get("allowed_mass") is None for s in segs if s["channel"] != "content"
               for t in s["tokens"])  # fmt: skip
    # streamed: the same reply, each chunk's logprobs with its own channel's tokens
    got: dict[str, Any] = {"content": "", "lp": [], "rlp": []}
    for chunk in client.chat.completions.create(
        model=SERVED[0],
        messages=MSG,
        max_tokens=80,
        logprobs=True,
        stream=True,
        response_format=RESPONSE_FORMAT,
        extra_body=body,
    ):
        choice = chunk.choices[0]
        got["content"] += choice.delta.content or ""
        if choice.logprobs is not None:
            got["lp"] += choice.logprobs.content or []
            got["rlp"] += (choice.logprobs.model_extra or {}).get("reasoning_content") or []
    assert got["content"] == msg.content
    assert _lp_bytes(got["lp"]) == msg.content.encode()
    assert _lp_bytes(got["rlp"]) == reasoning.encode()


def test_per_request_markers(client: Any, greedy: str) -> None:
    """`tokentrail.reasoning` as [START, END] on a server without a reasoning format."""
    start = greedy[:2]
    at, end = _end_marker(greedy)
    r = client.chat.completions.create(
        model=SERVED[0],
        messages=MSG,
        max_tokens=24,
        extra_body={"tokentrail": {"reasoning": [start, end]}},
    )
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == greedy[len(start) : at]
    assert msg.content == greedy[at + len(end) :]


# -- tool calls --------------------------------------------------------------------------------

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_named_tool_call_whole_and_streamed(client: Any) -> None:
    jsonschema = require("jsonschema")
    r = client.chat.completions.create(
        model=SERVED[0], messages=MSG, max_tokens=60, tools=TOOLS, tool_choice=NAMED,
        logprobs=True,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    # the call's tokens are not content: logprobs.content lists none with text
    assert choice.message.content is None
    assert _lp_bytes(choice.logprobs.content) == b""
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.type == "function"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER)
    ext = _ext(r)
    raw = "".join(s["text"] for s in ext["segments"])  # the reply as generated
    paths = {f["path"]: f["value"] for f in ext["fields"]}
    expected = {"/tool_calls/0/function/name": "get_weather"}
    expected.update({f"/tool_calls/0/arguments{k}": v for k, v in _leaves(args).items()})
    assert paths == expected
    _check_fields(raw, ext["fields"], _token_bytes(ext["segments"]))

    pieces: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(
        model=SERVED[0], messages=MSG, max_tokens=60, tools=TOOLS, tool_choice=NAMED, stream=True
    ):
        delta = chunk.choices[0].delta
        assert not delta.content
        for piece in delta.tool_calls or ():
            got = pieces.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            got["id"] += piece.id or ""
            got["name"] += piece.function.name or ""
            got["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert pieces == {
        0: {"id": call.id, "name": "get_weather", "arguments": call.function.arguments}
    }


def test_stream_generate_gives_the_servers_tool_calls(client: Any, model_dir: Any) -> None:
    """The library's tool calls (issue 28) are the server's: the same call, the same
    fields with the same tokens, and its streamed pieces join to the call."""
    from tokentrail import load, stream_generate
    from tokentrail.output.processor import merged_tool_deltas

    model, tok = load(model_dir)
    got = list(
        stream_generate(model, tok, MSG, max_tokens=60, tools=TOOLS, tool_choice=NAMED)
    )
    r = client.chat.completions.create(
        model=SERVED[0], messages=MSG, max_tokens=60, tools=TOOLS, tool_choice=NAMED,
        logprobs=True,
    )
    (call,) = r.choices[0].message.tool_calls
    lib_calls = got[-1].all_tool_calls
    assert [c.to_dict()["function"] for c in lib_calls] == [
        {"name": call.function.name, "arguments": call.function.arguments}
    ]
    pieces = merged_tool_deltas([p for g in got for p in g.tool_calls or ()])
    assert [p["function"] for p in pieces] == [c.to_dict()["function"] for c in lib_calls]
    assert "".join(g.content_text for g in got) == ""
    lib_fields = [
        (f.path, f.value, [t.id for t in f.tokens]) for c in lib_calls for f in c.fields
    ]
    http_fields = [
        (f["path"], f["value"], [t["id"] for t in f["tokens"]]) for f in _ext(r)["fields"]
    ]
    assert lib_fields == http_fields and lib_fields
    # the token ids behind the reply are the same on both sides
    http_ids = [t["id"] for s in _ext(r)["segments"] for t in s["tokens"]]
    lib_ids = [t.id for g in got for t in g.last_segment_tokens]
    assert lib_ids == http_ids
    # batch_generate: each completion has the same call, content None (only a call)
    from tokentrail import batch_generate

    out = batch_generate(model, tok, [MSG, MSG], 60, tools=TOOLS, tool_choice=NAMED)
    for c in out.completions:
        assert [t.to_dict()["function"] for t in c.tool_calls] == [
            x.to_dict()["function"] for x in lib_calls
        ]
        assert [f.path for t in c.tool_calls for f in t.fields] == [f[0] for f in lib_fields]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "zz"}}},
            "tool_choice",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        # the demo's template names no tool-call format and the server has no parser
        ({"tools": TOOLS, "tool_choice": "auto"}, "tools"),
    ],
)
def test_bad_tool_requests_name_the_field(server: Server, body: dict[str, Any], param: str) -> None:
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": MSG, "max_tokens": 4, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tool_history_and_choice_none(client: Any) -> None:
    history = [
        *MSG,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "c"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "21 C"},
    ]
    r = client.chat.completions.create(
        model=SERVED[0], messages=history, max_tokens=8, tools=TOOLS, tool_choice="none"
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.tool_calls is None
    assert isinstance(r.choices[0].message.content, str)
