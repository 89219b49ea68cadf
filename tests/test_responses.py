"""OpenAI's Responses API (`tokentrail.server.responses`) through the official `openai`
client's `client.responses` on a real `tokentrail serve` (the demo model).

Oracles: the same request as a chat completion on the same server (greedy decoding is
deterministic, and a Responses request means that chat request: the text, usage and
logprobs must be the chat answer's), the tokenizer's own library (`tokenizers` decodes
the ids the stream's extension lists into the streamed text), `jsonschema` for
structured output, and the API's own event grammar (types in order, sequence numbers).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.env import require

openai = require("openai")
require("uvicorn")

from tests.helpers.servers import Server, start_server  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "src" / "tokentrail" / "demo_model"
ASK = "What is a list?"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "enum": ["Ann", "Bob"]}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function", "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                   "required": ["city"], "additionalProperties": False},
}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(None, tmp_path_factory.mktemp("logs") / "responses.log")
    yield srv
    srv.stop()


def _chat(server: Server, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return server.client().chat.completions.create(
        model=server.model, messages=messages, temperature=0, **{"max_tokens": 16, **extra}
    )


def _respond(server: Server, **extra: Any) -> Any:
    return server.client().responses.create(
        model=server.model, temperature=0, **{"input": ASK, "max_output_tokens": 16, **extra}
    )


def test_a_response_is_the_chat_answer_it_means(server: Server) -> None:
    got = _respond(server, include=["message.output_text.logprobs"], top_logprobs=3)
    chat = _chat(server, [{"role": "user", "content": ASK}], logprobs=True, top_logprobs=3)
    assert got.object == "response" and got.id.startswith("resp_")
    assert got.output_text == chat.choices[0].message.content
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
    u = got.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    rows = got.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert [(r.token, r.logprob) for r in rows] == [(w.token, w.logprob) for w in want]
    assert [[a.token for a in r.top_logprobs] for r in rows] == [
        [a.token for a in w.top_logprobs] for w in want]  # fmt: skip
    assert all(len(r.top_logprobs) == 3 for r in rows)
    assert _respond(server).output[0].content[0].logprobs == []  # not asked: none
    assert got.model_extra["tokentrail"]["segments"]


def test_instructions_and_message_items_are_the_chat_messages(server: Server) -> None:
    sys_msg = "Answer in one word."
    chat = _chat(server, [{"role": "system", "content": sys_msg},
                          {"role": "user", "content": ASK}])  # fmt: skip
    assert _respond(server, instructions=sys_msg).output_text == chat.choices[0].message.content
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": sys_msg}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]},
    ]
    assert _respond(server, input=items).output_text == chat.choices[0].message.content


def test_the_stream_follows_the_apis_events_and_carries_each_token(server: Server) -> None:
    from tokenizers import Tokenizer

    whole = _respond(server)
    events = list(_respond(server, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text == events[-4].text
    assert events[-1].response.output_text == text
    assert events[-1].response.usage.output_tokens == len(deltas) == 16
    ids = [e.model_extra["tokentrail"]["token"]["id"] for e in deltas]
    tok = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    assert tok.decode(ids) == text


def test_a_reply_that_ends_itself_completes(server: Server) -> None:
    plain = _respond(server).output_text
    cut = plain.index(" ", 3)
    stop = plain[cut:cut + 3]
    got = _respond(server, extra_body={"stop": [stop]})
    assert got.status == "completed" and got.incomplete_details is None
    assert got.output_text == plain[:cut]
    with server.client().responses.stream(model=server.model, input=ASK, temperature=0,
                                          max_output_tokens=16,
                                          extra_body={"stop": [stop]}) as stream:  # fmt: skip
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == plain[:cut]


def test_text_format_json_schema_is_the_grammar_constraint(server: Server) -> None:
    jsonschema = require("jsonschema")
    fmt = {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}
    got = _respond(server, text={"format": fmt}, max_output_tokens=120)
    jsonschema.validate(json.loads(got.output_text), SCHEMA)
    chat = _chat(server, [{"role": "user", "content": ASK}], max_tokens=120,
                 response_format={"type": "json_schema", "json_schema": {
                     "name": "person", "schema": SCHEMA, "strict": True}})  # fmt: skip
    assert got.output_text == chat.choices[0].message.content


def test_the_clients_parse_helper_gets_its_model(server: Server) -> None:
    """`client.responses.parse(text_format=Model)`: the client sends the model's strict
    schema and parses the reply into it."""
    from enum import StrEnum

    from pydantic import BaseModel

    class Name(StrEnum):
        ann = "Ann"
        bob = "Bob"

    class Person(BaseModel):
        name: Name
        ok: bool

    got = server.client().responses.parse(model=server.model, input=ASK, temperature=0,
                                          max_output_tokens=120, text_format=Person)  # fmt: skip
    assert isinstance(got.output_parsed, Person)
    assert got.output_parsed == Person.model_validate_json(got.output_text)


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_is_a_function_call_item(server: Server, stream: bool) -> None:
    jsonschema = require("jsonschema")
    got = _respond(server, tools=[WEATHER], tool_choice="required", max_output_tokens=80,
                   stream=stream)  # fmt: skip
    if stream:
        events = list(got)
        assert "response.function_call_arguments.done" in [e.type for e in events]
        got = events[-1].response
    calls = [o for o in got.output if o.type == "function_call"]
    assert len(calls) >= 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])


def test_a_tools_output_sent_back_is_the_chat_tool_turn(server: Server) -> None:
    """An agent's second turn: the first response's items (its function call) and the
    tool's output sent back in `input` mean the chat messages with the assistant's
    tool call and the tool's message; the answer is that chat request's."""
    first = _respond(server, tools=[WEATHER], tool_choice="required", max_output_tokens=80)
    call = next(o for o in first.output if o.type == "function_call")
    items = [{"role": "user", "content": ASK}, *[o.model_dump() for o in first.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."}]
    second = _respond(server, input=items, tools=[WEATHER], tool_choice="none")
    chat = _chat(server, [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id,
         "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny."},
    ], tools=[{"type": "function", "function": {k: WEATHER[k] for k in
                                                ("name", "description", "parameters")}}],
       tool_choice="none")
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens


REFUSED = [
    ("previous_response_id", {"previous_response_id": "resp_123"}),
    ("conversation", {"conversation": "conv_1"}),
    ("background", {"background": True}),
    ("reasoning", {"reasoning": {"effort": "high"}}),
    ("truncation", {"truncation": "auto"}),
    ("input[0]", {"input": [{"type": "input_file", "file_id": "f"}]}),
    ("input[0].call_id", {"input": [{"type": "function_call_output", "output": "x"}]}),
    ("input[0].content[0]", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://example.com/a.png"}]}]}),
    ("tools[0]", {"tools": [{"type": "web_search"}]}),
    ("input", {"input": []}),
    ("n", {"n": 2}),
]


@pytest.mark.parametrize(("param", "body"), REFUSED, ids=[p for p, _ in REFUSED])
def test_what_is_not_served_is_refused_by_name(
    server: Server, param: str, body: dict[str, Any]
) -> None:
    r = httpx.post(server.url + "/v1/responses",
                   json={"model": server.model, "input": ASK, **body}, timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_stream_that_fails_mid_way_ends_with_error_and_failed(server: Server) -> None:
    """A regex whose lexer outgrows llguidance's limit after the first token (as in
    tests/test_hostile_server.py): the stream has begun, and ends with the API's
    ``error`` event naming the field, then ``response.failed``; the server goes on."""
    events = list(_respond(server, stream=True,
                           extra_body={"structured_outputs": {"regex": "a{1000000}"}}))  # fmt: skip
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].param == "structured_outputs" and "too complex" in events[-2].message
    assert events[-1].response.status == "failed" and events[-1].response.error.message
    assert _respond(server, max_output_tokens=2).usage.output_tokens == 2


def test_responses_are_counted_by_route(server: Server) -> None:
    before = httpx.get(server.url + "/metrics", timeout=30).text
    _respond(server, max_output_tokens=2)
    after = httpx.get(server.url + "/metrics", timeout=30).text
    line = 'tokentrail_http_requests_total{path="/v1/responses",status="200"}'

    def count(text: str) -> float:
        found = [ln for ln in text.splitlines() if ln.startswith(line)]
        return float(found[0].split()[-1]) if found else 0.0

    assert count(after) == count(before) + 1


# -- against llama-server's own /v1/responses --------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_through_the_proxy_llama_servers_own_responses_text(
    llama_and_proxy: tuple[Server, Server], stream: bool
) -> None:
    """The same Responses request to llama-server (its own /v1/responses) and to the
    proxy in front of it: the same text and token counts. (llama-server says
    "completed" where `max_output_tokens` ended the reply; OpenAI's API, and this
    server, "incomplete".)"""
    llama, proxy = llama_and_proxy
    body = {"model": "m", "input": "List five fruits, one per line.", "max_output_tokens": 12,
            "temperature": 0, "instructions": "Be brief."}  # fmt: skip

    def text(url: str) -> tuple[str, int]:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        body["model"] = client.models.list().data[0].id
        if not stream:
            r = client.responses.create(**body)
            return r.output_text, r.usage.output_tokens
        events = list(client.responses.create(**body, stream=True))
        said = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        return said, events[-1].response.usage.output_tokens

    theirs, mine = text(llama.url), text(proxy.url)
    assert mine == theirs and mine[1] == 12
