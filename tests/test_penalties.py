"""OpenAI's ``presence_penalty`` and ``frequency_penalty`` on every engine, each checked
against the library whose semantics it follows.

- torch (hand-written, mlx-lm's semantics): the tokens and logprobs of mlx-lm's own
  `generate_step` with `make_logits_processors(presence_penalty=, frequency_penalty=)`
  on the same demo model (the MLX engine passes the same processors to mlx-lm).
- llama.cpp: llama-server's own greedy ids for the same request (its penalties sampler,
  the prompt counting, ``repeat_last_n`` 64), in process and through the proxy; each
  step's logprob is the log-softmax of llama.cpp's logits after the penalties
  (`llama_sampler_penalties_apply`: minus ``count * frequency + presence`` for each id
  among the last 64), computed here from llama-cpp-python's own `Llama.scores`.
- The server: a penalty outside [-2, 2] is a 400 naming it.
(vLLM: `tests/test_vllm_server.py`, against vLLM's own server.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.helpers.env import need_llama_cpp, require
from tests.helpers.responses import extension_ids
from tokentrail.sampling import make_params

PENALTIES = {"presence_penalty": 1.0, "frequency_penalty": 0.6}
N = 40


def _steps(engine: Any, ids: list[int], **penalties: float) -> list[tuple[int, float]]:
    from tokentrail.engines import engine_for

    engine = engine_for(engine)
    params = make_params(temp=0.0, top_logprobs=1, **penalties)
    return [(s.token, float(s.logprob)) for s in engine.generate(ids, params, N)]


# -- torch against mlx-lm -------------------------------------------------------------


def test_torch_penalties_are_mlx_lms() -> None:
    require("torch")
    mx = require("mlx.core")
    require("mlx_lm")
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    import tokentrail
    engine, tok = tokentrail.load(engine="torch")
    mlx_model, _ = tokentrail.load(engine="mlx")
    ids = tok.encode("the the the cat sat on the mat and the cat")
    mine = _steps(engine, ids, **PENALTIES)
    processors = make_logits_processors(
        presence_penalty=PENALTIES["presence_penalty"],
        frequency_penalty=PENALTIES["frequency_penalty"],
    )
    theirs = []
    for token, logprobs in generate_step(
        mx.array(ids), mlx_model, max_tokens=N, logits_processors=processors,
        sampler=lambda x: mx.argmax(x, axis=-1),
    ):  # fmt: skip
        theirs.append((int(token), float(logprobs[int(token)])))
    assert [t for t, _ in mine] == [t for t, _ in theirs]
    assert [lp for _, lp in mine] == pytest.approx([lp for _, lp in theirs], abs=1e-3)
    assert [t for t, _ in _steps(engine, ids)] != [t for t, _ in mine]  # they did something


# -- llama.cpp against llama-server ---------------------------------------------------


@pytest.fixture(scope="module")
def llama_server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    need_llama_cpp()
    from tests.helpers.servers import start_llama_server

    srv = start_llama_server(smollm2_gguf, tmp_path_factory.mktemp("logs") / "llama.log")
    yield srv
    srv.stop()


def _server_ids(url: str, ids: list[int], path: str = "/completion") -> list[int]:
    body = {"prompt": ids, "n_predict": N, "temperature": 0, "return_tokens": True,
            "cache_prompt": False, **PENALTIES}  # fmt: skip
    r = httpx.post(url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return [int(t) for t in r.json()["tokens"]]


def test_llamacpp_penalties_are_llama_servers(
    smol: tuple[Any, Any], llama_server: Any
) -> None:
    engine, tok = smol
    ids = tok.apply_chat_template([{"role": "user", "content": "List ten fruits, one per line."}])
    mine = _steps(engine, ids, **PENALTIES)
    theirs = _server_ids(llama_server.url, ids)
    assert [t for t, _ in mine][: len(theirs)] == theirs
    assert [t for t, _ in _steps(engine, ids)] != [t for t, _ in mine]  # they did something


def test_llamacpp_penalized_logprobs_are_the_penalized_softmax(
    smol: tuple[Any, Any], smol_ref: Any
) -> None:
    engine, tok = smol
    ids = tok.encode("the cat and the dog and the cat and the bird and the")
    mine = _steps(engine, ids, **PENALTIES)[:12]
    seq = list(ids)
    smol_ref.reset()
    smol_ref.eval(seq + [t for t, _ in mine[:-1]])
    for i, (token, logprob) in enumerate(mine):
        logits = np.array(smol_ref.scores[len(ids) + i - 1], dtype=np.float64)
        for t, count in Counter(seq[-64:]).items():
            logits[t] -= count * PENALTIES["frequency_penalty"] + PENALTIES["presence_penalty"]
        expected = logits[token] - np.logaddexp.reduce(logits)
        assert logprob == pytest.approx(expected, abs=5e-3), i
        assert token == int(np.argmax(logits))  # greedy after the penalties
        seq.append(token)


def test_the_proxy_passes_penalties_to_llama_server(
    llama_server: Any, smol: tuple[Any, Any], tmp_path: Path
) -> None:
    require("uvicorn")
    openai = require("openai")
    from tests.helpers.servers import start_server

    proxy = start_server(None, tmp_path / "proxy.log", "--upstream", llama_server.url,
                         "--tokenizer", str(llama_server.model_dir))
    try:
        ids = smol[1].encode("Name some colors: red, green, blue, red, green,")
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        out = client.completions.create(model=proxy.model, prompt=ids, max_tokens=N,
                                        temperature=0, extra_body=PENALTIES)  # fmt: skip
        got = extension_ids(out)
        theirs = _server_ids(llama_server.url, ids)
        assert got == theirs[: len(got)] and len(got) >= min(len(theirs), N) - 1
    finally:
        proxy.stop()


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [2.5, -3, "1"])
def test_a_penalty_out_of_range_is_a_400_naming_it(field: str, value: Any) -> None:
    from tokentrail.errors import APIError
    from tokentrail.server.protocol import parse_completion

    with pytest.raises(APIError) as e:
        parse_completion({"prompt": "x", field: value}, "m", 100).params(100)
    assert e.value.status == 400 and e.value.param == field
