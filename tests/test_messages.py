"""Anthropic's Messages API (`tokentrail.server.messages`) through Anthropic's own
`anthropic` client on a real `tokentrail serve` (the demo model), and against
llama-server's own /v1/messages through the proxy.

Oracles: the same request as a chat completion on the same server (greedy decoding is
deterministic, and a Messages request means that chat request), the tokenizer's own
library (`tokenizers` decodes the ids the stream's extension lists into its text),
`jsonschema` for tool input, llama-server's answer to the same Messages request, and
the API's event grammar.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.env import require

anthropic = require("anthropic")
require("uvicorn")

from tests.helpers.servers import Server, start_server  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "src" / "tokentrail" / "demo_model"
KEY = "test-key"
ASK = [{"role": "user", "content": "What is a list?"}]
WEATHER = {
    "name": "get_weather", "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                     "required": ["city"], "additionalProperties": False},
}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(None, tmp_path_factory.mktemp("logs") / "messages.log", api_key=KEY)
    yield srv
    srv.stop()


def _client(url: str, key: str = KEY) -> Any:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=300)


def _ask(server: Server, **extra: Any) -> Any:
    body = {"model": server.model, "max_tokens": 16, "messages": ASK, **extra}
    body["extra_body"] = {"temperature": 0, **body.get("extra_body", {})}
    return _client(server.url).messages.create(**body)


def _chat(server: Server, messages: list[dict[str, Any]], **extra: Any) -> Any:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    return client.chat.completions.create(
        model=server.model, messages=messages, temperature=0, **{"max_tokens": 16, **extra}
    )


def test_a_message_is_the_chat_answer_it_means(server: Server) -> None:
    got = _ask(server, system="Answer in one word.")
    chat = _chat(server, [{"role": "system", "content": "Answer in one word."}, *ASK])
    assert got.type == "message" and got.role == "assistant" and got.id.startswith("msg_")
    assert [b.type for b in got.content] == ["text"]
    assert got.content[0].text == chat.choices[0].message.content
    assert got.stop_reason == "max_tokens" and got.stop_sequence is None
    assert (got.usage.input_tokens, got.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert got.model_extra["tokentrail"]["segments"]


def test_the_stream_follows_the_apis_events_and_carries_each_token(server: Server) -> None:
    from tokenizers import Tokenizer

    whole = _ask(server)
    events = list(_ask(server, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}
    deltas = events[2:-3]
    text = "".join(e.delta.text for e in deltas)
    assert text == whole.content[0].text
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 16
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    ids = [e.model_extra["tokentrail"]["token"]["id"] for e in deltas]
    assert Tokenizer.from_file(str(DEMO / "tokenizer.json")).decode(ids) == text
    with _client(server.url).messages.stream(model=server.model, max_tokens=16, messages=ASK,
                                             extra_body={"temperature": 0}) as stream:  # fmt: skip
        assert "".join(stream.text_stream) == text
        assert stream.get_final_message().content[0].text == text


def test_a_stop_sequence_is_named(server: Server) -> None:
    plain = _ask(server).content[0].text
    cut = plain.index(" ", 3)
    stop = plain[cut:cut + 3]
    with _client(server.url).messages.stream(
        model=server.model, max_tokens=16, messages=ASK, stop_sequences=[stop],
        extra_body={"temperature": 0},
    ) as s:  # fmt: skip
        streamed = s.get_final_message()
    for got in (_ask(server, stop_sequences=[stop]), streamed):
        assert got.stop_reason == "stop_sequence" and got.stop_sequence == stop
        assert got.content[0].text == plain[:cut]


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_is_a_tool_use_block(server: Server, stream: bool) -> None:
    jsonschema = require("jsonschema")
    if stream:
        with _client(server.url).messages.stream(
            model=server.model, max_tokens=80, messages=ASK, tools=[WEATHER],
            tool_choice={"type": "any"}, extra_body={"temperature": 0},
        ) as s:  # fmt: skip
            got = s.get_final_message()
    else:
        got = _ask(server, max_tokens=80, tools=[WEATHER], tool_choice={"type": "any"})
    uses = [b for b in got.content if b.type == "tool_use"]
    assert got.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    assert uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])


def test_a_tool_result_sent_back_is_the_chat_tool_turn(server: Server) -> None:
    first = _ask(server, max_tokens=80, tools=[WEATHER], tool_choice={"type": "any"})
    use = next(b for b in first.content if b.type == "tool_use")
    turns = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": "Sunny."}]}]  # fmt: skip
    second = _ask(server, messages=turns, tools=[WEATHER], tool_choice={"type": "none"})
    chat = _chat(server, [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": use.id, "type": "function", "function": {
            "name": use.name, "arguments": json.dumps(use.input, ensure_ascii=False)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "Sunny."}],
        tools=[{"type": "function", "function": {"name": WEATHER["name"],
                "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}}],
        tool_choice="none")  # fmt: skip
    assert second.content[0].text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens


REFUSED = [
    ("messages[0].content[0]", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://example.com/a.png"}}]}]}),
    ("tools[0]", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
    ("thinking", {"thinking": {"type": "enabled", "budget_tokens": 1024}}),
    ("mcp_servers", {"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}),
    ("tool_choice", {"tool_choice": {"type": "sometimes"}}),
    ("messages[0]", {"messages": [{"role": "system", "content": "x"}]}),
]


@pytest.mark.parametrize(("param", "body"), REFUSED, ids=[p for p, _ in REFUSED])
def test_what_is_not_served_is_refused_by_name_in_anthropics_shape(
    server: Server, param: str, body: dict[str, Any]
) -> None:
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY},
                   json={"model": server.model, "max_tokens": 4, "messages": ASK, **body},
                   timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    got = r.json()
    assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
    assert got["error"]["param"] == param and f"'{param}'" in got["error"]["message"]


def test_anthropics_key_header_is_the_api_key(server: Server) -> None:
    assert _ask(server, max_tokens=2).usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError) as e:
        _client(server.url, key="wrong").messages.create(model=server.model, max_tokens=2,
                                                         messages=ASK)  # fmt: skip
    assert e.value.body["error"]["type"] == "authentication_error"


# -- against llama-server's own /v1/messages ---------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_through_the_proxy_llama_servers_own_messages_text(
    llama_and_proxy: tuple[Server, Server], stream: bool
) -> None:
    llama, proxy = llama_and_proxy
    body = {"model": "m", "max_tokens": 12, "system": "Be brief.",
            "extra_body": {"temperature": 0},
            "messages": [{"role": "user", "content": "List five fruits, one per line."}]}

    def said(url: str) -> tuple[str, int, str]:
        client = _client(url, key="x")
        body["model"] = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        if stream:
            with client.messages.stream(**body) as s:
                m = s.get_final_message()
        else:
            m = client.messages.create(**body)
        return m.content[0].text, m.usage.output_tokens, m.stop_reason

    theirs, mine = said(llama.url), said(proxy.url)
    assert mine == theirs and mine[1] == 12
