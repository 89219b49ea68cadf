"""`tokentrail calibrate --engine torch`: the built-in demo model through transformers, on
free-text and choice questions of facts.jsonl.

Oracles: transformers itself. Every free-text answer is `generate`'s own greedy reply
on the same prompt ids, one question at a time, although `calibrate` decodes them
together in the engine's batch; every choice's `field_prob` is its share of the
choices' probabilities, each computed from one forward pass of the model over the
prompt and the choice's canonical tokens (the tokenizer's own ids for the choice
alone); and `report.json` is recomputed from `items.jsonl`
(tests/helpers/calibration_report.py).
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from tests.helpers.calibration_report import check_report_against_items
from tests.helpers.env import REPO, require

torch = require("torch")
require("transformers")
pytest.importorskip("sklearn", reason="pip install -e '.[calibrate]'")
pytest.importorskip("llguidance", reason="choices are constrained: pip install -e '.[constrain]'")

from tokentrail.generate import DEMO_MODEL  # noqa: E402

FACTS = REPO / "benchmarks" / "data" / "calibration" / "facts.jsonl"
FREE, CHOICES = 8, 6
MAX_TOKENS = 8

if not (DEMO_MODEL / "config.json").is_file():  # pragma: no cover - a broken install
    pytest.skip("the built-in demo model is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tokentrail.cli import main

    lines = FACTS.read_text("utf-8").splitlines(keepends=True)
    picked = ([x for x in lines if '"choices"' not in x][:FREE]
              + [x for x in lines if '"choices"' in x][:CHOICES])  # fmt: skip
    folder = tmp_path_factory.mktemp("calibrate-torch")
    data = folder / "set.jsonl"
    data.write_text("".join(picked), "utf-8")
    out = folder / "out"
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores: torch's spinning pool slows a tiny model
    try:
        code = main(["calibrate", str(data), "--out", str(out), "--engine", "torch",
                     "--model", str(DEMO_MODEL), "--max-tokens", str(MAX_TOKENS),
                     "--quiet", "--bootstrap", "20"])  # fmt: skip
    finally:
        torch.set_num_threads(before)
    assert code == 0
    questions = [json.loads(x) for x in picked]
    items = {r["id"]: r for r in map(json.loads, (out / "items.jsonl").open(encoding="utf-8"))}
    return {"out": out, "questions": questions, "items": items}


@pytest.fixture(scope="module")
def oracle() -> tuple[Any, Any]:
    """transformers' own model, loaded apart from the engine's, and tokentrail's
    tokenizer for the prompt ids (the prompt is not what is under test here)."""
    from transformers import AutoModelForCausalLM

    from tokentrail import load

    _, tokenizer = load(str(DEMO_MODEL), engine="torch")
    model = AutoModelForCausalLM.from_pretrained(str(DEMO_MODEL), dtype=torch.float32).eval()
    return model, tokenizer


def test_report_agrees_with_its_items(run: dict[str, Any]) -> None:
    check_report_against_items(run["out"], FREE + CHOICES)


def test_free_text_answers_are_transformers_own_greedy_replies(
    run: dict[str, Any], oracle: tuple[Any, Any]
) -> None:
    from tokentrail.prompting import chat_ids

    model, tokenizer = oracle
    eos = sorted(tokenizer.eos_token_ids)
    free = [q for q in run["questions"] if "choices" not in q]
    assert len(free) == FREE
    for q in free:
        ids = chat_ids(tokenizer, q["messages"], None)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
                                 eos_token_id=eos, pad_token_id=eos[0])  # fmt: skip
        got = out[0, len(ids):].tolist()
        reply = [t for t in got if t not in eos]
        theirs = tokenizer.decode(reply)
        assert run["items"][q["id"]]["output"].strip() == theirs.strip(), q["id"]


def test_every_choice_is_scored_on_its_canonical_tokens(
    run: dict[str, Any], oracle: tuple[Any, Any]
) -> None:
    from tokentrail.prompting import chat_ids

    model, tokenizer = oracle
    choices = [q for q in run["questions"] if "choices" in q]
    assert len(choices) == CHOICES
    for q in choices:
        item = run["items"][q["id"]]
        assert item["output"] in q["choices"], item
        prompt = chat_ids(tokenizer, q["messages"], None)
        scores = {}
        for c in q["choices"]:
            ids = tokenizer.encode(c, add_special_tokens=False)
            with torch.no_grad():
                logits = model(torch.tensor([prompt + ids])).logits[0].double()
            lp = torch.log_softmax(logits, dim=-1)
            scores[c] = sum(float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(ids))
        top = max(scores.values())
        share = math.exp(scores[item["output"]] - top) / sum(
            math.exp(v - top) for v in scores.values())
        assert item["measures"]["field_prob"] == pytest.approx(share, abs=1e-4), (q["id"], scores)
