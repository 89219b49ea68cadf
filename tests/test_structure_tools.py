"""Tool calls in each family's format: names, arguments, fields, streamed pieces.

Cases are ported from vLLM's tool-parser tests (tests/tool_parsers/
test_hermes_tool_parser.py, test_llama3_json_tool_parser.py) and llama.cpp's
tests/test-chat.cpp (Mistral `[TOOL_CALLS]name[ARGS]{...}`, with and without reasoning).
Expected arguments are compared as JSON values (`json.loads`), as those tests do; the
fields' tokens are checked against each token's own bytes from a real tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.env import require
from tokentrail import Aligner, Segment
from tokentrail.errors import StructureError
from tokentrail.structure import (
    ToolCallStream,
    detect_tool_parser,
    parse_tool_calls,
    split_channels,
)

DEMO = Path(__file__).resolve().parents[1] / "src" / "tokentrail" / "demo_model"


@pytest.fixture(scope="module")
def demo() -> tuple[Callable[[str], list[int]], Aligner]:
    tokenizers = require("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    return (lambda s: tok.encode(s, add_special_tokens=False).ids), Aligner(str(DEMO))


def segments_of(demo: Any, text: str) -> list[Segment]:
    encode, aligner = demo
    a = aligner.fresh()
    out: list[Segment] = []
    for i in encode(text):
        out += a.push(i, -0.25)
    return out + a.finish()


def parse(demo: Any, text: str, parser: str) -> Any:
    """Parse `text` whole and streamed (one segment at a time); check they agree and
    that every field's tokens hold exactly its text."""
    segments = segments_of(demo, text)
    result = parse_tool_calls(text, segments, parser)
    pieces = demo[1].vocab.pieces
    for f in result.fields:
        assert b"".join(pieces[t.id][t.start : t.end] for t in f.tokens) == f.text.encode()
        assert f.confidence is not None
    stream = ToolCallStream(parser)
    content, names, args = "", {}, {}
    for seg in [*segments, None]:
        got, deltas = stream.feed(seg) if seg is not None else stream.finish()
        content += got
        for d in deltas:
            if d.name is not None:
                assert d.index not in names and d.index == len(names)
                names[d.index] = d.name
            args[d.index] = args.get(d.index, "") + d.arguments
    assert stream.result is not None and stream.result.calls == result.calls
    if len(names) == len(result.calls):  # nothing streamed that turned out not a call
        assert [c.name for c in result.calls] == [names[i] for i in sorted(names)]
        assert [c.arguments for c in result.calls] == [args[i] for i in sorted(args)]
        assert content.strip() == result.content.strip()
    return result


def calls(result: Any) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in result.calls]


# -- Hermes / Qwen ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected", "content"),
    [
        ('<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n</tool_call>',
         [("final_answer", {"trigger": True})], ""),
        ('<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}',
         [("final_answer", {"trigger": True})], ""),
        ('<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}', [],
         '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}'),
        ("This is not a tool call.", [], "This is not a tool call."),
        ('<tool_call>\n{"name": "get_db_config", "arguments": '
         '"{\\"param\\": \\"max_connections\\"}"}\n</tool_call>',
         [("get_db_config", {"param": "max_connections"})], ""),
        ('<tool_call>\n{"name": "do_thing", "arguments": "hello"}\n</tool_call>',
         [("do_thing", "hello")], ""),
        ('Sure, let me check the weather.<tool_call>{"name": "get_weather", '
         '"arguments": {"city": "NYC"}}</tool_call>',
         [("get_weather", {"city": "NYC"})], "Sure, let me check the weather."),
        ('<tool_call>{"name": "search", "arguments": {"q": "cats"}}</tool_call>'
         '<tool_call>{"name": "search", "arguments": {"q": "dogs"}}</tool_call>',
         [("search", {"q": "cats"}), ("search", {"q": "dogs"})], ""),
        ('<tool_call>\n{"name": "get_current_temperature",\n"arguments": {"location":\n'
         '"San Francisco, California, United States", "unit": "celsius"}}\n</tool_call>',
         [("get_current_temperature", {"location": "San Francisco, California, United States",
                                       "unit": "celsius"})], ""),
    ],
)  # fmt: skip
def test_hermes_cases_from_vllm(demo: Any, text: str, expected: list, content: str) -> None:
    """Ported from vLLM tests/tool_parsers/test_hermes_tool_parser.py: between tags,
    until EOS, invalid JSON (not a call), plain text, serialised and bare-string
    arguments, content then a call, two calls, the multi-line call (bug 19056)."""
    result = parse(demo, text, "hermes")
    assert calls(result) == expected
    assert result.content == content


def test_hermes_fields_and_paths(demo: Any) -> None:
    call = '{"name": "book", "arguments": {"city": "Paris", "n": [2, true]}}'
    text = f"<tool_call>\n{call}\n</tool_call>"
    result = parse(demo, text, "hermes")
    assert [(f.path, f.value) for f in result.fields] == [
        ("/tool_calls/0/function/name", "book"),
        ("/tool_calls/0/arguments/city", "Paris"),
        ("/tool_calls/0/arguments/n/0", 2),
        ("/tool_calls/0/arguments/n/1", True),
    ]
    (call,) = result.calls
    function = {"name": "book", "arguments": call.arguments}
    assert call.to_dict() == {"id": "call_0", "type": "function", "function": function}
    assert text[call.start : call.end] == text.split("\n")[1]
    pieces = demo[1].vocab.pieces
    assert (
        b"".join(pieces[t.id][t.start : t.end] for t in call.tokens)
        == text[call.start : call.end].encode()
    )


# -- Llama 3 JSON --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} Would you like '
         "to know more?", [("getOpenIncidentsTool", {})]),
        ('{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}',
         [("searchTool", {"query": "test query", "limit": 10})]),
        ("This is just some text without any tool calls", []),
        ('{"name": "invalidTool", "parameters": {invalid json}', []),
        ('{"name": "searchTool", "arguments": {"query": "test"}}',
         [("searchTool", {"query": "test"})]),
        ('{"name": "searchTool", "parameters": {"query": "test1"}}; '
         '{"name": "getOpenIncidentsTool", '
         '"parameters": {}}; {"name": "searchTool", "parameters": {"query": "test2"}}',
         [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {}),
          ("searchTool", {"query": "test2"})]),
        ('{"name": "a", "parameters": {"q": 1}} ; {"name": "b", "parameters": {}}',
         [("a", {"q": 1}), ("b", {})]),
        ('{"name": "complexTool", "parameters": {"level1": {"level2": {"value": "deep"}}}}',
         [("complexTool", {"level1": {"level2": {"value": "deep"}}})]),
        ('{"name": "searchTool", "parameters": {"query": "test {value} [complex]",'
         '"nested": {"inner": "more {brackets}"}}}',
         [("searchTool", {"query": "test {value} [complex]",
                          "nested": {"inner": "more {brackets}"}})]),
        ('{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}',
         [("parserTool", {"text": 'He said "Hello {world}"'})]),
        ('{"parameters": {}}', []),
        ('{"name": "toolWithoutParams"}', []),
        ('{"name": "searchTool", "parameters": {"query": "test"}} I used {searchTool} for this.',
         [("searchTool", {"query": "test"})]),
        ('{"name": "searchTool", "parameters": {"query": "test"}} The arguments I passed were '
         '{"query": "test"}', [("searchTool", {"query": "test"})]),
        ('<|python_tag|>{"name": "f", "parameters": {"x": null}}', [("f", {"x": None})]),
    ],
)  # fmt: skip
def test_llama3_json_cases_from_vllm(demo: Any, text: str, expected: list) -> None:
    """Ported from vLLM tests/tool_parsers/test_llama3_json_tool_parser.py (simple, with
    arguments, no JSON, invalid JSON, "arguments" key, several with `;`, nesting, braces
    and escaped quotes in strings, missing name or parameters, braces in trailing text)."""
    result = parse(demo, text, "llama3_json")
    assert calls(result) == expected
    if not expected:
        assert result.content == text


@pytest.mark.parametrize("separator", ["; ", ";", ";\n", "\n"])
def test_llama3_streaming_separators_from_vllm(demo: Any, separator: str) -> None:
    """vLLM's test_extract_tool_calls_streaming_parallel_separators."""
    text = ('{"name": "searchTool", "parameters": {"query": "test1"}}' + separator
            + '{"name": "getOpenIncidentsTool", "parameters": {}}')  # fmt: skip
    result = parse(demo, text, "llama3_json")
    assert calls(result) == [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {})]


# -- Mistral -------------------------------------------------------------------------------


def test_mistral_cases_from_llama_cpp(demo: Any) -> None:
    """llama.cpp tests/test-chat.cpp (Ministral/Magistral): `[TOOL_CALLS]name[ARGS]{...}`,
    two in one message, and after `[THINK]...[/THINK]` reasoning."""
    result = parse(demo, '[TOOL_CALLS]special_function[ARGS]{"arg1":1}', "mistral")
    assert calls(result) == [("special_function", {"arg1": 1})] and result.content == ""
    two = ('[TOOL_CALLS]special_function[ARGS]{"arg1": 1}'
           '[TOOL_CALLS]special_function_with_opt[ARGS]{"arg1": 1, "arg2": 2}')  # fmt: skip
    result = parse(demo, two, "mistral")
    assert calls(result) == [("special_function", {"arg1": 1}),
                             ("special_function_with_opt", {"arg1": 1, "arg2": 2})]  # fmt: skip
    name = result.fields[0]
    assert (name.path, name.value, name.text) == ("/tool_calls/0/function/name",) + (
        "special_function",
    ) * 2
    text = "[THINK]I'm\nthinking[/THINK]" + '[TOOL_CALLS]special_function[ARGS]{"arg1":1}'
    channels = split_channels(segments_of(demo, text), "mistral")
    reasoning = "".join(p.text for p in channels if p.channel == "reasoning")
    after = [p for p in channels if p.channel == "content"]
    assert reasoning == "I'm\nthinking"
    content = "".join(p.text for p in after)
    assert calls(parse_tool_calls(content, after, "mistral")) == [("special_function", {"arg1": 1})]


def test_mistral_array_form_and_call_id(demo: Any) -> None:
    """The v0.3 template's `[TOOL_CALLS] [{...}, ...]` array, and `[CALL_ID]` ids."""
    text = ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, '
            '{"name": "b", "arguments": {}}]')  # fmt: skip
    result = parse(demo, text, "mistral")
    assert calls(result) == [("add", {"a": 3.5, "b": 4}), ("b", {})]
    assert [f.path for f in result.fields][:3] == [
        "/tool_calls/0/function/name", "/tool_calls/0/arguments/a", "/tool_calls/0/arguments/b"
    ]  # fmt: skip
    result = parse(demo, '[TOOL_CALLS]mul[CALL_ID]abc123456[ARGS]{"x": "y"}', "mistral")
    assert result.calls[0].id == "abc123456"


# -- detection, errors ---------------------------------------------------------------------


def test_detect_tool_parser() -> None:
    assert detect_tool_parser("{% for tool in tools %}<tool_call>\n{{ tool }}") == "hermes"
    assert detect_tool_parser("{{ '[AVAILABLE_TOOLS]' }}...[TOOL_CALLS]") == "mistral"
    assert detect_tool_parser("<|start_header_id|>ipython<|end_header_id|><|python_tag|>") == (
        "llama3_json"
    )
    template = (DEMO / "tokenizer_config.json").read_text()
    assert detect_tool_parser(json.loads(template)["chat_template"]) is None


def test_unknown_tool_parser() -> None:
    with pytest.raises(StructureError, match="unknown tool-call parser 'nope'; known: hermes"):
        parse_tool_calls("x", [Segment("x", ())], "nope")
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        ToolCallStream("nope")
