"""Teacher-forced logprobs at every position on llama.cpp (`engines.llamacpp.positions`):
what ``echo`` with ``logprobs`` lists for a prompt on ``serve --engine llamacpp``, as
lm-evaluation-harness's ``local-completions`` reads it to score a continuation.

Oracles: llama-cpp-python's own ``create_completion(echo=True, logprobs=k)`` on an
independent `Llama` that keeps every position's logits (`smol_ref`, flash attention on as
tokentrail's "auto" is here); the engine's own greedy steps (the prompt's rows, computed
in one pass, give each generated token the logprob it was generated with and make it its
position's likeliest); and the engine's generation itself, which must come out the same
after the scoring pass took its context. Then the server: a greedy completion echoed back
through the official `openai` client, where the completion came from the server's batch
(a context of its own) and the echo from the engine's context.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.env import need_llama_cpp, require
from tests.helpers.responses import extension_ids
from tokentrail.engines.scoring import position_logprobs
from tokentrail.sampling import make_params

PROMPTS = [
    "The capital of France is Paris, and the capital of Spain is Madrid.",
    "東京は日本の首都で、大阪は",
    "def add(a, b):\n    return a + b\n",
]


def _greedy(engine: Any, ids: list[int], n: int, k: int = 5) -> list[Any]:
    steps = engine.generate(ids, make_params(temp=0.0, top_logprobs=k), n)
    return [(s.token, s.logprob, list(s.top_logprobs)) for s in steps]


@pytest.mark.parametrize("n_batch", [512, 4])  # 4: the ids decoded in several batches
@pytest.mark.parametrize("text", PROMPTS)
def test_prompt_rows_are_llama_cpps_logits_at_every_position(
    smol_ref: Any, text: str, n_batch: int
) -> None:
    """On llama-cpp-python's own `Llama` that keeps every position's logits: each row is
    the log-softmax of the logits at the position before its token (its `scores` after
    its own `eval` of the ids, in batches of the same size), and the top k are that
    row's k largest."""
    import numpy as np

    from tokentrail.engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(smol_ref)
    ids = engine.tokenizer.encode(text)
    size = smol_ref.n_batch
    smol_ref.n_batch = n_batch
    try:
        rows, why = position_logprobs(engine, ids, 1, 5)
        smol_ref.reset()
        smol_ref.eval(ids)
    finally:
        smol_ref.n_batch = size
    assert why is None and rows is not None and len(rows) == len(ids) - 1
    scores = np.array(smol_ref.scores[: len(ids)], dtype=np.float64)
    ref = scores - np.logaddexp.reduce(scores, axis=1, keepdims=True)
    for i, (value, top) in enumerate(rows, start=1):
        assert value == pytest.approx(ref[i - 1, ids[i]], abs=1e-5)
        best = np.argsort(-ref[i - 1], kind="stable")[:5]
        assert [t for t, _ in top] == best.tolist()
        assert [v for _, v in top] == pytest.approx(ref[i - 1, best].tolist(), abs=1e-5)
    # (llama-cpp-python's own `create_completion(echo=True, logprobs=k)` lists each
    # prompt token's logprob from its own position's row, the one that predicts the next
    # token: one place off.)
    echoed = smol_ref.create_completion(text, max_tokens=1, echo=True, logprobs=1)
    theirs = echoed["choices"][0]["logprobs"]["token_logprobs"][1 : len(ids)]
    assert float(theirs[0]) == pytest.approx(ref[1, ids[1]], abs=1e-3)
    assert abs(float(theirs[0]) - rows[0][0]) > 0.1


def test_prompt_rows_give_a_greedy_completion_its_own_logprobs(smol: tuple[Any, Any]) -> None:
    engine, tok = smol
    prompt = tok.encode(PROMPTS[0])
    made = _greedy(engine, prompt, 8)
    ids = prompt + [t for t, _, _ in made]
    rows, _ = position_logprobs(engine, ids, len(prompt), 5)
    assert rows is not None and len(rows) == len(made)
    for (token, logprob, top), (value, row_top) in zip(made, rows, strict=True):
        assert value == pytest.approx(logprob, abs=2e-3)
        assert row_top[0][0] == token  # greedy: each its position's likeliest
        assert [i for i, _ in row_top[:2]] == [i for i, _ in top[:2]]


def test_generation_is_unchanged_by_a_scoring_pass(smol: tuple[Any, Any]) -> None:
    engine, tok = smol
    prompt = tok.encode(PROMPTS[2])
    alone = _greedy(engine, prompt, 10)
    steps = engine.generate(prompt, make_params(temp=0.0, top_logprobs=5), 10)
    first = [next(steps) for _ in range(4)]
    position_logprobs(engine, tok.encode(PROMPTS[1]), 1, 3)  # takes the engine's context
    rest = [(s.token, s.logprob, list(s.top_logprobs)) for s in steps]
    interrupted = [(s.token, s.logprob, list(s.top_logprobs)) for s in first] + rest
    assert [t for t, _, _ in interrupted] == [t for t, _, _ in alone]
    assert [lp for _, lp, _ in interrupted] == pytest.approx([lp for _, lp, _ in alone], abs=2e-3)
    assert _greedy(engine, prompt, 10) == alone  # and a generation after it


def test_a_step_read_before_the_pass_is_stale_after_it(smol: tuple[Any, Any]) -> None:
    import numpy as np

    engine, tok = smol
    step = next(engine.generate(tok.encode("Hello"), make_params(temp=0.0), 3))
    position_logprobs(engine, tok.encode(PROMPTS[0]), 1, 0)
    with pytest.raises(RuntimeError, match="logprobs are gone"):
        np.asarray(step.logprobs)


def test_ids_longer_than_the_context_are_refused(smol: tuple[Any, Any]) -> None:
    engine, _ = smol
    too_many = [1] * (engine.context_length + 2)
    with pytest.raises(ValueError, match=r"do not fit the llama\.cpp context"):
        position_logprobs(engine, too_many, 1, 0)


SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}


def test_json_fields_get_their_alternatives_on_llamacpp(smol: tuple[Any, Any]) -> None:
    """A leaf with allowed values gets each value's probability (`ContinuationScorer` on
    llama.cpp): the chosen value's is the product of its generated tokens' own
    probabilities (the steps of the generation, decoded one at a time)."""
    require("llguidance", "constrained decoding")
    import math

    import tokentrail

    engine, tok = smol
    chat = [{"role": "user", "content": "What is the capital of Italy? Answer in JSON."}]
    rs = list(tokentrail.stream_generate(engine, tok, chat, max_tokens=40, temp=0.0,
                                         json_schema=SCHEMA, top_logprobs=3))  # fmt: skip
    field = {f.path: f for f in rs[-1].all_fields}["/city"]
    assert field.alternatives is not None, field.reason
    assert {a.value for a in field.alternatives} == {"Paris", "Rome", "Oslo"}
    chosen = next(a for a in field.alternatives if a.value == field.value)
    by_index = {t.index: t.logprob for r in rs for t in r.last_segment_tokens}
    written = math.fsum(by_index[t.index] for t in field.tokens)
    assert math.log(chosen.probability) == pytest.approx(written, abs=5e-3)
    assert sum(a.normalized for a in field.alternatives) == pytest.approx(1.0)
    assert all(0.0 < a.probability < 1.0 for a in field.alternatives)


# -- the server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    require("uvicorn")
    need_llama_cpp()
    from tests.helpers.servers import start_server

    log = tmp_path_factory.mktemp("logs") / "echo-llamacpp.log"
    srv = start_server(smollm2_gguf, log, "--engine", "llamacpp", "--n-ctx", "2048")
    yield srv
    srv.stop()


def test_echo_with_logprobs_on_serve_engine_llamacpp(
    served: Any, smol: tuple[Any, Any]
) -> None:
    openai = require("openai")
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=300)

    def ask(prompt: Any, **options: Any) -> Any:
        return client.completions.create(
            model=served.model, prompt=prompt, temperature=0, **options
        )

    prompt = smol[1].encode(PROMPTS[0])
    whole = ask(prompt, max_tokens=6, logprobs=3)
    made, generated = whole.choices[0], extension_ids(whole)
    assert len(generated) == len(made.logprobs.tokens) == 6
    echoed = ask(prompt + generated, max_tokens=1, logprobs=3, echo=True).choices[0]
    lp = echoed.logprobs
    n = len(prompt) + len(generated)
    assert len(lp.tokens) == n + 1 and echoed.text.startswith(smol[1].decode(prompt) + made.text)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[len(prompt) : n] == made.logprobs.tokens
    # the completion from the server's batch, the echo from one pass on the engine
    assert lp.token_logprobs[len(prompt) : n] == pytest.approx(
        made.logprobs.token_logprobs, abs=2e-3
    )
    for token, top in zip(lp.tokens[len(prompt) : n], lp.top_logprobs[len(prompt) : n],
                          strict=True):  # fmt: skip
        assert max(top, key=top.get) == token  # lm-eval's is_greedy
    # the prompt's own rows equal llama.cpp's in process
    rows, _ = position_logprobs(smol[0], prompt, 1, 3)
    assert lp.token_logprobs[1 : len(prompt)] == pytest.approx([r[0] for r in rows], abs=2e-3)
    # each offset points at its token within the echoed text
    assert all(echoed.text[o:].startswith(t) for o, t in zip(lp.text_offset, lp.tokens,
                                                             strict=True) if t)  # fmt: skip


def test_max_tokens_0_scores_the_prompt_on_serve_engine_llamacpp(
    served: Any, smol_ref: Any, smol: tuple[Any, Any]
) -> None:
    """``echo`` with ``max_tokens`` 0 (OpenAI's legacy scoring, HELM's request): the
    prompt's logprobs alone, each the log-softmax of llama-cpp-python's own logits at the
    position before it."""
    import httpx
    import numpy as np

    ids = smol[1].encode(PROMPTS[1])
    body = {"model": served.model, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}
    r = httpx.post(served.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 0
    got = choice["logprobs"]["token_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    smol_ref.reset()
    smol_ref.eval(ids)
    scores = np.array(smol_ref.scores[: len(ids)], dtype=np.float64)
    ref = scores - np.logaddexp.reduce(scores, axis=1, keepdims=True)
    assert got[1:] == pytest.approx([ref[i - 1, ids[i]] for i in range(1, len(ids))], abs=2e-3)
