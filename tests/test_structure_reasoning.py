"""Reasoning channels: segments split into reasoning / content / tool_call / markup.

Checked on real tokenizers (the demo model's, and Qwen2's from the corpus, whose `.Ċ`
and `>The` tokens straddle a marker), on real demo-model replies, and by hypothesis on
random texts built around markers. The oracle for where the channels are is a plain
whole-text splitter written here (str.find over the finished text, no streaming, no
tokens); the token attribution is checked against each token's own bytes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from pathlib import Path

import pytest

from tests.helpers.env import require
from tests.helpers.real_tokenizers import DEMO, Tok
from tokentrail import Segment
from tokentrail.errors import StructureError
from tokentrail.structure import (
    CHANNELS,
    REASONING_PARSERS,
    ChannelSegment,
    ChannelSplitter,
    ReasoningFormat,
    reasoning_format,
    split_channels,
)


@pytest.fixture(scope="module")
def demo() -> Tok:
    tokenizers = require("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    return Tok(lambda s: tok.encode(s, add_special_tokens=False).ids, str(DEMO))


@pytest.fixture(scope="module")
def qwen2(corpus: Path) -> Tok:
    transformers = require("transformers")
    folder = corpus / "tokenizers" / "qwen2"
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    return Tok(lambda s: tok.encode(s, add_special_tokens=False), str(folder))


@pytest.fixture(scope="module", params=["demo", "qwen2"])
def tok(request: pytest.FixtureRequest) -> Tok:
    return request.getfixturevalue(request.param)


# -- the oracle and the invariants ------------------------------------------------


def oracle(text: str, fmt: ReasoningFormat) -> list[tuple[str, str]]:
    """(channel, text) runs of the whole finished `text`, found by str.find."""
    tools = fmt.tool_call
    channel = "reasoning" if fmt.starts_in_reasoning else "content"
    runs: list[tuple[str, str]] = []
    pos, fresh = 0, True
    while True:
        options: list[tuple[int, int, str, str]] = []  # (at, -len, marker, to)

        def add(markers: Iterable[str], to: str, pos: int = pos, options: list = options):
            for m in markers:
                i = text.find(m, pos)
                if i >= 0:
                    options.append((i, -len(m), m, to))

        if channel == "content":
            add(fmt.start, "reasoning")
            add([tools[0]] if tools else [], "tool_call")
        elif channel == "reasoning":
            add(fmt.end, "content")
            add([tools[0]] if tools and fmt.tool_call_ends_reasoning else [], "tool_call")
            if fmt.starts_in_reasoning and fresh:
                for m in fmt.start:
                    i = text.find(m, pos)
                    if i >= 0 and not text[pos:i].strip():
                        options.append((i, -len(m), m, "reasoning"))
        elif tools and tools[1]:
            add([tools[1]], "content")
        if not options:
            runs.append((channel, text[pos:]))
            return [r for r in runs if r[1]]
        i, _, marker, to = min(options)
        runs.append((channel, text[pos:i]))
        fresh = fresh and not text[pos:i].strip()
        runs.append(("markup", marker))
        pos, channel, fresh = i + len(marker), to, True


def joined(pieces: Iterable[ChannelSegment]) -> list[tuple[str, str]]:
    """Consecutive pieces of one channel joined (markers stay one run each)."""
    runs: list[tuple[str, str]] = []
    for p in pieces:
        if runs and runs[-1][0] == p.channel and p.channel != "markup":
            runs[-1] = (p.channel, runs[-1][1] + p.text)
        elif p.text:
            runs.append((p.channel, p.text))
    return runs


def check(tok: Tok, text: str, fmt: ReasoningFormat) -> ChannelSplitter:
    """Stream `text` through the aligner and a splitter; check every invariant."""
    segments = tok.segments(text)
    assert "".join(s.text for s in segments) == text  # the tokenizer round-trips it
    splitter = ChannelSplitter(fmt)
    pieces: list[ChannelSegment] = []
    markers = [*fmt.start, *fmt.end, *(fmt.tool_call or ())]
    for seg in segments:
        pieces += splitter.feed(seg)
        held = splitter.held_text
        # Only a possible marker start is held back.
        assert not held or any(m.startswith(held) and m != held for m in markers), held
    pieces += splitter.finish()
    assert pieces == splitter.segments
    # Nothing lost, nothing twice; the channels are where the oracle puts them.
    assert "".join(p.text for p in pieces) == text
    assert joined(pieces) == oracle(text, fmt)
    for p in pieces:
        assert p.channel in CHANNELS
        got = b"".join(tok.piece(t.id)[t.start : t.end] for t in p.tokens)
        assert got == p.text.encode(), (p, got)  # its tokens' bytes are its text
    # Every token appears, in order; a straddling one in each channel it fed.
    indexes = [t.index for p in pieces for t in p.tokens]
    assert indexes == sorted(indexes)
    assert set(indexes) == {t.index for s in segments for t in s.tokens}
    for channel in CHANNELS:
        spans = splitter.tokens(channel)
        got = b"".join(tok.piece(t.id)[t.start : t.end] for t in spans)
        assert got == splitter.text(channel).encode()
    return splitter


# -- ported cases -------------------------------------------------------------------

# vLLM tests/reasoning/test_deepseekr1_reasoning_parser.py (SIMPLE_REASONING,
# COMPLETE_REASONING, NO_CONTENT, MULTIPLE_LINES, SHORTEST_REASONING, REASONING_WITH_THINK,
# COMPLETE_REASONING_WITH_THINK, MULTIPLE_LINES_WITH_THINK, THINK_NO_END, EMPTY and the
# streaming NEW_LINE_STREAMING: text before `<think>` stays reasoning when streamed).
R1_CASES = [
    ("This is a reasoning section</think>This is the rest", "This is a reasoning section",
     "This is the rest"),
    ("This is a reasoning section</think>", "This is a reasoning section", ""),
    ("This is content", "This is content", ""),
    ("This\nThat</think>This is the rest\nThat", "This\nThat", "This is the rest\nThat"),
    ("</think>This is the rest", "", "This is the rest"),
    ("<think>This is a reasoning section</think>This is the rest",
     "This is a reasoning section", "This is the rest"),
    ("<think>This is a reasoning section</think>", "This is a reasoning section", ""),
    ("<think>This\nThat</think>This is the rest\nThat", "This\nThat", "This is the rest\nThat"),
    ("<think>This is a reasoning section", "This is a reasoning section", ""),
    ("", "", ""),
    ("\n<think>This is a reasoning section</think>\nThis is the rest",
     "\nThis is a reasoning section", "\nThis is the rest"),
]  # fmt: skip


def channel_texts(tok: Tok, text: str, parser: str | tuple[str, str], **kw: bool) -> tuple:
    splitter = check(tok, text, reasoning_format(parser, **kw))
    return splitter.text("reasoning"), splitter.text("content")


@pytest.mark.parametrize(("output", "reasoning", "content"), R1_CASES)
def test_deepseek_r1_cases_from_vllm(tok: Tok, output: str, reasoning: str, content: str) -> None:
    """Ported from vLLM tests/reasoning/test_deepseekr1_reasoning_parser.py (streaming
    expectations): the reply starts in the reasoning; `<think>` is optional markup."""
    assert channel_texts(tok, output, "deepseek_r1") == (reasoning, content)


@pytest.mark.parametrize(("output", "reasoning", "content"), R1_CASES)
def test_mistral_cases_from_vllm(demo: Tok, output: str, reasoning: str, content: str) -> None:
    """Ported from vLLM tests/reasoning/test_mistral_reasoning_parser.py, which has the
    DeepSeek-R1 cases with [THINK]/[/THINK] (here as text, as the aligner emits them
    with skip_special_tokens=False)."""
    output = output.replace("<think>", "[THINK]").replace("</think>", "[/THINK]")
    assert channel_texts(demo, output, "mistral") == (reasoning, content)


TOOL_CALL_BODY = (
    "<tool_call>\n<function=bash>\n<parameter=command>"
    "\ncat /etc/hosts\n</parameter>\n</function>\n</tool_call>"
)
QWEN3_CASES = [
    ("This is a reasoning section</think>This is the rest", "This is a reasoning section",
     "This is the rest"),
    ("This is a reasoning section</think>", "This is a reasoning section", ""),
    ("<think>This is a reasoning section</think>This is the rest",
     "This is a reasoning section", "This is the rest"),
    ("This is the rest", "This is the rest", ""),
    ("<think>This is a reasoning\nsection</think>This is the rest\nThat",
     "This is a reasoning\nsection", "This is the rest\nThat"),
    ("<think>This is a reasoning section", "This is a reasoning section", ""),
]  # fmt: skip


@pytest.mark.parametrize(("output", "reasoning", "content"), QWEN3_CASES)
def test_qwen3_cases_from_vllm(tok: Tok, output: str, reasoning: str, content: str) -> None:
    """Ported from vLLM tests/reasoning/test_qwen3_reasoning_parser.py (WITHOUT_START_TOKEN,
    WITH_THINK, WITHOUT_THINK, COMPLETE_REASONING, MULTILINE_REASONING, ONLY_OPEN_TAG)."""
    assert channel_texts(tok, output, "qwen3") == (reasoning, content)


@pytest.mark.parametrize("opener", ["", "<think>"])
def test_qwen3_tool_call_ends_reasoning(tok: Tok, opener: str) -> None:
    """vLLM's TOOL_CALL_NO_THINK_END / TOOL_CALL_WITH_THINK_NO_END (test_qwen3_reasoning_
    parser.py): `<tool_call>` without `</think>` ends the reasoning. Here the call's tags
    are markup and what they enclose is the tool_call channel."""
    text = opener + "I need to read the file.\n\n" + TOOL_CALL_BODY
    splitter = check(tok, text, reasoning_format("qwen3"))
    assert splitter.text("reasoning") == "I need to read the file.\n\n"
    after = [p.text for p in splitter.segments if p.channel != "reasoning"]
    assert "".join(after).removeprefix(opener) == TOOL_CALL_BODY
    assert splitter.text("tool_call") == TOOL_CALL_BODY[11:-12]
    assert splitter.text("content") == ""


@pytest.mark.parametrize(
    ("output", "content"),
    [
        ("This is plain content", "This is plain content"),
        ("I need to read the file.\n\n" + TOOL_CALL_BODY, "I need to read the file.\n\n"),
    ],
)
def test_qwen3_thinking_disabled(demo: Tok, output: str, content: str) -> None:
    """vLLM's THINKING_DISABLED_CASES (test_qwen3_reasoning_parser.py): with
    enable_thinking=False the reply starts as content."""
    splitter = check(demo, output, reasoning_format("qwen3", starts_in_reasoning=False))
    assert splitter.text("reasoning") == ""
    assert splitter.text("content") == content


@pytest.mark.parametrize(
    ("deltas", "reasoning", "content"),
    [
        (["<think>This is a reasoning section", "</think>", "This is the rest"],
         "This is a reasoning section", "This is the rest"),
        (["reasoning section", "</think>This is the rest"], "reasoning section",
         "This is the rest"),
        (["<think>reasoning</think>"], "reasoning", ""),
        (["reasoning section", "</think>content"], "reasoning section", "content"),
    ],
)  # fmt: skip
def test_qwen3_multi_token_deltas_from_vllm(deltas: list[str], reasoning: str, content: str):
    """vLLM's MULTI_TOKEN_DELTA_CASES (test_qwen3_reasoning_parser.py): a delta that holds
    a marker and text (speculative decoding) never leaks the marker into a channel."""
    pieces = split_channels([Segment(d, ()) for d in deltas], "qwen3")
    texts = {c: "".join(p.text for p in pieces if p.channel == c) for c in CHANNELS}
    assert (texts["reasoning"], texts["content"]) == (reasoning, content)
    assert texts["markup"] == "".join(deltas).replace(reasoning, "").replace(content, "")


START, RESPONSE = "Here is my thought process:", "Here is my response:"
GRANITE_CASES = [
    (f"{START}This is a reasoning section{RESPONSE}This is the rest",
     "This is a reasoning section", "This is the rest"),
    (f"{START}This is a reasoning section{RESPONSE}", "This is a reasoning section", ""),
    ("This is content", "", "This is content"),
    (f"{START}This\nThat{RESPONSE}This is the rest\nThat", "This\nThat",
     "This is the rest\nThat"),
]  # fmt: skip


@pytest.mark.parametrize(("output", "reasoning", "content"), GRANITE_CASES)
def test_granite_cases_from_vllm(tok: Tok, output: str, reasoning: str, content: str) -> None:
    """Ported from vLLM tests/reasoning/test_granite_reasoning_parser.py (TEST_CASES)."""
    assert channel_texts(tok, output, "granite") == (reasoning, content)


# vLLM test_granite_reasoning_parser.py STREAMING_1..13 (but 3, whose previous and
# current texts disagree): (previous text, delta, reasoning released, content released).
GRANITE_STREAMING = [
    ("", "Here", "", ""),
    ("Here is my thought", " failure", "", "Here is my thought failure"),
    ("Here is my thought", " process:", "", ""),
    ("Here is my thought process:", " foo", " foo", ""),
    ("Here is my thought process: foo", " Here is", " ", ""),
    ("Here is my thought process: foo Here is", " Here", "Here is ", ""),
    ("Here is my thought process: foo Here is my response:", " bar", "", " bar"),
    ("", "Here is my thought process: foo Here is my response: bar", " foo ", " bar"),
    ("Here is my thought process: foo", " bar Here is my response: baz", " bar ", " baz"),
    ("Here is my thought process: This is a reasoning section ", "Here", "", ""),
    ("Here is my thought process: foo Here is my response", ":", "", ""),
    ("Here is my thought process: foo Here", " was", "Here was", ""),
]


@pytest.mark.parametrize(("previous", "delta", "reasoning", "content"), GRANITE_STREAMING)
def test_granite_streaming_from_vllm(previous: str, delta: str, reasoning: str, content: str):
    """vLLM's Granite streaming subcases: what one delta releases, holding back exactly a
    possible marker start and giving it back when the marker breaks."""
    splitter = ChannelSplitter("granite")
    if previous:
        splitter.feed(Segment(previous, ()))
    out = splitter.feed(Segment(delta, ()))
    got = {c: "".join(p.text for p in out if p.channel == c) for c in CHANNELS}
    assert (got["reasoning"], got["content"]) == (reasoning, content)


# -- straddling tokens, real tokenizers -----------------------------------------------


def test_merged_dot_newline_straddles_the_end_marker(qwen2: Tok) -> None:
    """Qwen2 writes ".\\n" as one token: with END "\\n" its "." is reasoning and its "\\n"
    markup, each listed with its own byte range."""
    splitter = check(qwen2, "I think so.\nThe answer.", ReasoningFormat.from_markers("", "\n"))
    (last,) = [t for t in splitter.tokens("reasoning") if qwen2.piece(t.id) == b".\n"]
    (mark,) = [p for p in splitter.segments if p.channel == "markup"]
    assert (last.start, last.end) == (0, 1)
    assert [(t.index, t.start, t.end) for t in mark.tokens] == [(last.index, 1, 2)]


def test_marker_cut_across_tokens_and_straddling_content(qwen2: Tok) -> None:
    """`</think>The` is `</`, `think`, `>The`: the marker is cut across three tokens and
    the last one goes on into the content."""
    splitter = check(qwen2, "so.\n</think>The answer.", reasoning_format("deepseek_r1"))
    (mark,) = [p for p in splitter.segments if p.channel == "markup"]
    assert len(mark.tokens) == 3 and (mark.tokens[-1].start, mark.tokens[-1].end) == (0, 1)
    first = splitter.tokens("content")[0]
    assert (first.index, first.start, first.end) == (mark.tokens[-1].index, 1, 4)


def test_markers_cut_across_segments_one_char_each(demo: Tok) -> None:
    """Markers arriving one character per segment are found, and held only while they
    can still be one."""
    text = "<think>a < b</thinking></think>ok"
    pieces = split_channels([Segment(c, ()) for c in text], "deepseek_r1")
    assert joined(pieces) == oracle(text, reasoning_format("deepseek_r1"))
    assert joined(pieces)[1] == ("reasoning", "a < b</thinking>")


def test_logprobs_and_confidence_per_channel() -> None:
    """Each channel has its own tokens and confidence; a straddling token's logprob
    counts in each channel it fed."""
    from tokentrail import TokenSpan, confidence_of

    seg = Segment("ab</x>cd", (
        TokenSpan(0, 1, 0, 3, -0.1), TokenSpan(1, 2, 0, 3, -2.0), TokenSpan(2, 3, 0, 2, -0.5)
    ))  # fmt: skip
    splitter = ChannelSplitter(("", "</x>"))
    splitter.feed(seg)
    splitter.finish()
    assert splitter.text("reasoning") == "ab" and splitter.text("content") == "cd"
    assert splitter.tokens("reasoning") == [TokenSpan(0, 1, 0, 2, -0.1)]
    assert splitter.tokens("markup") == [TokenSpan(0, 1, 2, 3, -0.1), TokenSpan(1, 2, 0, 3, -2.0)]
    assert splitter.confidence("content") == confidence_of([TokenSpan(2, 3, 0, 2, -0.5)])
    assert splitter.segments[0].to_dict()["channel"] == "reasoning"


def test_unknown_parser_and_bad_markers() -> None:
    with pytest.raises(StructureError, match=r"unknown reasoning parser 'nope'.*deepseek_r1"):
        ChannelSplitter("nope")
    with pytest.raises(ValueError, match="end marker is empty"):
        ReasoningFormat.from_markers("<a>", "")
    with pytest.raises(StructureError, match="name, a ReasoningFormat"):
        reasoning_format(42)  # type: ignore[arg-type]
    assert set(REASONING_PARSERS) >= {"deepseek_r1", "qwen3", "mistral", "granite"}


def test_segment_that_cannot_be_split_keeps_its_tokens() -> None:
    """A segment whose text is not its bytes (U+FFFD) is cut by text at a marker, its
    tokens listed on both sides, as StopMatcher does."""
    from tokentrail import TokenSpan

    seg = Segment("\ufffd</t>x", (TokenSpan(0, 5, 0, 1), TokenSpan(1, 6, 0, 5)))
    pieces = split_channels([seg], ("", "</t>"))
    assert [(p.channel, p.text) for p in pieces] == [
        ("reasoning", "\ufffd"), ("markup", "</t>"), ("content", "x")
    ]  # fmt: skip
    assert all(p.tokens for p in pieces)


# -- property: random texts around markers ------------------------------------------------

FORMATS = [
    reasoning_format("deepseek_r1"),
    reasoning_format("qwen3"),
    reasoning_format("qwen3", starts_in_reasoning=False),
    reasoning_format("granite"),
    ReasoningFormat.from_markers("", "\n\n"),
    ReasoningFormat.from_markers("[[", "]]"),
]


def test_random_texts_around_markers(tok: Tok) -> None:
    hypothesis = require("hypothesis")
    st = hypothesis.strategies

    words = st.sampled_from(
        ["<think>", "</think>", "<", "</", "think", ">", "<tool_call>", "</tool_call>",
         "Here is my", " thought process:", "Here is my response:", "[[", "]", "]]", "\n",
         ".\n", " ", "é", "🙂", "你好", "Paris", " the", "<t", "x"]
    )  # fmt: skip

    @hypothesis.settings(max_examples=60, deadline=None)
    @hypothesis.given(st.lists(words, max_size=14), st.sampled_from(FORMATS))
    def run(parts: list[str], fmt: ReasoningFormat) -> None:
        check(tok, "".join(parts), fmt)

    run()


# -- real model output ------------------------------------------------------------------


@pytest.fixture(scope="module")
def replies() -> list[list[Segment]]:
    """A few demo-model replies (greedy, with logprobs) as the segments it streamed."""
    import tokentrail

    try:
        model, tokenizer = tokentrail.load()
    except Exception:  # no MLX here: the torch engine runs the same model
        require("torch")
        require("transformers")
        model, tokenizer = tokentrail.load(engine="torch")
    out = []
    for prompt in ["What is Python?", "Tell me about lists.", "Hello, how are you?"]:
        chat = [{"role": "user", "content": prompt}]
        responses = tokentrail.stream_generate(model, tokenizer, chat, max_tokens=60,
                                               top_logprobs=2)  # fmt: skip
        out.append([Segment(r.text, tuple(r.last_segment_tokens)) for r in responses])
    return out


def test_real_replies_split_by_markers_that_occur_in_them(
    replies: list[list[Segment]], demo: Tok
) -> None:
    """Markers picked from each reply, one cut across two tokens: every invariant holds
    on what the model really streamed, logprobs included."""
    for segments in replies:
        text = "".join(s.text for s in segments)
        spans = [t for s in segments for t in s.tokens]
        # A marker across a token boundary: the last 2 chars of one token + the next's first.
        pos, cut = 0, ""
        for prev, seg in itertools.pairwise(segments):
            pos += len(prev.text)
            if (
                pos > 10
                and len(prev.text) >= 2
                and seg.text
                and text.find(text[pos - 2 : pos + 1]) == pos - 2
            ):
                cut = text[pos - 2 : pos + 1]
                break
        assert cut, text
        start = next(w for w in text[: pos - 2].split() if len(w) > 2)
        both = (ReasoningFormat.from_markers("", cut), ReasoningFormat.from_markers(start, cut))
        for fmt in both:
            splitter = ChannelSplitter(fmt)
            pieces = [p for s in segments for p in splitter.feed(s)] + splitter.finish()
            assert "".join(p.text for p in pieces) == text
            assert joined(pieces) == oracle(text, fmt)
            for p in pieces:
                got = b"".join(demo.piece(t.id)[t.start : t.end] for t in p.tokens)
                assert got == p.text.encode()
                assert all(t.logprob is not None for t in p.tokens)
            marks = [p for p in pieces if p.channel == "markup" and p.text == cut]
            assert marks and len({t.index for t in marks[0].tokens}) == 2
            assert {t.index for p in pieces for t in p.tokens} == {t.index for t in spans}
            assert splitter.confidence("reasoning") is not None
