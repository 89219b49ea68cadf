"""`tokentrail calibrate --engine llamacpp`, as issue 30 says unseen question sets will be
run: SmolLM2-135M-Instruct (Q4_1 GGUF) on llama.cpp, at `calibrate`'s defaults, with
the built-in map applied (`--calibration smollm2`), then a map fitted (`--fit`).

Oracles: llama.cpp itself through llama-cpp-python's own greedy `Llama.generate` on the
same prompt ids with the engine's settings (flash attention on, as `flash_attn="auto"`
gives on the CPU backend, docs/engines.md), for every free-text answer, although
`calibrate` decodes them together in the engine's batch; the choices each question
offers, for the constrained answers; and an independent recomputation of `report.json`
from `items.jsonl` (tests/helpers/calibration_report.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.calibration_report import check_report_against_items
from tests.helpers.env import REPO

pytest.importorskip("sklearn", reason="pip install -e '.[calibrate]'")
pytest.importorskip("llguidance", reason="choices are constrained: pip install -e '.[constrain]'")

ATLAS = REPO / "benchmarks" / "data" / "calibration" / "atlas.jsonl"
#: The first lines of atlas.jsonl: free text and two- and four-way choices, mixed.
N = 30
#: `calibrate`'s default reply length.
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def run(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tokentrail.cli import main

    folder = tmp_path_factory.mktemp("calibrate-llamacpp")
    data = folder / "set.jsonl"
    data.write_text("".join(ATLAS.read_text("utf-8").splitlines(keepends=True)[:N]))
    out = folder / "out"
    code = main(["calibrate", str(data), "--out", str(out), "--engine", "llamacpp",
                 "--model", str(smollm2_gguf), "--calibration", "smollm2", "--quiet",
                 "--bootstrap", "50"])  # fmt: skip
    assert code == 0
    questions = [json.loads(x) for x in data.read_text("utf-8").splitlines()]
    items = {r["id"]: r for r in map(json.loads, (out / "items.jsonl").open(encoding="utf-8"))}
    return {"data": data, "out": out, "questions": questions, "items": items}


def test_report_agrees_with_its_items(run: dict[str, Any]) -> None:
    report = check_report_against_items(run["out"], N)
    assert "calibrated" in report["measures"]  # the map applied is one more measure


def test_free_text_answers_are_llama_cpps_own_greedy_replies(
    run: dict[str, Any], smollm2_gguf: Path, llama_cpp: Any
) -> None:
    from tokentrail import load
    from tokentrail.prompting import chat_ids

    _, tokenizer = load(str(smollm2_gguf), engine="llamacpp")
    llm = llama_cpp.Llama(str(smollm2_gguf), n_ctx=4096, flash_attn=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    free = [q for q in run["questions"] if "choices" not in q]
    assert len(free) >= 20
    for q in free:
        ids = chat_ids(tokenizer, q["messages"], None)
        reply: list[int] = []
        for t in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            if llama_cpp.llama_vocab_is_eog(vocab, t) or len(reply) == MAX_TOKENS:
                break
            reply.append(t)
        theirs = llm.detokenize(reply).decode("utf-8", "replace").strip()
        assert run["items"][q["id"]]["output"].strip() == theirs, q["id"]


def test_choices_are_decoded_among_the_choices_and_scored(run: dict[str, Any]) -> None:
    choices = [q for q in run["questions"] if "choices" in q]
    assert choices, "the slice has no choice questions"
    for q in choices:
        item = run["items"][q["id"]]
        assert item["output"] in q["choices"], item
        assert item["correct"] == (item["output"] == q["answer"]), item
        m = item["measures"]
        assert 0.0 < m["field_prob"] <= 1.0 and m["chance"] == pytest.approx(1 / len(q["choices"]))


def test_the_builtin_map_gives_every_answer_its_calibrated_probability(
    run: dict[str, Any],
) -> None:
    from tokentrail.calibrate import Calibration
    from tokentrail.calibrate.fit import TOP

    cal = Calibration.load("smollm2")
    for item in run["items"].values():
        expected, _ = cal.answer(item["measures"])
        assert item["calibrated"] == pytest.approx(expected, abs=1e-12), item["id"]
        # the map's ceilings: nothing it says reaches the most confident level
        assert 0.0 < item["calibrated"] < TOP


def test_a_map_fitted_on_the_answers_applies_to_them_on_resume(
    run: dict[str, Any], smollm2_gguf: Path
) -> None:
    from tokentrail.calibrate import Calibration
    from tokentrail.cli import main

    fitted = run["out"].parent / "fitted.cal.json"
    base = ["calibrate", str(run["data"]), "--out", str(run["out"]), "--engine", "llamacpp",
            "--model", str(smollm2_gguf), "--resume", "--quiet", "--bootstrap", "50"]  # fmt: skip
    assert main([*base, "--fit", str(fitted)]) == 0
    cal = Calibration.load(fitted)
    assert cal.fingerprint["engine"] == "llamacpp" and cal.fitted_on["n"] == N
    assert main([*base, "--calibration", str(fitted)]) == 0
    items = [json.loads(x) for x in (run["out"] / "items.jsonl").open(encoding="utf-8")]
    assert [r["output"] for r in items] == [run["items"][r["id"]]["output"] for r in items]
    for item in items:  # nothing decoded again; each answer calibrated by the new map
        assert item["measures"] == run["items"][item["id"]]["measures"]
        assert item["calibrated"] == pytest.approx(cal.answer(item["measures"])[0], abs=1e-12)
    check_report_against_items(run["out"], N)


# -- choices scored on their canonical tokens --------------------------------------------

#: Choice questions from the top of atlas.jsonl: enough that greedy decoding among the
#: choices spells some of its answers off their canonical tokens (about a third of them
#: on SmolLM2).
N_CHOICES = 16


@pytest.fixture(scope="module")
def choices_run(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tokentrail.cli import main

    folder = tmp_path_factory.mktemp("calibrate-choices")
    data = folder / "choices.jsonl"
    lines = [x for x in ATLAS.read_text("utf-8").splitlines(keepends=True) if '"choices"' in x]
    data.write_text("".join(lines[:N_CHOICES]))
    out = folder / "out"
    code = main(["calibrate", str(data), "--out", str(out), "--engine", "llamacpp",
                 "--model", str(smollm2_gguf), "--quiet", "--bootstrap", "20"])  # fmt: skip
    assert code == 0
    questions = [json.loads(x) for x in data.read_text("utf-8").splitlines()]
    items = {r["id"]: r for r in map(json.loads, (out / "items.jsonl").open(encoding="utf-8"))}
    return {"data": data, "questions": questions, "items": items}


def canonical_choice_logprobs(
    llm: Any, llama_cpp: Any, prompt: list[int], choices: list[str]
) -> dict[str, tuple[float, int]]:
    """Each choice's logprob after `prompt` on its canonical tokens (llama.cpp's own
    tokenization of the choice alone), from llama.cpp's logits over the whole
    continuation in one pass; with the number of those tokens."""
    import numpy as np

    out: dict[str, tuple[float, int]] = {}
    for c in choices:
        ids = llm.tokenize(c.encode("utf-8"), add_bos=False, special=False)
        llm.reset()
        llm.eval(prompt + ids)
        logits = np.asarray(llm.scores[len(prompt) - 1: len(prompt) + len(ids) - 1], float)
        top = logits.max(axis=1, keepdims=True)
        logz = (top + np.log(np.exp(logits - top).sum(axis=1, keepdims=True)))[:, 0]
        out[c] = (float(sum(logits[j, t] - logz[j] for j, t in enumerate(ids))), len(ids))
    return out


def test_every_choice_is_scored_on_its_canonical_tokens(
    choices_run: dict[str, Any], smollm2_gguf: Path, llama_cpp: Any
) -> None:
    """`field_prob` is the decoded choice's share of the choices' probabilities, each
    choice's probability that of its canonical tokens after the prompt, the chosen one
    included: llama.cpp's own logits are the oracle. Before, the chosen one kept the
    tokens of the greedy answer among the choices, which can spell it off that path
    ("Laos" in three tokens at -18.3 against its two at -3.5: field_prob 0.000)."""
    import math

    from tokentrail import load
    from tokentrail.prompting import chat_ids

    _, tokenizer = load(str(smollm2_gguf), engine="llamacpp")
    llm = llama_cpp.Llama(str(smollm2_gguf), n_ctx=4096, flash_attn=True, logits_all=True,
                          verbose=False)  # fmt: skip
    multi_token = 0
    for q in choices_run["questions"]:
        item = choices_run["items"][q["id"]]
        scores = canonical_choice_logprobs(
            llm, llama_cpp, chat_ids(tokenizer, q["messages"], None), q["choices"])
        multi_token += scores[item["output"]][1] > 1
        top = max(v for v, _ in scores.values())
        share = math.exp(scores[item["output"]][0] - top) / sum(
            math.exp(v - top) for v, _ in scores.values())
        assert item["measures"]["field_prob"] == pytest.approx(share, abs=0.005), (q["id"], scores)
    assert multi_token >= N_CHOICES // 2  # the spelling mattered: most answers are several tokens


# -- the same set through llama.cpp's own server (`calibrate --url`) ------------------------


@pytest.fixture(scope="module")
def llama_server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.helpers.servers import start_llama_server

    server = start_llama_server(smollm2_gguf, tmp_path_factory.mktemp("logs") / "llama.log",
                                parallel=4)  # fmt: skip
    yield server
    server.stop()


def test_calibrate_through_llama_server_constrains_choices_with_its_grammar(
    run: dict[str, Any], llama_server: Any
) -> None:
    """llama-server ignores vLLM's `structured_outputs`: the probe finds that it obeys
    its own GBNF `grammar` instead, so choices are answered among the choices (before,
    they came back as free text: 'Ascher' for Chopin or Handel). Every answer, free
    text and choice, is the one the llama.cpp engine gives in process (both with flash
    attention, llama.cpp's default on this backend)."""
    from tokentrail.calibrate.answer import HttpAnswerer
    from tokentrail.calibrate.data import read_items
    from tokentrail.cli import main

    items = read_items(run["data"])
    answerer = HttpAnswerer(llama_server.url, None, MAX_TOKENS, 5)
    try:
        first_choice = next(it for it in items if it.choices)
        assert answerer._choice_style(first_choice.prompt) == "grammar"
    finally:
        answerer.close()
    out = run["out"].parent / "through-llama-server"
    code = main(["calibrate", str(run["data"]), "--out", str(out), "--url", llama_server.url,
                 "--quiet", "--bootstrap", "50"])  # fmt: skip
    assert code == 0
    check_report_against_items(out, N)
    got = {r["id"]: r for r in map(json.loads, (out / "items.jsonl").open(encoding="utf-8"))}
    for q in run["questions"]:
        item, engine = got[q["id"]], run["items"][q["id"]]
        assert item["output"].strip() == engine["output"].strip(), q["id"]
        if "choices" in q:
            assert item["output"] in q["choices"] and item["measures"]["field_prob"] is not None


def assert_scored_as_the_engine(choices_run: dict[str, Any], url: str) -> None:
    """`calibrate --url URL` on the choices gives the engine's answers and field_prob."""
    from tokentrail.cli import main

    out = choices_run["data"].parent / ("through-" + url.rsplit(":", 1)[-1])
    code = main(["calibrate", str(choices_run["data"]), "--out", str(out), "--url", url,
                 "--quiet", "--bootstrap", "20"])  # fmt: skip
    assert code == 0
    got = {r["id"]: r for r in map(json.loads, (out / "items.jsonl").open(encoding="utf-8"))}
    for q in choices_run["questions"]:
        item, engine = got[q["id"]], choices_run["items"][q["id"]]
        assert item["output"] == engine["output"], q["id"]
        assert item["measures"]["field_prob"] == pytest.approx(
            engine["measures"]["field_prob"], abs=0.005), q["id"]


def test_through_llama_server_choices_are_scored_on_the_engines_tokens(
    choices_run: dict[str, Any], llama_server: Any
) -> None:
    """Through llama-server each choice is forced on its canonical tokens too (GBNF
    token literals of the ids its /tokenize gives), so `field_prob` is the figure the
    llama.cpp engine gives in process. With a grammar of the choice's characters its
    greedy decode spelled "Chopin" as C+hop+i+n (-30 nats, against -3.9), and the two
    figures parted by 0.25 or more for a tenth of atlas's choices."""

    assert_scored_as_the_engine(choices_run, llama_server.url)


def test_through_the_proxy_in_front_of_llama_server_choices_are_scored_alike(
    choices_run: dict[str, Any], llama_server: Any, tmp_path: Path
) -> None:
    """`calibrate --url` against `tokentrail serve --upstream` in front of llama-server:
    the proxy sends a one-choice constraint as the choice's canonical tokens (GBNF token
    literals), so `field_prob` is the engine's figure here too; with the choice's
    characters as the grammar it differed by 0.59 at the 90th percentile (40 of atlas's
    choices)."""
    from tests.helpers.servers import start_proxy

    proxy = start_proxy(llama_server, tmp_path / "proxy.log")
    try:
        assert_scored_as_the_engine(choices_run, proxy.url)
    finally:
        proxy.stop()
