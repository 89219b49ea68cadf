"""One output pipeline (issue 28), the ``--upstream-chat`` leg: for the same tokens, what
`serve --upstream URL --upstream-chat` writes (`ChatWriter` over `ChannelTracker`, fed
as `UpstreamChat`'s answer feeds them, streamed and whole) agrees field by field with the
library's streamed responses and the server's own chunks and response
(tests/test_output_pipeline.py builds those, from the same hypothesis replies).

The upstream is faked from the same token stream, in the shapes real upstreams send:

- vLLM, streamed (`chat_body` asks it for ``return_token_ids``): one chunk per token with
  its ``token_ids`` and one ``logprobs.content`` entry, a first chunk with the role and
  empty content, the end token last with the finish reason, then the usage chunk, as in
  tests/helpers/recordings/formats.py `vllm_chat` (tests/data/realign/
  vllm_chat_return_token_ids.jsonl); the text a token completes goes in the delta field
  of its channel (``reasoning``, as vLLM >= 0.17 names it, or ``reasoning_content``;
  ``content``), markup tokens get an empty delta and call tokens ``delta.tool_calls``
  pieces (the name once written, then the arguments' text as it is written), as
  tests/test_proxy_channels.py's stream-shape property describes; the text is cut at
  complete characters, as vLLM's incremental detokenizer sends it;
- llama-server, a request with tools: sent whole (``stream`` false, as `chat_body` asks:
  llama-server refuses logprobs on a streamed request with tools), one response whose
  ``logprobs.content`` entries carry llama.cpp's ``id``, ``token``, ``bytes`` and
  ``top_logprobs`` (each with its ``id``) for every token but the end token, as in the
  real recordings tests/data/realign/llamacpp_demo/llamacpp_v1_chat_*_t0.jsonl (made by
  llama-server from this demo model: no entry for the end token), with its parsed
  ``reasoning_content``, ``content`` and ``tool_calls`` in the message.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_output_pipeline import EOS, PROSE, Views, demo, replies, views
from tokentrail.output.processor import merged_tool_deltas

__all__ = ["demo"]  # the fixture, shared with tests/test_output_pipeline.py

TOP = 2  # alternatives asked for (the other views' GenRequest asks for 2)


@dataclass(frozen=True)
class Call:
    """One call in the reply: its index, name and arguments, and the char ranges (in
    the whole text) of its text, its name's JSON string and its arguments' JSON text."""

    n: int
    name: str
    arguments: dict[str, Any]
    span: tuple[int, int]
    name_span: tuple[int, int]
    args_span: tuple[int, int]


def layout(
    reply: Any, think: str | None
) -> tuple[str, list[str], list[Call]]:
    """The reply's text, each character's channel (markup, reasoning, content, tool) as
    the upstream's reasoning and tool-call parsers split it, and its calls."""
    kind, body, content, calls = reply
    text, chars = "", []

    def add(piece: str, channel: str) -> tuple[int, int]:
        nonlocal text
        a = len(text)
        text += piece
        chars.extend([channel] * len(piece))
        return a, len(text)

    if think is not None:
        add("<think>", "markup")
        add(think, "reasoning")
        add("</think>", "markup")
    found = []
    if kind == "json":
        add(body, "content")
    elif kind == "hermes":
        add(content, "content")
        for n, (name, args) in enumerate(calls):
            a = add("<tool_call>\n{\"name\": ", "tool")[0]
            name_span = add(json.dumps(name), "tool")
            add(", \"arguments\": ", "tool")
            args_span = add(json.dumps(args), "tool")
            b = add("}\n</tool_call>", "tool")[1]
            found.append(Call(n, name, args, (a, b), name_span, args_span))
    else:  # llama3_json: the reply is the call
        (name, args), = calls
        a = add("{\"name\": ", "tool")[0]
        name_span = add(json.dumps(name), "tool")
        add(", \"parameters\": ", "tool")
        args_span = add(json.dumps(args), "tool")
        b = add("}", "tool")[1]
        found.append(Call(0, name, args, (a, b), name_span, args_span))
    assert text == (body if think is None else f"<think>{think}</think>{body}")
    return text, chars, found


def _vllm_token(data: bytes) -> str:
    """vLLM's token string: the token's bytes decoded alone."""
    return data.decode("utf-8", "replace")


def _entry(vocab: Any, step: Any, with_ids: bool) -> dict[str, Any]:
    data = vocab.pieces[step.token] or b""
    out: dict[str, Any] = {"token": _vllm_token(data), "logprob": step.logprob,
                           "bytes": list(data)}  # fmt: skip
    top = []
    for tid, lp in step.top_logprobs[:TOP]:
        alt = vocab.pieces[tid] or b""
        top.append({"token": _vllm_token(alt), "logprob": lp, "bytes": list(alt)})
        if with_ids:
            top[-1] = {"id": tid, **top[-1]}
    out["top_logprobs"] = top
    return {"id": step.token, **out} if with_ids else out


def _envelope() -> dict[str, Any]:
    return {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1700000000,
            "model": "demo"}  # fmt: skip


def vllm_stream(
    vocab: Any, v: Views, reply: Any, think: str | None, eos: bool, reasoning_key: str
) -> list[dict[str, Any]]:
    """vLLM's streamed chunks for the reply's tokens (see the module)."""
    text, chars, calls = layout(reply, think)
    dec = codecs.getincrementaldecoder("utf-8")()
    at = 0
    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}  # fmt: skip
    chunks = [{**_envelope(), "choices": [first]}]
    for k, step in enumerate(v.steps):
        tid = step.token
        data = b"" if tid in vocab.special else vocab.pieces[tid] or b""
        new = dec.decode(data, final=k == len(v.steps) - 1)
        c0, c1 = at, at + len(new)
        at = c1
        assert text[c0:c1] == new
        delta: dict[str, Any] = {}
        said = {ch: "".join(text[i] for i in range(c0, c1) if chars[i] == ch)
                for ch in ("reasoning", "content")}  # fmt: skip
        if said["reasoning"]:
            delta[reasoning_key] = said["reasoning"]
        if said["content"]:
            delta["content"] = said["content"]
        pieces = []
        for c in calls:
            if c0 < c.name_span[1] <= c1:
                pieces.append({"index": c.n, "id": f"chatcmpl-tool-{c.n}", "type": "function",
                               "function": {"name": c.name}})  # fmt: skip
            a, b = max(c0, c.args_span[0]), min(c1, c.args_span[1])
            if a < b:
                pieces.append({"index": c.n, "function": {"arguments": text[a:b]}})
        if pieces:
            delta["tool_calls"] = pieces
        last = k == len(v.steps) - 1
        finish = None if not last else "tool_calls" if calls else "stop" if eos else "length"
        choice = {"index": 0, "delta": delta, "logprobs": {"content": [_entry(vocab, step, False)]},
                  "finish_reason": finish, "token_ids": [tid]}  # fmt: skip
        chunks.append({**_envelope(), "choices": [choice]})
    n = len(v.steps)
    usage = {"prompt_tokens": 9, "completion_tokens": n, "total_tokens": 9 + n}
    chunks.append({**_envelope(), "choices": [], "usage": usage})
    return chunks


def llama_whole(vocab: Any, v: Views, reply: Any, think: str | None) -> list[dict[str, Any]]:
    """llama-server's whole response to a request with tools (see the module): one chunk."""
    _kind, _body, content, calls = reply
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if think is not None:
        message["reasoning_content"] = think
    message["tool_calls"] = [
        {"type": "function", "function": {"name": n, "arguments": json.dumps(a)},
         "id": f"call{k}"}
        for k, (n, a) in enumerate(calls)
    ]  # fmt: skip
    entries = [_entry(vocab, s, True) for s in v.steps if s.token != EOS]
    n = len(v.steps)
    return [{
        **_envelope(), "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "logprobs": {"content": entries},
                     "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": n, "total_tokens": 9 + n},
    }]  # fmt: skip


@dataclass(frozen=True)
class ChatViews:
    """What ``--upstream-chat`` writes for one upstream answer: its chunks (the usage
    chunk left out) and its whole response."""

    chunks: list[dict[str, Any]]
    whole: dict[str, Any]


def through_proxy(vocab: Any, upstream: list[dict[str, Any]]) -> ChatViews:
    """`upstream` read as `UpstreamChat`'s answer reads it: each chunk through
    `read_chunk`, the rest through `finish` when no finish reason came, into our chunks
    (one writer and tracker) and, with another, the whole response."""
    from tokentrail.realign.chat import ChannelTracker
    from tokentrail.server.chat_writer import ChatWriter, read_chunk

    payload = {"logprobs": True, "top_logprobs": TOP}
    out = []
    for stream in (True, False):
        tracker, writer = ChannelTracker(vocab), ChatWriter(vocab, payload, "m", "chatcmpl-x")
        events = [read_chunk(tracker, c) for c in upstream]
        if tracker.finish_reason is None:
            events.append((None, tracker.finish()))
        if stream:
            made = [writer.event(tracker, choice, parts) for choice, parts in events]
            out.append([c for c in made if c is not None and c["choices"]])
        else:
            out.append(writer.response(tracker, [p for _, ps in events for p in ps]))
    return ChatViews(out[0], out[1])


def _tokens(segments: list[dict[str, Any]], channel: str) -> list[tuple[int, int, int, int]]:
    """(index, id, start, end) of a channel's tokens, in order, a token's ranges in
    consecutive segments joined (the main path cuts one at a character its next token
    completes, each part in the step that made it final; the upstream-chat view at the
    text fragments the upstream sent). A token with an empty range there wrote nothing
    into the channel (the main path lists the end token so, in the channel it ends).
    Without channels the main path's text is content."""
    out: list[tuple[int, int, int, int]] = []
    for g in segments:
        if g.get("channel", "content") != channel:
            continue
        for t in g["tokens"] or []:
            if t["end"] <= t["start"]:
                continue
            if out and out[-1][0] == t["index"] and out[-1][3] == t["start"]:
                out[-1] = (*out[-1][:3], t["end"])
            else:
                out.append((t["index"], t["id"], t["start"], t["end"]))
    return out


def _no_display(token: dict[str, Any]) -> dict[str, Any]:
    """A segment token without its alternatives' `display`: what choosing one would have
    shown after the bytes held before it is the aligner's to say; the upstream-chat view
    has no aligner (its `display` is the alternative's text)."""
    out = dict(token)
    if "top_logprobs" in out:
        out["top_logprobs"] = [{k: x for k, x in a.items() if k != "display"}
                               for a in out["top_logprobs"]]  # fmt: skip
    return out


def _no_offsets(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fields without `start`/`end`, the main path's character offsets in the text its
    tool parser read: the upstream's parser read text the proxy does not have."""
    return [{k: x for k, x in f.items() if k not in ("start", "end")} for f in found]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    reply=replies(),
    think=st.one_of(st.none(), PROSE),
    seed=st.integers(0, 99),
    eos=st.booleans(),
    dialect=st.sampled_from(["vllm", "llamacpp"]),
    key=st.sampled_from(["reasoning", "reasoning_content"]),
)
def test_upstream_chat_agrees_with_the_other_views(
    demo: Any, reply: Any, think: str | None, seed: int, eos: bool, dialect: str, key: str
) -> None:
    from tokentrail.prompting import vocab_for

    kind, _body, content, calls = reply
    parser = None if kind == "json" else kind
    v = views(demo, reply, think, seed, eos)
    vocab = vocab_for(demo[1])
    whole_upstream = dialect == "llamacpp" and parser is not None
    upstream = (
        llama_whole(vocab, v, reply, think)
        if whole_upstream
        else vllm_stream(vocab, v, reply, think, eos, key)
    )
    chat = through_proxy(vocab, upstream)
    main_msg = v.whole["choices"][0]["message"]
    msg = chat.whole["choices"][0]["message"]
    deltas = [c["choices"][0]["delta"] for c in chat.chunks]
    ext = chat.whole["tokentrail"]
    last = chat.chunks[-1]

    # reasoning: the one written, streamed (under both names) and whole, as the main path's
    lib_reasoning = "".join(r.reasoning_text for r in v.lib)
    assert "".join(d.get("reasoning", "") for d in deltas) == lib_reasoning
    assert "".join(d.get("reasoning_content", "") for d in deltas) == lib_reasoning
    assert msg["reasoning"] == msg["reasoning_content"] == main_msg.get("reasoning")
    assert (msg["reasoning"] or "") == (think or "")

    # content: around the calls, or the JSON object, as the main path's
    lib_content = "".join(r.content_text for r in v.lib) if parser else main_msg["content"]
    assert lib_content == content
    assert "".join(d.get("content") or "" for d in deltas) == content
    assert msg["content"] == (content or None if calls else content)

    # tool calls: the ones written, streamed pieces == whole == the main path's
    want = [(n, a) for n, a in calls] if parser else []
    pieces = merged_tool_deltas([p for d in deltas for p in d.get("tool_calls", [])])
    for got in (pieces, msg.get("tool_calls", []), main_msg.get("tool_calls", [])):
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in got] == want  # fmt: skip
    assert [(c["name"], json.loads(c["arguments"])) for c in ext["tool_calls"]] == want
    assert last["tokentrail"]["tool_calls"] == ext["tool_calls"]
    finish = v.whole["choices"][0]["finish_reason"]
    assert chat.whole["choices"][0]["finish_reason"] == last["choices"][0]["finish_reason"]
    assert last["choices"][0]["finish_reason"] == finish

    # the extension's segments: streamed == whole; per channel the same tokens with the
    # same byte ranges as the main path's, each written by the same rule
    segments = [g for c in chat.chunks for g in c["tokentrail"]["segments"]]
    assert segments == ext["segments"]
    main_segments = v.whole["tokentrail"]["segments"]
    for channel in ("reasoning", "content"):
        assert _tokens(segments, channel) == _tokens(main_segments, channel), channel
    # the call's text: the main path's, and where no text comes between the reasoning's
    # end marker and the call (a reply that is only a call), the marker too: the upstream
    # sent nothing that tells the two apart (empty deltas, then the call's pieces)
    calls_here, calls_main = _tokens(segments, "tool_call"), _tokens(main_segments, "tool_call")
    marker = calls_here[: len(calls_here) - len(calls_main)]
    assert calls_here == marker + calls_main
    assert not marker or (think is not None and not content)
    markup_main = _tokens(main_segments, "markup")
    assert marker == markup_main[len(markup_main) - len(marker) :]
    # markup: the main path's markers; the end token too, here, whose bytes are in no
    # text field (the main path puts it, with no bytes, in the channel it ends)
    end = [(len(v.ids) - 1, EOS, 0, len(vocab.pieces[EOS] or b""))]
    assert _tokens(segments, "markup") == markup_main[: len(markup_main) - len(marker)] + (
        end if eos and not whole_upstream else []
    )
    if parser is not None:
        raw = "".join(g["text"] for g in segments if g["channel"] == "tool_call")
        marker_text = "</think>" if marker else ""
        main_raw = "".join(g["text"] for g in main_segments if g.get("channel") == "tool_call")
        assert raw == marker_text + main_raw
        assert ext["tool_calls"][0]["raw"] == (raw if len(calls) == 1 else None)
    main_tokens = {(t["index"], t["start"], t["end"]): t for g in main_segments
                   for t in g["tokens"]}  # fmt: skip
    logprob = {k: s.logprob for k, s in enumerate(v.steps)}
    for g in segments:
        for t in g["tokens"]:
            if (t["index"], t["start"], t["end"]) in main_tokens:
                assert _no_display(t) == _no_display(main_tokens[t["index"], t["start"], t["end"]])
        # the segment's confidence: its tokens' logprobs, each the engine's
        conf, lps = g["confidence"], [logprob[t["index"]] for t in g["tokens"]]
        assert conf["n_tokens"] == len(lps)
        assert conf["mean_logprob"] == pytest.approx(sum(lps) / len(lps))
        assert conf["min_logprob"] == min(lps)
    # every token once in some channel (llama-server sends no entry for the end token)
    listed = {t["index"] for g in segments for t in g["tokens"]}
    assert listed == set(range(len(v.ids) - (1 if eos and whole_upstream else 0)))

    # fields: the calls' name and argument leaves, with the same tokens, confidence and
    # alternatives as the main path's; a JSON object's content has none here (the
    # upstream's chat answer is its text: the proxy's `fields` stage does not run)
    main_fields = v.whole["tokentrail"].get("fields", [])
    if parser is not None:
        assert ext["fields"] == _no_offsets(main_fields)
        assert {f["path"] for f in ext["fields"]} >= {
            f"/tool_calls/{n}/function/name" for n in range(len(calls))
        }
    else:
        assert ext["fields"] == []
    assert last["tokentrail"]["fields"] == ext["fields"]

    # logprobs: streamed == whole; the same entries as the main path's (-inf written
    # -9999.0, a special alternative as "" with no bytes), but for the tokens that wrote
    # nothing into the content (the end token: markup here, listed in neither)
    def entries(choices: list[dict[str, Any]], k: str) -> list[Any]:
        return [e for c in choices for e in (c["logprobs"] or {}).get(k) or []]

    for k in ("content", "reasoning_content"):
        streamed = entries([c["choices"][0] for c in chat.chunks], k)
        whole = entries(chat.whole["choices"], k)
        main = [e for e in entries(v.whole["choices"], k) if e["bytes"] or e["token"]]
        assert streamed == whole == main, k
    every = entries(chat.whole["choices"], "content") + entries(
        chat.whole["choices"], "reasoning_content"
    )
    alts = [a["logprob"] for e in every for a in e["top_logprobs"]]
    assert all(x == -9999.0 or x > -100 for x in alts)
