"""Constraints, tool calls and reasoning through `tokentrail serve --upstream` (issue 18 §5).

The upstream is llama.cpp's own `llama-server` on SmolLM2-135M-Instruct (GGUF), started
here; the proxy in front of it is `tokentrail serve --upstream`; the client is the
official `openai` package. The upstream decodes under its own constraint fields
(`json_schema`, GBNF `grammar`, which `tokentrail.engines.upstream.constraints` asks
for); the proxy attributes the tokens and computes the fields. Oracles: `jsonschema`
validates the output, `json.loads` gives the values, and the same request straight to
llama-server gives the same text. (The vLLM case is in tests/test_vllm_server.py, next to
that module's vLLM server.)
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.env import require
from tests.helpers.llamacpp import find_smollm2, llama_server_binary
from tests.helpers.servers import DEMO_MODEL, Server, start_llama_server, start_server
from tokentrail.engines.upstream.constraints import gbnf_literal

require("uvicorn")
require("llguidance")
openai = require("openai")
jsonschema = require("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer"},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Give the city, population and capital flag of Paris."}]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    llama_server_binary()
    server = start_llama_server(find_smollm2(), tmp_path_factory.mktemp("logs") / "llama.log")
    yield server
    server.stop()


def start_proxy(llama: Server, log_dir: Any, *flags: str) -> Server:
    args = ("--upstream", llama.url, "--tokenizer", str(llama.model_dir), *flags)
    return start_server(None, log_dir / "proxy.log", *args)


@pytest.fixture(scope="module")
def proxy(llama: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_proxy(llama, tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


def client(server: Server) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def ext(obj: Any) -> dict[str, Any]:
    return obj.model_extra["tokentrail"]


def pointer(doc: Any, path: str) -> Any:
    """RFC 6901: the value at `path` in `doc`."""
    for raw in path.split("/")[1:]:
        key = raw.replace("~1", "/").replace("~0", "~")
        doc = doc[int(key)] if isinstance(doc, list) else doc[key]
    return doc


def token_bytes(exts: list[dict[str, Any]]) -> dict[int, bytes]:
    """Each generated token's whole bytes, by index, from the segments that list it."""
    out: dict[int, bytes] = {}
    for e in exts:
        for seg in e.get("segments") or []:
            for t in seg["tokens"]:
                out.setdefault(t["index"], bytes(t["bytes"]))
    return out


def assert_fields_join(fields: list[dict[str, Any]], exts: list[dict[str, Any]], doc: Any) -> None:
    """Every field's value is the parsed output's at its path, and its tokens' byte
    ranges join to exactly its text."""
    pieces = token_bytes(exts)
    for f in fields:
        assert f["value"] == pointer(doc, f["path"]), f
        joined = b"".join(pieces[t["index"]][t["start"] : t["end"]] for t in f["tokens"])
        assert joined.decode("utf-8") == f["text"], f
        assert json.loads(f["text"]) == f["value"]


def direct_chat(llama: Server, **body: Any) -> str:
    """The same chat request straight to llama-server (greedy): the oracle for the text."""
    r = httpx.post(
        llama.url + "/v1/chat/completions",
        json={"messages": MESSAGES, "temperature": 0, **body},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def chat(server: Server, messages: Any = MESSAGES, **kw: Any) -> Any:
    """The official client's greedy chat completion from `server`: the response, or the
    list of its chunks when `stream=True`."""
    out = client(server).chat.completions.create(
        model=server.model, messages=messages, temperature=0, **kw
    )
    return list(out) if kw.get("stream") else out


def test_json_schema_through_the_proxy_validates_and_has_fields(
    proxy: Server, llama: Server
) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    chunks = chat(
        proxy,
        max_tokens=80,
        response_format=fmt,
        logprobs=True,
        stream=True,
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    doc = json.loads(content)
    jsonschema.validate(doc, SCHEMA)
    assert content == direct_chat(llama, max_tokens=80, response_format=fmt)
    exts = [ext(c) for c in chunks if c.model_extra.get("tokentrail")]
    fields = [f for e in exts for f in e.get("fields") or []]
    assert sorted(f["path"] for f in fields) == ["/capital", "/city", "/population"]
    assert_fields_join(fields, exts, doc)
    # A boolean leaf has allowed values, but the upstream has no scorer: no
    # alternatives, and it says why (none are made up from top-k).
    (flag,) = [f for f in fields if f["path"] == "/capital"]
    assert flag["alternatives"] is None and flag["reason"]

    # Not streamed: the same text, all the fields at once.
    whole = chat(
        proxy,
        max_tokens=80,
        response_format=fmt,
    )
    assert whole.choices[0].message.content == content
    assert [f["path"] for f in ext(whole)["fields"]] == [f["path"] for f in fields]
    assert_fields_join(ext(whole)["fields"], [ext(whole)], doc)


def test_json_object_and_llamacpp_json_schema_field(proxy: Server) -> None:
    out = chat(
        proxy,
        max_tokens=60,
        response_format={"type": "json_object"},
    )
    doc = json.loads(out.choices[0].message.content)
    assert isinstance(doc, dict)
    assert_fields_join(ext(out)["fields"], [ext(out)], doc)
    # llama.cpp's own top-level `json_schema`, on completions.
    r = httpx.post(proxy.url + "/v1/completions", json={
        "prompt": "The city of Paris as JSON:", "max_tokens": 80, "temperature": 0,
        "json_schema": SCHEMA,
    }, timeout=300)  # fmt: skip
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), SCHEMA)


def test_choice_and_gbnf_grammar_through_the_proxy(proxy: Server, llama: Server) -> None:
    choices = ["yes", "no", 'it "depends"', "back\\slash\nline"]
    out = chat(
        proxy,
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert out.choices[0].message.content in choices
    e = ext(out)
    assert "".join(s["text"] for s in e["segments"]) == out.choices[0].message.content
    # llama-server's n_probs are the model's own under a grammar too (vLLM's are masked:
    # tests/test_vllm_server.py): the proxy says "raw".
    assert e["distribution"] == "raw"

    grammar = 'root ::= ("Paris" | "Lyon") " has " [0-9] [0-9]? [0-9]? " parks."'
    out = chat(
        proxy,
        max_tokens=20,
        extra_body={"grammar": grammar},
    )
    content = out.choices[0].message.content
    assert re.fullmatch(r"(Paris|Lyon) has [0-9]{1,3} parks\.", content), content
    assert content == direct_chat(llama, max_tokens=20, grammar=grammar)
    assert out.choices[0].finish_reason == "stop"


#: What llama-server cannot do: (request fields, the field named, a word of the reason).
REFUSED = [
    ({"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs", "regex"),
    ({"grammar": 'start: "a" | "b"'}, "grammar", "Lark"),
    ({"tokentrail": {"logprobs": "processed"}}, "tokentrail", "processed"),
]


@pytest.mark.parametrize(("extra", "param", "says"), REFUSED)
def test_what_llamacpp_cannot_do_is_refused_naming_the_field(
    llama: Server, extra: dict[str, Any], param: str, says: str
) -> None:
    """The engine refuses before anything goes upstream (a ConstraintError naming the
    request field), with the constraint compiled from the request as the server does."""
    from tokentrail.constrain import from_structured_outputs
    from tokentrail.constrain.spec import constraint_from
    from tokentrail.engines.upstream.engine import UpstreamEngine
    from tokentrail.errors import ConstraintError
    from tokentrail.sampling import SamplingParams

    engine = UpstreamEngine(llama.url, str(llama.model_dir))
    assert engine.dialect == "llamacpp"
    if "structured_outputs" in extra:
        params = SamplingParams(constraint=from_structured_outputs(extra["structured_outputs"]))
    elif "grammar" in extra:
        params = SamplingParams(constraint=constraint_from(grammar=extra["grammar"], param=param))
    else:
        params = SamplingParams(logprobs_mode="processed")
    with pytest.raises(ConstraintError) as refused:
        engine.request([1, 2, 3], params, 8)
    assert refused.value.param == param and str(refused.value).startswith(param + ":")
    assert says in str(refused.value)
    # What it can do is the plain request with the upstream's own fields added.
    plain = engine.request([1, 2, 3], SamplingParams(), 8)
    schema = constraint_from(json_schema={"type": "object"})
    assert engine.request([1, 2, 3], SamplingParams(constraint=schema), 8) == (
        plain[0], {**plain[1], "json_schema": {"type": "object"}},
    )  # fmt: skip
    engine.close()


@pytest.mark.parametrize(("extra", "param", "says"), REFUSED[:1])
def test_what_llamacpp_cannot_do_is_a_400_naming_the_field(
    proxy: Server, extra: dict[str, Any], param: str, says: str
) -> None:
    r = httpx.post(proxy.url + "/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 8, **extra,
    }, timeout=10)  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"].startswith("the model rejected the request: " + param), error
    assert error["param"] == param
    assert says in error["message"]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_tool_choice_required_is_constrained_upstream_and_parsed_here(proxy: Server) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = chat(
        proxy,
        messages=messages,
        max_tokens=60,
        tools=[WEATHER],
        tool_choice="required",
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    paths = {f["path"]: f for f in ext(out)["fields"]}
    assert paths["/tool_calls/0/function/name"]["value"] == "get_weather"
    assert paths["/tool_calls/0/arguments/city"]["value"] == args["city"]

    # Streamed: OpenAI's delta.tool_calls, read by the official client.
    chunks = chat(
        proxy,
        messages=messages,
        max_tokens=60,
        tools=[WEATHER],
        tool_choice="required",
        stream=True,
    )
    pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert pieces and pieces[0].function.name == "get_weather"
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments


@pytest.fixture(scope="module")
def marked(llama: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A proxy whose `--reasoning-markers '' END` split SmolLM2's own greedy reply: the
    reasoning runs from the start to END, a word in the middle of that reply."""
    reply = direct_chat(llama, max_tokens=40)
    words = reply.split()
    assert len(words) >= 6, reply
    end = " " + words[3]
    assert reply.count(end) >= 1
    server = start_proxy(llama, tmp_path_factory.mktemp("logs"), "--reasoning-markers", "", end)
    yield server, reply, end
    server.stop()


def test_reasoning_markers_on_the_proxy_split_the_upstreams_tokens(marked: Any) -> None:
    server, reply, end = marked
    chunks = chat(
        server,
        max_tokens=40,
        logprobs=True,
        stream=True,
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    before, after = reply.split(end, 1)
    assert (reasoning, content) == (before, after)
    # Per channel, the tokens' bytes join to exactly that channel's text.
    exts = [ext(c) for c in chunks if c.model_extra.get("tokentrail")]
    pieces = token_bytes(exts)
    for channel, text in (("reasoning", before), ("markup", end), ("content", after)):
        segs = [s for e in exts for s in e["segments"] if s.get("channel") == channel]
        assert "".join(s["text"] for s in segs) == text
        joined = b"".join(
            pieces[t["index"]][t["start"] : t["end"]] for s in segs for t in s["tokens"]
        )
        assert joined.decode("utf-8") == text


# -- the choice as GBNF, read back by llguidance's GBNF reader (no server) --------------------


@pytest.fixture(scope="module")
def demo_tokenizer() -> Any:
    transformers = require("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(DEMO_MODEL))


def gbnf_accepts(tokenizer: Any, grammar: str, text: str) -> bool:
    """Whether llguidance, reading `grammar` as GBNF, accepts exactly `text`."""
    import llguidance as llg

    from tokentrail.constrain.lltokenizer import lltokenizer_for

    matcher = llg.LLMatcher(lltokenizer_for(tokenizer), llg.grammar_from("grammar", grammar))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return bool(matcher.consume_tokens(ids)) and matcher.is_accepting()


@settings(max_examples=40, deadline=None)
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1))
def test_a_choice_literal_in_gbnf_matches_exactly_its_string(
    demo_tokenizer: Any, text: str
) -> None:
    grammar = "root ::= " + gbnf_literal(text)
    assert gbnf_accepts(demo_tokenizer, grammar, text)
    assert not gbnf_accepts(demo_tokenizer, grammar, text + "x")


# -- tokentrail serve as the upstream: the same spec, passed on --------------------------------


@pytest.fixture(scope="module")
def tt_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    """`tokentrail serve` on the demo model, and a proxy in front of it."""
    require("mlx_lm", "the demo upstream runs on MLX")
    logs = tmp_path_factory.mktemp("logs")
    upstream = start_server(None, logs / "tt-upstream.log")
    proxy = start_server(
        None, logs / "tt-proxy.log", "--upstream", upstream.url, "--tokenizer", str(DEMO_MODEL)
    )
    yield upstream, proxy
    proxy.stop()
    upstream.stop()


def test_a_tokentrail_upstream_decodes_the_same_spec(tt_pair: Any) -> None:
    upstream, proxy = tt_pair
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "big"]}},
        "required": ["ok", "size"],
        "additionalProperties": False,
    }
    body = {
        "messages": [{"role": "user", "content": "Is Paris big?"}],
        "max_tokens": 30,
        "temperature": 0,
        "structured_outputs": {"json": schema},
    }
    theirs = httpx.post(upstream.url + "/v1/chat/completions", json=body, timeout=300).json()
    ours = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=300).json()
    content = ours["choices"][0]["message"]["content"]
    assert content == theirs["choices"][0]["message"]["content"]
    doc = json.loads(content)
    jsonschema.validate(doc, schema)
    assert [f["path"] for f in ours["tokentrail"]["fields"]] == ["/ok", "/size"]
    assert_fields_join(ours["tokentrail"]["fields"], [ours["tokentrail"]], doc)
    # MLX reports the model's own logprobs under a constraint, and the proxy says so.
    assert ours["tokentrail"]["distribution"] == theirs["tokentrail"]["distribution"] == "raw"


def test_a_tokentrail_upstream_s_processed_logprobs_are_passed_on_and_labelled(
    tt_pair: Any,
) -> None:
    """`tokentrail.logprobs` "processed" goes to a tokentrail upstream, and the
    distribution its frames name labels the proxy's tokens: the proxy's logprobs are the
    upstream's own for the same request (cooled and cut, so they differ from the raw
    ones), streamed and whole."""
    upstream, proxy = tt_pair
    body = {"messages": [{"role": "user", "content": "Tell me about Paris."}],
            "max_tokens": 12, "temperature": 0.7, "top_p": 0.9, "seed": 5,
            "logprobs": True, "top_logprobs": 3}  # fmt: skip
    processed = {**body, "tokentrail": {"logprobs": "processed"}}

    def lps(reply: dict[str, Any]) -> list[float]:
        return [e["logprob"] for e in reply["choices"][0]["logprobs"]["content"]]

    theirs = httpx.post(upstream.url + "/v1/chat/completions", json=processed, timeout=300).json()
    ours = httpx.post(proxy.url + "/v1/chat/completions", json=processed, timeout=300).json()
    raw = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=300).json()
    assert theirs["tokentrail"]["distribution"] == "processed"
    assert ours["tokentrail"]["distribution"] == "processed"
    assert raw["tokentrail"]["distribution"] == "raw"
    assert ours["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]
    assert lps(ours) == pytest.approx(lps(theirs), abs=1e-6)
    assert lps(raw) != pytest.approx(lps(ours), abs=1e-3)  # the two distributions differ
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", timeout=300,
                      json={**processed, "stream": True}) as r:  # fmt: skip
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]  # fmt: skip
    said = {c["tokentrail"]["distribution"] for c in chunks if c.get("tokentrail")}
    assert said == {"processed"}
