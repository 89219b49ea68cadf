"""The upstream dialect classes (`tokentrail.engines.upstream.dialects`), which the proxy's
engine and `tokentrail check` share:

- what each dialect asks for: a JSON schema as vLLM's ``structured_outputs``, as
  llama-server's ``json_schema`` on its own ``/completion``, refused (naming the request
  field) by plain OpenAI and mlx_lm.server upstreams; a per-request logprobs mode refused
  by every dialect (naming ``tokentrail``); ids without logprobs where vLLM and
  llama.cpp send them;
- the chat body each dialect adds to, given by name or as the object;
- detection from /v1/models' ``owned_by`` and the Server header, and a small local server
  (this file's own) on which the engine (``auto``) and the check pick the same dialect,
  read its slots from the right endpoint, and on which the check asks what the proxy
  asks.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.helpers.env import corpus_path, require
from tests.test_upstream_chat_front_door import send_json

httpx = require("httpx")

from tokentrail.constrain.spec import Constraint  # noqa: E402
from tokentrail.engines.batch import UPSTREAM_CAPACITY  # noqa: E402
from tokentrail.engines.upstream.chat import chat_body  # noqa: E402
from tokentrail.engines.upstream.dialects import (  # noqa: E402
    DIALECTS,
    VLLM_CAPACITY,
    CompletionAsk,
    UpstreamDialect,
    dialect_named,
    pick_dialect,
)
from tokentrail.errors import ConstraintError  # noqa: E402
from tokentrail.sampling import SamplingParams  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "src" / "tokentrail" / "demo_model"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
PYTHON_SERVER = "BaseHTTP/0.6 Python/3.12.3"  # how mlx_lm.server (http.server) answers


def constraint(kind: str, source: str, param: str = "response_format", **kw: Any) -> Constraint:
    return Constraint(kind, source, grammar="", param=param, **kw)


def ask(dialect: str, params: SamplingParams, max_tokens: int | None = 8) -> tuple[str, dict]:
    text = lambda ids: "text of " + " ".join(map(str, ids))  # noqa: E731
    return DIALECTS[dialect].completion_request(
        CompletionAsk([5, 6, 7], params, max_tokens, "m", text)
    )


# -- the flag's values --------------------------------------------------------------------------


def test_the_flag_keeps_its_values_and_names_match_the_registry() -> None:
    from tokentrail.engines.upstream.engine import DIALECT_CHOICES

    assert DIALECT_CHOICES == ("auto", "vllm", "llamacpp", "openai", "tokentrail", "mlx")
    for name, d in DIALECTS.items():
        assert isinstance(d, UpstreamDialect) and d.name == name
        assert dialect_named(name) is d and dialect_named(d) is d
    with pytest.raises(ValueError, match="unknown upstream dialect 'sglang'"):
        dialect_named("sglang")
    with pytest.raises(ValueError, match="auto"):
        dialect_named("auto")  # "auto" is detection, not a dialect


# -- constraints and logprobs modes -------------------------------------------------------------


def test_a_json_schema_in_each_dialects_own_fields() -> None:
    c = constraint("json_schema", json.dumps(SCHEMA))
    p = SamplingParams(constraint=c)
    for name in ("vllm", "tokentrail"):
        path, body = ask(name, p)
        assert path == "/v1/completions"
        assert body["structured_outputs"] == {"json": SCHEMA}
        assert "json_schema" not in body
    path, body = ask("llamacpp", p)
    assert path == "/completion" and body["json_schema"] == SCHEMA
    assert "structured_outputs" not in body and body["prompt"] == [5, 6, 7]
    for name in ("openai", "mlx"):
        with pytest.raises(ConstraintError, match=f"response_format: .*{name} dialect") as e:
            ask(name, p)
        assert e.value.param == "response_format"


def test_other_constraint_kinds_per_dialect() -> None:
    choice = constraint("choice", json.dumps(["yes", 'say "no"']), "structured_outputs")
    regex = constraint("regex", "[a-z]+", "structured_outputs")
    lark = constraint("grammar", 'start: "a" | "b"', "structured_outputs")
    obj = constraint("json_object", "")
    assert ask("vllm", SamplingParams(constraint=choice))[1]["structured_outputs"] == {
        "choice": ["yes", 'say "no"']
    }
    assert ask("tokentrail", SamplingParams(constraint=regex))[1]["structured_outputs"] == {
        "regex": "[a-z]+"
    }
    assert ask("vllm", SamplingParams(constraint=obj))[1]["structured_outputs"] == {
        "json_object": True
    }
    assert ask("llamacpp", SamplingParams(constraint=obj))[1]["json_schema"] == {"type": "object"}
    # A choice on llama.cpp: a GBNF alternation of the strings as quoted literals.
    grammar = ask("llamacpp", SamplingParams(constraint=choice))[1]["grammar"]
    assert grammar == 'root ::= "yes" | "say \\"no\\""'
    for c in (regex, lark):
        with pytest.raises(ConstraintError) as e:
            ask("llamacpp", SamplingParams(constraint=c))
        assert e.value.param == "structured_outputs"


def test_a_constraint_after_the_reasoning_is_refused_by_every_dialect() -> None:
    c = constraint("json_object", "", after=("</think>",))
    for name in DIALECTS:
        with pytest.raises(ConstraintError, match="reasoning") as e:
            ask(name, SamplingParams(constraint=c))
        assert e.value.param == "response_format"


def test_processed_logprobs_are_refused_naming_tokentrail_with_each_reason() -> None:
    reasons = {
        "vllm": "--logprobs-mode",
        "llamacpp": "n_probs",
        "openai": "openai dialect",
        "mlx": "mlx dialect",
    }
    # Another tokentrail takes the mode per request (and names it in its frames).
    assert set(reasons) | {"tokentrail"} == set(DIALECTS)
    _, body = ask("tokentrail", SamplingParams(logprobs_mode="processed"))
    assert body["tokentrail"] == {"logprobs": "processed"}
    assert DIALECTS["tokentrail"].request_fields(None, "raw") == {}
    for name, why in reasons.items():
        with pytest.raises(ConstraintError, match=why) as e:
            ask(name, SamplingParams(logprobs_mode="processed"))
        assert e.value.param == "tokentrail"
        # Raw is every dialect's own: nothing is added.
        assert DIALECTS[name].request_fields(None, "raw") == {}


def test_what_each_dialect_asks_for_the_ids() -> None:
    wanted, none = SamplingParams(top_logprobs=3), SamplingParams(logprobs=False)
    _, body = ask("vllm", wanted)
    assert body["logprobs"] == 3 and body["return_token_ids"] is True
    assert body["return_tokens_as_token_ids"] is True and body["skip_special_tokens"] is False
    _, body = ask("vllm", none)  # vLLM's token ids need no logprobs
    assert "logprobs" not in body and body["return_token_ids"] is True
    _, body = ask("llamacpp", wanted)
    assert body["n_probs"] == 3 and body["return_tokens"] is True and body["n_predict"] == 8
    _, body = ask("llamacpp", none)
    assert "n_probs" not in body and body["return_tokens"] is True
    assert ask("llamacpp", none, None)[1]["n_predict"] == -1
    for name in ("openai", "tokentrail"):  # their ids need the logprobs
        _, body = ask(name, none)
        assert body["logprobs"] == 1 and "return_token_ids" not in body
    path, body = ask("mlx", wanted)  # no token-id prompt: text, sent whole
    assert path == "/v1/completions" and body["prompt"] == "text of 5 6 7"
    assert body["stream"] is False and body["top_logprobs"] == 3


def test_sampling_fields_per_dialect() -> None:
    p = SamplingParams(temp=0.5, top_k=0, min_p=0.2, repetition_penalty=1.1, seed=3)
    assert ask("vllm", p)[1]["top_k"] == -1  # vLLM's "no top-k"
    assert ask("tokentrail", p)[1]["top_k"] == 0
    assert "top_k" not in ask("openai", p)[1] and "top_k" not in ask("mlx", p)[1]
    assert ask("llamacpp", p)[1]["repeat_penalty"] == 1.1
    sampled = ask("llamacpp", p)[1]  # no filter stated as such: llama-server's defaults filter
    assert (sampled["top_k"], sampled["top_p"], sampled["min_p"]) == (0, 1.0, 0.2)
    # Greedy: the filters cannot change the choice, and llama-server's defaults are cheaper.
    greedy = ask("llamacpp", SamplingParams(top_k=5, top_p=0.5, min_p=0.1))[1]
    assert greedy["temperature"] == 0 and not {"top_k", "top_p", "min_p"} & set(greedy)
    assert ask("llamacpp", SamplingParams())[1]["repeat_penalty"] == 1.0
    for name in ("vllm", "tokentrail", "mlx"):
        assert ask(name, p)[1]["repetition_penalty"] == 1.1
    biased = SamplingParams(logit_bias={7: -1.5})
    assert ask("openai", biased)[1]["logit_bias"] == {"7": -1.5}
    assert ask("llamacpp", biased)[1]["logit_bias"] == [[7, -1.5]]


# -- chat ---------------------------------------------------------------------------------------


def test_chat_body_per_dialect_by_name_or_object() -> None:
    plain = {"messages": [{"role": "user", "content": "hi"}], "stream": False, "top_logprobs": 2}
    tools = {**plain, "tools": [{"type": "function", "function": {"name": "f"}}]}
    for name, d in DIALECTS.items():
        assert chat_body(plain, name, "m") == chat_body(plain, d, "m")
    vllm = chat_body(plain, "vllm", "m")
    assert vllm["return_token_ids"] is True and vllm["stream"] is True
    assert vllm["top_logprobs"] == 2 and vllm["model"] == "m"
    assert "return_token_ids" not in chat_body(plain, "openai", None)
    # llama-server refuses logprobs on a streamed request with tools: sent whole.
    whole = chat_body(tools, "llamacpp", "m")
    assert whole["stream"] is False and "stream_options" not in whole
    assert chat_body(plain, "llamacpp", "m")["stream"] is True
    assert chat_body(tools, "vllm", "m")["stream"] is True
    with pytest.raises(ValueError):
        chat_body(plain, "auto", "m")


# -- detection ----------------------------------------------------------------------------------


def models(*owners: str) -> dict[str, Any]:
    data = [{"id": f"m{i}", "owned_by": o} for i, o in enumerate(owners)]
    return {"object": "list", "data": data}


@pytest.mark.parametrize(
    ("answer", "server", "dialect"),
    [
        (models("llamacpp"), "llama.cpp", "llamacpp"),
        (models("vllm"), "uvicorn", "vllm"),
        (models("tokentrail"), "uvicorn", "tokentrail"),
        (models("openai"), "", "openai"),
        (models("system"), PYTHON_SERVER, "mlx"),
        (models("vllm"), PYTHON_SERVER, "vllm"),  # owned_by says more than the header
        (models("vllm", "llamacpp"), "", "llamacpp"),
        (models("tokentrail", "vllm"), "", "vllm"),
        ({"data": None}, "", "openai"),
        ({"data": "vllm"}, "", "openai"),
        ([{"owned_by": "vllm"}], PYTHON_SERVER, "mlx"),
        (None, "", "openai"),
        ({"data": ["vllm", 3]}, "uvicorn", "openai"),
    ],
)
def test_detection(answer: Any, server: str, dialect: str) -> None:
    from tokentrail.check.probe import proxy_dialect

    assert pick_dialect(answer, server).name == dialect
    assert proxy_dialect(answer, server) == dialect


class Fake(BaseHTTPRequestHandler):
    """/v1/models as `state["models"]` says, a Server header of `state["server"]`,
    llama-server's /props (3 slots), tokentrail's /health (max_batch 5); every POST is
    recorded and answered with one short chat completion."""

    state: ClassVar[dict[str, Any]] = {}

    def version_string(self) -> str:
        return str(self.state["server"])

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, value: Any) -> None:
        send_json(self, value)

    def do_GET(self) -> None:
        answers = {"/v1/models": self.state["models"], "/props": {"total_slots": 3},
                   "/health": {"status": "ok", "max_batch": 5}}  # fmt: skip
        self._json(answers.get(self.path, {}))

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        self.state["posts"].append((self.path, json.loads(self.rfile.read(n) or b"{}")))
        self._json({
            "id": "x", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        })  # fmt: skip


@pytest.fixture
def fake() -> Iterator[dict[str, Any]]:
    Fake.state = {"models": models(), "server": "uvicorn", "posts": []}
    server = ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield {"url": f"http://127.0.0.1:{server.server_port}", "state": Fake.state}
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("owner", "server", "dialect", "capacity"),
    [
        ("llamacpp", "llama.cpp", "llamacpp", 3),  # /props total_slots
        ("tokentrail", "uvicorn", "tokentrail", 5),  # /health max_batch
        ("vllm", "uvicorn", "vllm", VLLM_CAPACITY),
        ("someone", "uvicorn", "openai", UPSTREAM_CAPACITY),
        ("someone", PYTHON_SERVER, "mlx", UPSTREAM_CAPACITY),
    ],
)
def test_engine_and_check_pick_the_same_dialect(
    fake: dict[str, Any], owner: str, server: str, dialect: str, capacity: int
) -> None:
    from tokentrail import load_vocab
    from tokentrail.check.probe import Checker
    from tokentrail.engines.upstream.engine import UpstreamEngine

    fake["state"]["models"] = models(owner)
    fake["state"]["server"] = server
    engine = UpstreamEngine(fake["url"], load_vocab(DEMO), model="m")
    try:
        assert engine.dialect == dialect and engine.dialect_spec is DIALECTS[dialect]
        assert engine.capacity == capacity
    finally:
        engine.close()
    report = Checker(fake["url"], quick=True).run()
    assert report.dialect == dialect and report.owned_by == [owner]
    # The check's probes ask what the proxy's chat asks of this dialect (vLLM: token ids).
    # (The bad requests of its error checks are sent as they are: no "logprobs".)
    probes = [body for path, body in fake["state"]["posts"]
              if path == "/v1/chat/completions" and "logprobs" in body]  # fmt: skip
    asked_ids = [body.get("return_token_ids") is True for body in probes]
    assert asked_ids and (all(asked_ids) if dialect == "vllm" else not any(asked_ids))


def test_an_engine_with_a_named_dialect_asks_nothing_of_detection(fake: dict[str, Any]) -> None:
    from tokentrail import load_vocab
    from tokentrail.engines.upstream.engine import UpstreamEngine

    fake["state"]["models"] = models("llamacpp")  # the name given wins over the server
    engine = UpstreamEngine(fake["url"], load_vocab(DEMO), model="m", dialect=DIALECTS["vllm"])
    try:
        assert engine.dialect == "vllm" and engine.capacity == VLLM_CAPACITY
        assert engine.request([1], SamplingParams(), 4)[1]["return_token_ids"] is True
    finally:
        engine.close()
    with pytest.raises(ValueError, match="unknown upstream dialect"):
        UpstreamEngine(fake["url"], load_vocab(DEMO), model="m", dialect="sglang")


def test_one_choice_on_llama_cpp_is_sent_as_its_canonical_tokens(fake: dict[str, Any]) -> None:
    """A constraint that forces the whole answer goes to llama-server as the tokenizer's
    own tokens for it (GBNF token literals), as tokentrail's own constrained decoding
    writes forced text; where the tokens do not spell exactly the text, or for several
    choices, the characters' grammar stays."""
    from tokentrail.engines.upstream.engine import UpstreamEngine
    from tokentrail.server.proxy import load_tokenizer

    tok = load_tokenizer(DEMO)
    engine = UpstreamEngine(fake["url"], tok, model="m", dialect="llamacpp")
    one = constraint("choice", json.dumps(["Hello world"]), "structured_outputs")
    two = constraint("choice", json.dumps(["Hello world", "no"]), "structured_outputs")
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert len(ids) > 1 and engine.canonical_ids("Hello world") == ids
    _, body = engine.request([5, 6], SamplingParams(constraint=one), 8)
    assert body["grammar"] == "root ::= " + " ".join(f"<[{i}]>" for i in ids)
    _, body = engine.request([5, 6], SamplingParams(constraint=two), 8)
    assert body["grammar"] == 'root ::= "Hello world" | "no"'
    # an SPM tokenizer spells a text alone with a space before it: no canonical ids
    spm = require("sentencepiece").SentencePieceProcessor(
        model_file=str(corpus_path("tokenizers/llama2/tokenizer.model")))
    assert spm.id_to_piece(spm.encode("Paris")[0]).startswith("\u2581")
    llama = UpstreamEngine(fake["url"], load_tokenizer_spm(), model="m", dialect="llamacpp")
    assert llama.canonical_ids("Paris") is None
    _, body = llama.request([5, 6], SamplingParams(constraint=constraint(
        "choice", json.dumps(["Paris"]), "structured_outputs")), 8)
    assert body["grammar"] == 'root ::= "Paris"'
    engine.close()
    llama.close()


def load_tokenizer_spm() -> Any:
    """Llama 2's sentencepiece tokenizer as transformers loads it (the corpus's file)."""
    transformers = require("transformers")
    return transformers.LlamaTokenizerFast(
        vocab_file=str(corpus_path("tokenizers/llama2/tokenizer.model")), legacy=True)
