"""The proxy ends where llama-server ends: on every token llama.cpp treats as end of
generation, read from the GGUF given as `--tokenizer`, not only the file's EOS.

SmolLM2-135M-Instruct's GGUF names `<|im_end|>` as its EOS, and llama.cpp also ends
generation on `<|endoftext|>` (and `<file_sep>`), which it finds by their text. Under a
grammar that has been written out, llama-server ends on `<|endoftext|>` and streams it
as its last token. The proxy took that token for text and then added its own EOS with
no logprob (a `null` on the wire, which the `calibrate` reader, for one, could not
read). The oracles: llama.cpp's own `llama_vocab_is_eog` on every id, and the same
request's tokens and logprobs straight from llama-server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.helpers.env import require
from tests.helpers.llamacpp import find_smollm2
from tests.helpers.servers import Server, start_llama_server, start_proxy

require("uvicorn")
openai = require("openai")

MESSAGES = [
    {"role": "system", "content": "Answer with the answer only."},
    {"role": "user", "content": "Who composed 'Water Music'? Options: Chopin, Handel."},
]
#: A string the model does not write unasked: after it, the grammar allows only an end.
FORCED = "Zq7 vortex"
#: The same grammar straight to llama-server and through the proxy (which passes a GBNF
#: grammar on as it is).
GRAMMAR = f'root ::= "{FORCED}"'


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_llama_server(find_smollm2(), tmp_path_factory.mktemp("logs") / "llama.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(llama: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_proxy(llama, tmp_path_factory.mktemp("logs") / "proxy.log")
    yield server
    server.stop()


def test_the_end_ids_of_a_gguf_are_llama_cpps() -> None:
    llama_cpp = require("llama_cpp")
    from tokentrail.server.proxy import load_tokenizer

    gguf = find_smollm2()
    model = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    vocab = model._model.vocab
    theirs = {i for i in range(llama_cpp.llama_vocab_n_tokens(vocab))
              if llama_cpp.llama_vocab_is_eog(vocab, i)}  # fmt: skip
    tok = load_tokenizer(gguf)
    assert set(tok.eos_token_ids) == theirs
    assert len(theirs) > 1  # more than the file's EOS: what this is about


def llama_tokens(llama: Server) -> list[tuple[int, float]]:
    """(id, logprob) of every token llama-server streams for the forced answer, its end
    token included, asked on its own /completion with the chat prompt's ids."""
    prompt = httpx.post(llama.url + "/apply-template", json={"messages": MESSAGES}).json()
    asked = {"content": prompt["prompt"], "add_special": False}
    ids = httpx.post(llama.url + "/tokenize", json=asked).json()["tokens"]
    body = {"prompt": ids, "n_predict": 32, "stream": True, "return_tokens": True,
            "temperature": 0, "n_probs": 1, "grammar": GRAMMAR}  # fmt: skip
    out: list[tuple[int, float]] = []
    with httpx.stream("POST", llama.url + "/completion", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                for p in json.loads(line[6:]).get("completion_probabilities") or []:
                    out.append((p["id"], p["logprob"]))
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_that_ends_on_another_end_token_ends_there(
    proxy: Server, llama: Server, stream: bool
) -> None:
    from tokentrail.server.proxy import load_tokenizer

    tok = load_tokenizer(llama.model_dir)  # its end ids: checked against llama.cpp above
    theirs = llama_tokens(llama)
    end = theirs[-1][0]
    assert end in tok.eos_token_ids and end != tok.eos_token_id  # not the file's EOS
    c = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    got = c.chat.completions.create(
        model=proxy.model, messages=MESSAGES, temperature=0, max_tokens=32, logprobs=True,
        top_logprobs=1, stream=stream, extra_body={"structured_outputs": {"grammar": GRAMMAR}},
    )  # fmt: skip
    if stream:
        chunks: list[Any] = list(got)
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        entries = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
                   for e in ch.choices[0].logprobs.content or []]  # fmt: skip
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
    else:
        text = got.choices[0].message.content
        entries = got.choices[0].logprobs.content
        finish = got.choices[0].finish_reason
    assert text == FORCED and finish == "stop"
    # one entry per token llama-server made, its end token last, each with its logprob
    assert len(entries) == len(theirs), [(e.token, e.logprob) for e in entries]
    for e, (_, lp) in zip(entries, theirs, strict=True):
        assert e.logprob == pytest.approx(lp, abs=1e-4)
    assert entries[-1].token == "" and entries[-1].bytes == []
