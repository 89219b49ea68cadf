"""lm-evaluation-harness's own ``local-completions`` model against ``tokentrail serve``
(``--engine llamacpp`` on SmolLM2's GGUF), as an evaluation run drives it.

lm-eval finds the server's tokenizer endpoints (`server.tokenize`, vLLM's shapes) and
tokenizes through them (its "remote" backend, picked by default), sends its scoring
requests several prompts at a time with ``echo``, ``logprobs`` and ``max_tokens`` 1, and
reads each continuation's summed ``token_logprobs`` and ``is_greedy`` from
``top_logprobs``. The oracle is llama-cpp-python's own `Llama` keeping every position's
logits (`smol_ref`): the log-softmax of the logits before each continuation token, on
the tokens llama.cpp's tokenizer makes of context and continuation.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.helpers.env import need_llama_cpp, require

lm_eval = require("lm_eval", "lm-evaluation-harness, the dev extra")
require("uvicorn")

#: (context, continuation): right and wrong answers, several tokens, non-ASCII text.
PAIRS = [
    ("The capital of France is", " Paris"),
    ("The capital of France is", " a small village in the mountains"),
    ("Question: What is 2 + 2?\nAnswer:", " 4"),
    ("Question: What is 2 + 2?\nAnswer:", " 5"),
    ("東京は日本の", "首都です。"),
    ("def add(a, b):\n    return", " a + b"),
]


@pytest.fixture(scope="module")
def served(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    need_llama_cpp()
    from tests.helpers.servers import start_server

    log = tmp_path_factory.mktemp("logs") / "lm-eval.log"
    srv = start_server(smollm2_gguf, log, "--engine", "llamacpp", "--n-ctx", "2048")
    yield srv
    srv.stop()


def _model(served: Any, **kwargs: Any) -> Any:
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(
        base_url=served.url + "/v1/completions", model=served.model, max_retries=1, **kwargs
    )


def _oracle(ref: Any, tok: Any, context: str, continuation: str) -> tuple[float, bool]:
    """The continuation's log-likelihood and greediness from llama-cpp-python's logits."""
    whole = tok.encode(context + continuation, add_special_tokens=False)
    n = len(tok.encode(context, add_special_tokens=False))
    ref.reset()
    ref.eval(whole)
    scores = np.array(ref.scores[: len(whole)], dtype=np.float64)
    rows = scores - np.logaddexp.reduce(scores, axis=1, keepdims=True)
    total = sum(rows[i - 1, whole[i]] for i in range(n, len(whole)))
    greedy = all(int(np.argmax(rows[i - 1])) == whole[i] for i in range(n, len(whole)))
    return float(total), greedy


def test_lm_eval_scores_continuations_as_llama_cpp_does(
    served: Any, smol: tuple[Any, Any], smol_ref: Any
) -> None:
    from lm_eval.api.instance import Instance

    lm = _model(served, batch_size=4)  # several prompts in one request
    assert type(lm.tokenizer).__name__ == "RemoteTokenizer"  # found our /tokenize
    requests = [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
        for i, pair in enumerate(PAIRS)
    ]
    got = lm.loglikelihood(requests, disable_tqdm=True)
    assert len(got) == len(PAIRS)
    for (context, continuation), (ll, greedy) in zip(PAIRS, got, strict=True):
        want, want_greedy = _oracle(smol_ref, smol[1], context, continuation)
        assert ll == pytest.approx(want, abs=2e-2), (context, continuation)
        assert greedy == want_greedy, (context, continuation)
    # the right answers outscore the wrong ones (the model knows these)
    assert got[0][0] > got[1][0] and got[2][0] > got[3][0]


def test_lm_eval_generates_what_the_server_answers(served: Any) -> None:
    from lm_eval.api.instance import Instance

    lm = _model(served)
    context = "The capital of France is"
    args = {"until": ["."], "max_gen_toks": 24, "do_sample": False}
    (text,) = lm.generate_until(
        [Instance(request_type="generate_until", doc={}, arguments=(context, args), idx=0)],
        disable_tqdm=True,
    )
    direct = httpx.post(served.url + "/v1/completions", timeout=120, json={
        "prompt": context, "max_tokens": 24, "temperature": 0, "stop": ["."],
    }).json()["choices"][0]["text"]  # fmt: skip
    assert text == direct and text.strip() and "." not in text


def test_tokenizer_endpoints_are_llama_cpps_tokenizer(served: Any, smol: tuple[Any, Any]) -> None:
    tok = smol[1]
    text = "Hello, 世界! 🦙 def f(x): return x"
    r = httpx.post(served.url + "/tokenize", json={"prompt": text, "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == tok.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 2048
    assert len(body["token_strs"]) == body["count"]
    back = httpx.post(served.url + "/detokenize", json={"tokens": body["tokens"]}).json()
    assert back == {"prompt": tok.decode(body["tokens"])} and back["prompt"] == text
    chat = [{"role": "user", "content": "Hi"}]
    r = httpx.post(served.url + "/tokenize", json={"messages": chat})
    assert r.json()["tokens"] == tok.apply_chat_template(chat, add_generation_prompt=True)
    info = httpx.get(served.url + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "frob": 1}, "frob"),
        ("/tokenize", {"messages": [{"role": "user"}]}, "messages"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [1, "x"]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ],
)
def test_tokenizer_endpoints_refuse_bad_input_naming_the_field(
    served: Any, path: str, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(served.url + path, json=body)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"].split(".")[0] == param, r.text
