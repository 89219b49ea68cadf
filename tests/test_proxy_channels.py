"""The upstream's OWN channels through `tokentrail serve --upstream URL --upstream-chat`
(issue 18 §5): vLLM's reasoning parser runs upstream, the proxy attributes its output
per token with the channel its text arrived in.

vLLM runs for real on CPU (as in tests/test_vllm_server.py) with ``--reasoning-parser
deepseek_r1``. vLLM's parser needs ``<think>`` and ``</think>`` tokens in the vocabulary
(vllm/reasoning/basic_parsers.py raises without them) and SmolLM2 has none, so the model
folder here is SmolLM2's with two unused special tokens (``<repo_name>``, ids 3 and 4)
renamed ``<think>`` / ``</think>`` in its tokenizer.json: the weights are the same. Its
chat template does not open a ``<think>``, so vLLM's DeepSeek-R1 parser takes what comes
before ``</think>`` as reasoning (vllm/reasoning/deepseek_r1_reasoning_parser.py); a
``logit_bias`` on id 4 makes the model write ``</think>`` after a few words (greedy).

Oracles: the same request straight to vLLM (its ``return_token_ids`` and its own
``reasoning`` / ``content`` split); the tokenizer's own pieces for the bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.env import require
from tests.helpers.net import free_port
from tests.helpers.servers import Server, launch, start_server
from tests.test_vllm_server import ENGINE_ARGS, NAME, VLLM_ENV, VLLM_STARTUP, vllm_python

require("uvicorn")
openai = require("openai")

END = 4  # the id renamed </think>
MESSAGES = [{"role": "user", "content": "Think step by step: what is 2+3?"}]
#: Greedy, with a bias that makes </think> come after some 15 tokens of reasoning.
BODY: dict[str, Any] = {"temperature": 0, "max_tokens": 20, "logit_bias": {str(END): 22}}


@pytest.fixture(scope="module")
def think_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's folder with ids 3 and 4 renamed <think> and </think> (see the module)."""
    import subprocess

    from tests.test_vllm_server import FOLDER, REPO

    vpy = vllm_python()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run(
        [str(vpy), "-c", FOLDER], capture_output=True, text=True, timeout=900, cwd=REPO, env=env
    )
    if out.returncode != 0:
        pytest.fail(f"no SmolLM2 folder for vLLM:\n{out.stderr[-3000:]}")
    src = Path(out.stdout.strip().splitlines()[-1])
    dst = tmp_path_factory.mktemp("smollm2-think")
    for f in src.iterdir():
        if f.name != "tokenizer.json":
            (dst / f.name).symlink_to(f)
    tok = json.loads((src / "tokenizer.json").read_text())
    names = {3: "<think>", 4: "</think>"}
    vocab = tok["model"]["vocab"]
    for t in tok["added_tokens"]:
        if t["id"] in names:
            del vocab[t["content"]]
            t["content"], t["special"] = names[t["id"]], False
            vocab[t["content"]] = t["id"]
    (dst / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    return dst


@pytest.fixture(scope="module")
def vllm(think_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    cmd = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", str(think_dir), "--served-model-name", NAME]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", ENGINE_ARGS["dtype"]]
    cmd += ["--max-model-len", str(ENGINE_ARGS["max_model_len"]), "--enforce-eager"]
    cmd += ["--reasoning-parser", "deepseek_r1"]
    cmd += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    log = tmp_path_factory.mktemp("logs") / "vllm.log"
    url = f"http://127.0.0.1:{port}"
    server = launch(cmd, log, url, path="/v1/models", timeout=VLLM_STARTUP, env=VLLM_ENV)
    server.model, server.model_dir = NAME, think_dir
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(vllm: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "proxy.log"
    args = ("--upstream", vllm.url, "--tokenizer", str(vllm.model_dir), "--upstream-chat")
    server = start_server(None, log, *args, log_level="info")
    yield server
    server.stop()


def straight(vllm: Server, **extra: Any) -> list[dict[str, Any]]:
    """The same request streamed straight from vLLM, with its token ids: its chunks."""
    body = {"model": NAME, "messages": MESSAGES, **BODY, "stream": True,
            "return_token_ids": True, **extra}  # fmt: skip
    body = {k: v for k, v in body.items() if v != {}}
    chunks = []
    with httpx.stream("POST", vllm.url + "/v1/chat/completions", json=body, timeout=600) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                chunks.append(json.loads(line[5:]))
    return chunks


def client(server: Server) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def tokens_by_index(segments: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for seg in segments:
        for t in seg["tokens"] or []:
            out.setdefault(t["index"], t)
    return out


def segments_of(chunk: Any) -> list[dict[str, Any]]:
    """A chunk's extension segments (the usage chunk has none)."""
    return list((chunk.model_extra.get("tokentrail") or {}).get("segments") or [])


def channel_bytes(segments: list[dict[str, Any]], channel: str) -> bytes:
    return b"".join(
        bytes(t["bytes"])[t["start"] : t["end"]]
        for s in segments
        if s["channel"] == channel
        for t in s["tokens"]
    )


def test_vllm_reasoning_channels_are_attributed_per_token(proxy: Server, vllm: Server) -> None:
    from transformers import PreTrainedTokenizerFast

    chunks = list(
        client(proxy).chat.completions.create(
            model=NAME, messages=MESSAGES, stream=True, logprobs=True, top_logprobs=2,
            extra_body={"logit_bias": BODY["logit_bias"]}, temperature=0, max_tokens=20,
        )
    )  # fmt: skip
    segments = [s for c in chunks for s in segments_of(c)]
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                        for c in chunks if c.choices)  # fmt: skip
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # vLLM's own split of the same greedy request is the oracle for the texts ...
    own = straight(vllm)
    own_reasoning = "".join(c["choices"][0]["delta"].get("reasoning") or ""
                            for c in own if c["choices"])  # fmt: skip
    own_content = "".join(c["choices"][0]["delta"].get("content") or ""
                          for c in own if c["choices"])  # fmt: skip
    assert reasoning == own_reasoning and reasoning
    assert content == own_content
    # ... and its return_token_ids for the ids, every one listed once, in order.
    own_ids = [i for c in own if c["choices"] for i in c["choices"][0].get("token_ids") or []]
    listed = tokens_by_index(segments)
    assert sorted(listed) == list(range(len(own_ids)))
    assert [listed[k]["id"] for k in range(len(own_ids))] == own_ids
    # Per channel, the tokens' byte ranges join to exactly that channel's text, and each
    # token's bytes are the tokenizer's own.
    assert channel_bytes(segments, "reasoning").decode() == reasoning
    assert channel_bytes(segments, "content").decode() == content
    tok = PreTrainedTokenizerFast(tokenizer_file=str(vllm.model_dir / "tokenizer.json"))
    for t in listed.values():
        assert tok.decode([t["id"]]) == bytes(t["bytes"]).decode("utf-8", "replace")
    # The </think> that ended the reasoning is in neither text: markup.
    first_end = own_ids.index(END)
    at_end = {s["channel"] for s in segments if any(t["index"] == first_end for t in s["tokens"])}
    assert at_end == {"markup"}
    # A chunk whose delta is reasoning lists its tokens under channel reasoning.
    for c in chunks:
        if c.choices and (c.choices[0].delta.model_extra or {}).get("reasoning_content"):
            chans = {s["channel"] for s in segments_of(c)}
            assert chans == {"reasoning"}
    # logprobs.content: the content's tokens only; logprobs.reasoning_content: the reasoning's.
    lp_content = [e for c in chunks if c.choices and c.choices[0].logprobs
                  for e in c.choices[0].logprobs.content or []]  # fmt: skip
    assert b"".join(bytes(e.bytes) for e in lp_content).decode() == content
    lp_reasoning = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in (c.choices[0].logprobs.model_extra or {}).get("reasoning_content") or []
    ]
    assert b"".join(bytes(e["bytes"]) for e in lp_reasoning).decode() == reasoning


def test_vllm_reasoning_whole_response_matches_vllms_own(proxy: Server, vllm: Server) -> None:
    r = client(proxy).chat.completions.create(
        model=NAME, messages=MESSAGES, logprobs=True,
        extra_body={"logit_bias": BODY["logit_bias"]}, temperature=0, max_tokens=20,
    )  # fmt: skip
    own = httpx.post(
        vllm.url + "/v1/chat/completions",
        json={"model": NAME, "messages": MESSAGES, **BODY},
        timeout=600,
    ).json()["choices"][0]
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == own["message"]["reasoning"]
    assert msg.content == own["message"]["content"]
    assert r.choices[0].finish_reason == own["finish_reason"]
    segments = r.model_extra["tokentrail"]["segments"]
    assert channel_bytes(segments, "reasoning").decode() == own["message"]["reasoning"]
    assert channel_bytes(segments, "content").decode() == (own["message"]["content"] or "")
    assert r.usage is not None and r.usage.completion_tokens == len(tokens_by_index(segments))


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
#: An earlier turn with </think> in it: vLLM's DeepSeek-R1 parser then takes the reasoning
#: as ended (it looks for the end token in the prompt), so the tool call's structured
#: output starts at once.
TOOL_MESSAGES = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello</think>Hello!"},
    {"role": "user", "content": "What is the weather in Paris?"},
]


def pointer(doc: Any, path: str) -> Any:
    for raw in path.split("/")[1:]:
        key = raw.replace("~1", "/").replace("~0", "~")
        doc = doc[int(key)] if isinstance(doc, list) else doc[key]
    return doc


def test_vllm_tool_call_is_listed_as_its_raw_text_with_fields(proxy: Server, vllm: Server) -> None:
    kw: dict[str, Any] = {"tools": TOOLS, "tool_choice": "required", "max_tokens": 60}
    own = straight(vllm, messages=TOOL_MESSAGES, logit_bias={}, **kw)
    own_ids = [i for c in own if c["choices"] for i in c["choices"][0].get("token_ids") or []]
    own_pieces = [
        p for c in own if c["choices"] for p in c["choices"][0]["delta"].get("tool_calls") or []
    ]
    own_name = next(p["function"]["name"] for p in own_pieces if p["function"].get("name"))
    own_args = "".join(p["function"].get("arguments") or "" for p in own_pieces)
    chunks = list(
        client(proxy).chat.completions.create(
            model=NAME, messages=TOOL_MESSAGES, stream=True, logprobs=True, temperature=0, **kw
        )
    )
    pieces = [p for c in chunks if c.choices for p in c.choices[0].delta.tool_calls or []]
    assert pieces[0].function.name == own_name
    assert "".join(p.function.arguments or "" for p in pieces) == own_args
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    segments = [s for c in chunks for s in segments_of(c)]
    listed = tokens_by_index(segments)
    assert [listed[k]["id"] for k in sorted(listed)] == own_ids
    raw = channel_bytes(segments, "tool_call").decode()
    # The tool_call channel is the text vLLM parsed the call from: its own tokens' text
    # (the tokenizer's decode) but for the end token, which is markup.
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(vllm.model_dir / "tokenizer.json"))
    assert raw == tok.decode(own_ids, skip_special_tokens=True)
    assert own_name in raw
    last = next(c for c in reversed(chunks) if c.choices).model_extra["tokentrail"]
    assert last["tool_calls"][0]["raw"] == raw
    assert last["tool_calls"][0]["name"] == own_name
    # Fields, as the main path lists a call's: its name first, then the arguments' leaves,
    # each value the parsed arguments' at its path; their tokens' byte ranges join to
    # their text.
    args = json.loads(own_args)
    name, *leaves = last["fields"]
    assert name["path"] == "/tool_calls/0/function/name" and name["value"] == own_name
    assert leaves
    for f in leaves:
        prefix = "/tool_calls/0/arguments"
        assert f["path"].startswith(prefix)
        assert f["value"] == pointer(args, f["path"][len(prefix) :])
    for f in last["fields"]:
        data = b"".join(
            bytes(listed[t["index"]]["bytes"])[t["start"] : t["end"]] for t in f["tokens"]
        )
        assert data.decode() == f["text"]


def test_upstream_chat_refuses_n_above_one(proxy: Server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client(proxy).chat.completions.create(model=NAME, messages=MESSAGES, n=2, max_tokens=2)
    assert e.value.body["param"] == "n"


# -- the labelling rule on the wire vLLM speaks, on SmolLM2's real vocabulary --

words = st.text(alphabet="abcdefghij ,.:<>/\n", min_size=1, max_size=12)


@pytest.fixture(scope="module")
def smol_vocab() -> Any:
    from tests.helpers.llamacpp import find_smollm2
    from tokentrail.vocab import load_vocab

    return load_vocab(find_smollm2())


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(parts=st.lists(st.tuples(st.sampled_from(["reasoning", "content", "markup"]), words),
                      min_size=1, max_size=6))  # fmt: skip
def test_tokens_are_labelled_with_the_field_their_text_came_in(
    smol_vocab: Any, parts: list[tuple[str, str]]
) -> None:
    """vLLM's stream shape (one token per chunk, its text in the field of its channel,
    markup tokens with an empty delta): per channel the listed bytes join to exactly the
    text sent in that field, and every markup token is listed as markup."""
    from tokentrail.realign.chat import ChannelTracker

    v = smol_vocab
    tracker = ChannelTracker(v)
    found = []
    want: dict[str, bytes] = {"reasoning": b"", "content": b"", "markup": b""}
    marks = []
    for channel, text in parts:
        ids = v.encode(text) if channel != "markup" else [2 if len(text) % 2 else END]
        for tid in ids:
            data = v.pieces[tid] or b""
            want[channel] += data
            delta = {} if channel == "markup" else {channel: data.decode("utf-8")}
            entry = {"token": data.decode("utf-8"), "logprob": -1.0, "bytes": list(data)}
            chunk = {"choices": [{"index": 0, "delta": delta, "token_ids": [tid],
                                  "logprobs": {"content": [entry]}}]}  # fmt: skip
            if channel == "markup":
                marks.append(len(tracker.tokens))
            found += tracker.feed(chunk)
    found += tracker.finish()
    for channel in ("reasoning", "content", "markup"):
        joined = b"".join(
            t.data[a:b] for p in found if p.channel == channel for t, a, b in p.tokens
        )
        assert joined == want[channel]
    labelled = {t.index: p.channel for p in found for t, _, _ in p.tokens}
    assert all(labelled[i] == "markup" for i in marks)


def test_text_without_token_data_is_listed_with_no_tokens_and_a_reason(smol_vocab: Any) -> None:
    """Deltas the upstream sent without logprobs (llama-server does so for tool calls
    while streaming) are never guessed: their part has tokens None and a reason, and the
    tokens that did come are still placed."""
    from tokentrail.realign.chat import ChannelTracker

    v = smol_vocab
    (tid,) = v.encode("Hi")
    tracker = ChannelTracker(v)
    entry = {"token": "Hi", "logprob": -0.5, "bytes": list(b"Hi")}
    found = tracker.feed({"choices": [{"index": 0, "delta": {"content": "Hi"},
                                       "logprobs": {"content": [entry]}}]})  # fmt: skip
    found += tracker.feed({"choices": [{"index": 0, "delta": {"reasoning_content": " there"}}]})
    found += tracker.finish()
    assert [(p.channel, p.text) for p in found] == [("content", "Hi"), ("reasoning", " there")]
    assert [(t.id, a, b) for t, a, b in found[0].tokens] == [(tid, 0, 2)]
    assert found[1].tokens is None and "no logprobs" in (found[1].reason or "")


def test_the_upstreams_own_refusal_is_passed_on(proxy: Server, vllm: Server) -> None:
    """A request vLLM refuses (more tokens than its context) is its 400, message and all."""
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 100_000}
    own = httpx.post(vllm.url + "/v1/chat/completions", json=body, timeout=600)
    assert own.status_code == 400
    with pytest.raises(openai.BadRequestError) as e:
        client(proxy).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=100_000)
    assert own.json()["error"]["message"][:40] in e.value.body["message"]
