"""One output pipeline (issue 28): the library's streamed responses, the server's
streamed chunks joined and the server's whole response agree field by field.

Replies with a reasoning block, content and tool calls (hermes, llama3_json) or a JSON
object are built by hypothesis, tokenized by the demo model's real tokenizer and fed as
engine steps, with random logprobs and alternatives, through one `OutputProcessor` per
view (`GenerationResponse.of` for `stream_generate`, `Formatter.chunk` for the streamed
server, `Formatter.response` for the whole one). The oracle for the texts is the reply
itself: the reasoning and content each view gives join to what was written, the calls'
names and arguments are the ones written, and every view lists the same fields with the
same tokens, alternatives and logprobs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.env import require
from tokentrail.engines.base import Step
from tokentrail.output.processor import OutputProcessor, merged_tool_deltas
from tokentrail.prompting import aligner_for, stop_matcher
from tokentrail.sequence import GenerationResponse, SequenceState

DEMO = Path(__file__).resolve().parents[1] / "src" / "tokentrail" / "demo_model"

WORDS = st.sampled_from(["Paris", "rain", "is", "warm", "ok", "déjà", "42", "ß", "🙂", "no"])
PROSE = st.lists(WORDS, min_size=1, max_size=6).map(" ".join)
ARGS = st.fixed_dictionaries(
    {"city": WORDS, "unit": st.sampled_from(["celsius", "fahrenheit"]), "days": st.integers(0, 9)}
)


@st.composite
def replies(draw: Any) -> tuple[str, str, str, list[tuple[str, dict[str, Any]]]]:
    """(parser, reply text, its content, its calls): content and hermes calls, a
    llama3_json call, or a JSON object (no parser)."""
    kind = draw(st.sampled_from(["hermes", "llama3_json", "json"]))
    calls = [(draw(st.sampled_from(["get_weather", "lookup"])), draw(ARGS))
             for _ in range(draw(st.integers(1, 2)))]  # fmt: skip
    if kind == "hermes":
        content = draw(PROSE) + "\n"
        text = content + "".join(
            f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>"
            for n, a in calls
        )
        return kind, text, content, calls
    if kind == "llama3_json":
        n, a = calls[0]
        return kind, json.dumps({"name": n, "parameters": a}), "", calls[:1]
    value = {"answer": draw(PROSE), "unit": calls[0][1]["unit"], "n": calls[0][1]["days"]}
    return "json", json.dumps(value), json.dumps(value), []


@pytest.fixture(scope="module")
def demo() -> Any:
    tokenizers = require("tokenizers")
    transformers = require("transformers")
    tok = tokenizers.Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(DEMO / "tokenizer.json"))
    return tok, hf


def _steps(ids: list[int], seed: int) -> list[Step]:
    """Steps with logprobs and two alternatives each (deterministic per seed); now and
    then the second alternative's logprob is -inf (the wire writes it -9999.0)."""
    out = []
    for n, i in enumerate(ids):
        lp = -((seed * 7 + n * 13) % 50) / 10.0
        alt = (i + 1 + (seed + n) % 5) % 500
        second = float("-inf") if (seed + n) % 11 == 0 else lp - 0.5
        out.append(Step(i, lp, [(i, lp), (alt, second)], None))
    return out


#: The demo tokenizer's <|im_end|>, which ends a reply when `eos` is drawn.
EOS = 2


def _processor(hf: Any, parser: str | None, reasoning: bool, n: int) -> OutputProcessor:
    state = SequenceState(
        aligner_for(hf, None, True), stop_matcher(None), frozenset({EOS}), 0, n, None,
        lambda: 0.0,
    )
    fields = parser is None
    return OutputProcessor(
        state,
        reasoning=("<think>", "</think>") if reasoning else None,
        starts_in_reasoning=False if reasoning else None,
        tool_parser=parser,
        fields=fields,
    )


def _fields(found: list[Any]) -> list[tuple[Any, ...]]:
    return [
        (
            f["path"],
            f["value"],
            tuple((t["index"], t["id"], t["start"], t["end"]) for t in f["tokens"]),
        )
        for f in found
    ]


def _lib_fields(found: list[Any]) -> list[tuple[Any, ...]]:
    return _fields([f.to_dict() for f in found])


@dataclass(frozen=True)
class Views:
    """One reply through the in-process pipeline: its text, ids and engine steps, the
    library's responses, the server's streamed chunks and its whole response."""

    text: str
    ids: list[int]
    steps: list[Step]
    lib: list[GenerationResponse]
    chunks: list[dict[str, Any]]
    whole: dict[str, Any]


def views(demo: Any, reply: Any, think: str | None, seed: int, eos: bool) -> Views:
    """`reply` (a `replies()` draw) after a reasoning block `think` (None: none), through
    `stream_generate`'s view and the server's `Formatter`, streamed and whole."""
    from tokentrail.prompting import vocab_for
    from tokentrail.server.formatting import Formatter
    from tokentrail.server.protocol import GenRequest

    tok, hf = demo
    kind, body, _content, _calls = reply
    parser = None if kind == "json" else kind
    text = body if think is None else f"<think>{think}</think>{body}"
    ids = tok.encode(text, add_special_tokens=False).ids + ([EOS] if eos else [])
    steps = _steps(ids, seed)
    reasoning = think is not None

    # the library: stream_generate's responses
    proc = _processor(hf, parser, reasoning, len(ids))
    lib = [GenerationResponse.of(proc.feed(s)) for s in steps]
    # the server: streamed chunks and the whole response, each from its own stage
    req = GenRequest(kind="chat", prompt=[], model="m", logprobs=True, top_logprobs=2)
    vocab = vocab_for(hf)
    proc = _processor(hf, parser, reasoning, len(ids))
    streamed = Formatter("a", req, vocab)
    records = [proc.feed(s) for s in steps]
    chunks = [streamed.chunk(r) for r in records]
    whole = Formatter("a", req, vocab).response(records)
    return Views(text, ids, steps, lib, chunks, whole)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    reply=replies(), think=st.one_of(st.none(), PROSE), seed=st.integers(0, 99), eos=st.booleans()
)
def test_library_streamed_and_whole_agree(
    demo: Any, reply: Any, think: str | None, seed: int, eos: bool
) -> None:
    kind, body, content, calls = reply
    parser = None if kind == "json" else kind
    reasoning = think is not None
    v = views(demo, reply, think, seed, eos)
    text, ids, steps, lib, chunks, whole = v.text, v.ids, v.steps, v.lib, v.chunks, v.whole

    message = whole["choices"][0]["message"]
    deltas = [c["choices"][0]["delta"] for c in chunks]

    # reasoning: what was written, in every view
    lib_reasoning = "".join(r.reasoning_text for r in lib)
    assert lib_reasoning == "".join(d.get("reasoning", "") for d in deltas)
    if reasoning:
        assert lib_reasoning == think == message["reasoning"]
        assert lib[-1].reasoning == think

    # content: around the calls, in every view
    if parser is not None:
        lib_content = "".join(r.content_text for r in lib)
        assert lib_content == "".join(d.get("content", "") for d in deltas)
        assert lib_content.strip() == content.strip() == (message["content"] or "").strip()
    else:
        streamed_content = "".join(d.get("content", "") for d in deltas)
        assert streamed_content == message["content"] == content
        if reasoning:
            assert "".join(r.content_text for r in lib) == content

    # tool calls: the ones written, streamed pieces == whole == library
    if parser is not None:
        pieces = merged_tool_deltas([p for d in deltas for p in d.get("tool_calls", [])])
        lib_pieces = merged_tool_deltas([p for r in lib for p in (r.tool_calls or [])])
        want = [(n, a) for n, a in calls]
        for got in (pieces, lib_pieces, message.get("tool_calls", [])):
            assert [
                (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got
            ] == want
        assert [c.to_dict()["function"] for c in lib[-1].all_tool_calls] == [
            c["function"] for c in message["tool_calls"]
        ]
        assert (
            whole["choices"][0]["finish_reason"]
            == chunks[-1]["choices"][0]["finish_reason"]
            == "tool_calls"
        )

    # the extension's segments: the same streamed and whole; with a tool parser each
    # part is content or a call's text (channel tool_call), every token's bytes there
    seg_stream = [g for c in chunks for g in c["tokentrail"]["segments"]]
    seg_whole = whole["tokentrail"]["segments"]
    assert seg_stream == seg_whole
    assert "".join(g["text"] for g in seg_whole) == text
    for g in seg_whole:
        joined = b"".join(bytes(t["bytes"])[t["start"] : t["end"]] for t in g["tokens"])
        assert joined == g["text"].encode(), g
    if parser is not None:
        by = {c: "".join(g["text"] for g in seg_whole if g.get("channel") == c) for c in
              ("content", "tool_call", "reasoning")}  # fmt: skip
        assert by["content"] == "".join(r.content_text for r in lib)
        assert by["content"] + by["tool_call"] == body
        assert all(name in by["tool_call"] for name, _ in calls)
        assert {t["index"] for g in seg_whole for t in g["tokens"]} == set(range(len(ids)))

    # fields: the same paths, values and tokens everywhere
    ext_stream = [f for c in chunks for f in c["tokentrail"].get("fields", [])]
    ext_whole = whole["tokentrail"].get("fields", [])
    if parser is None:
        lib_found = [f for r in lib for f in (r.fields or [])]
        assert _fields(ext_stream) == _fields(ext_whole) == _lib_fields(lib_found)
        assert _lib_fields(lib[-1].all_fields) == _fields(ext_whole)
        assert {f["path"] for f in ext_whole} == {"/answer", "/unit", "/n"}
    else:
        lib_calls = lib[-1].all_tool_calls
        assert (
            _fields(ext_stream)
            == _fields(ext_whole)
            == _lib_fields([f for c in lib_calls for f in c.fields])
        )
        lib_streamed = [f for r in lib for f in r.tool_fields or ()]
        assert _lib_fields(lib_streamed) == _fields(ext_whole)
        # each string field (a name, a city, a unit) comes with the token that ends it
        for k, c in enumerate(chunks):
            for f in c["tokentrail"].get("fields", []):
                if isinstance(f["value"], str):
                    assert max(t["index"] for t in f["tokens"]) == k, (f, k)

    # logprobs: the same listed tokens streamed and whole, each logprob the step's
    listed_stream = [
        e for c in chunks for e in (c["choices"][0]["logprobs"] or {}).get("content", [])
    ]
    listed_whole = whole["choices"][0]["logprobs"]["content"]
    assert listed_stream == listed_whole
    assert {e["logprob"] for e in listed_whole} <= {s.logprob for s in steps}
    assert all(len(e["top_logprobs"]) == 2 for e in listed_whole)
    assert len(listed_whole) <= len(ids)
