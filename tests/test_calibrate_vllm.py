"""`tokentrail calibrate --url` against vLLM's own OpenAI server (any OpenAI-compatible
server, as issue #30 asks), and how a choice is scored where a server reports logprobs
after the constraint's mask.

vLLM applies its grammar's bitmask to the logits before it computes logprobs: under
``structured_outputs`` a forbidden token is listed at -9999 and a choice decoded alone
comes back near probability 1 (its only doubt is between spellings), whatever the model
thinks of it. A softmax over those single-choice sums says little; the constrained
answer's own masked probabilities multiply to the probability that the constrained
decoding writes it, which is what `field_prob` is there (`tokentrail.calibrate.answer`).
vLLM itself is the oracle: the test asks it the same requests and recomputes each
measure from its answers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.calibration_report import check_report_against_items
from tests.test_vllm_server import (  # noqa: F401 (fixtures)
    CLOSE,
    ENGINE_ARGS,
    VLLM_ENV,
    model_dir,
    vllm,
    vpy,
)
from tokentrail.calibrate.answer import Answerer, Reply
from tokentrail.calibrate.data import Item
from tokentrail.calibrate.measures import TokenRecord
from tokentrail.cli import main

REPO = Path(__file__).resolve().parents[1]  # (the vLLM venv runs this tree's src/)
FACTS = REPO / "benchmarks" / "data" / "calibration" / "facts.jsonl"
TOP = 5  # calibrate's default --top-logprobs
MAX_TOKENS = 32  # and its --max-tokens


def _items(n_choice: int, n_free: int) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in FACTS.read_text("utf-8").splitlines() if line.strip()]
    choice = [r for r in rows if r.get("choices")][:n_choice]
    free = [r for r in rows if not r.get("choices")][:n_free]
    return choice + free


def _ask(url: str, row: dict[str, Any], choices: list[str] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "smollm2", "messages": row["messages"],
                            "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": True,
                            "top_logprobs": TOP}  # fmt: skip
    if choices:
        body["structured_outputs"] = {"choice": choices}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _logprobs(choice: dict[str, Any]) -> list[float]:
    return [e["logprob"] for e in choice["logprobs"]["content"]]


def _scored(out: Path, n: int) -> dict[str, dict[str, Any]]:
    """A run's items by id, its report checked against them (recomputed)."""
    check_report_against_items(out, n)
    return {json.loads(x)["id"]: json.loads(x) for x in (out / "items.jsonl").open()}


def test_calibrate_through_vllms_own_server(vllm: Any, tmp_path: Path) -> None:  # noqa: F811
    rows = _items(4, 4)
    data = tmp_path / "set.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert main(["calibrate", str(data), "--url", vllm.url, "--out", str(out), "--quiet"]) == 0
    items = _scored(out, len(rows))
    for row in rows:
        got = items[row["id"]]
        if row.get("choices"):
            answer = _ask(vllm.url, row, row["choices"])
            assert got["output"] == answer["message"]["content"]
            lps = _logprobs(answer)
            # vLLM masks before its logprobs: forbidden tokens at -9999 among the
            # alternatives, in the constrained answer and in each choice decoded alone
            # (whose sum is then that of the masked paths, not the model's own).
            for reply in (answer, *(_ask(vllm.url, row, [c]) for c in row["choices"])):
                tops = [a["logprob"] for e in reply["logprobs"]["content"]
                        for a in e["top_logprobs"]]  # fmt: skip
                assert min(tops) <= -9999
            # field_prob: the constrained answer's masked probabilities multiplied.
            assert got["measures"]["field_prob"] == pytest.approx(
                math.exp(math.fsum(lps)), rel=CLOSE, abs=CLOSE
            )
        else:
            answer = _ask(vllm.url, row, None)
            assert got["output"] == answer["message"]["content"]
            lps = _logprobs(answer)
            assert got["measures"]["first_prob"] == pytest.approx(math.exp(lps[0]), rel=CLOSE)
            assert got["measures"]["field_prob"] is None


def test_calibrate_engine_vllm_in_process_answers_as_vllms_server(
    vpy: Path, model_dir: Path, vllm: Any, tmp_path: Path  # noqa: F811
) -> None:
    """`tokentrail calibrate --engine vllm` (vLLM in process, in the vLLM venv, with the
    `vllm` fixture's engine settings): every answer is the one vLLM's own server gives
    the same request, and every measure is recomputed from that server's logprobs
    (free text batched in process, each choice under vLLM's structured outputs, whose
    masked logprobs make `field_prob` the constrained answer's own probability)."""
    rows = _items(2, 4)
    data = tmp_path / "set.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    env = {**os.environ, **VLLM_ENV, "PYTHONPATH": str(REPO / "src"),
           "TOKENTRAIL_VLLM_ARGS": json.dumps(ENGINE_ARGS)}  # fmt: skip
    cmd = [str(vpy), "-m", "tokentrail", "calibrate", str(data), "--engine", "vllm",
           "--model", str(model_dir), "--out", str(out), "--quiet"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    items = _scored(out, len(rows))
    for row in rows:
        got = items[row["id"]]
        answer = _ask(vllm.url, row, row.get("choices"))
        assert got["output"] == answer["message"]["content"], row["id"]
        lps = _logprobs(answer)
        if row.get("choices"):
            assert got["measures"]["field_prob"] == pytest.approx(
                math.exp(math.fsum(lps)), rel=CLOSE, abs=CLOSE
            )
        else:
            span = lps[:-1] if answer["finish_reason"] == "stop" and len(lps) > 1 else lps
            assert got["measures"]["first_prob"] == pytest.approx(math.exp(lps[0]), rel=CLOSE)
            assert got["measures"]["min_prob"] == pytest.approx(
                math.exp(min(span)), rel=CLOSE, abs=CLOSE
            )
            assert got["measures"]["field_prob"] is None


class _Scripted(Answerer):
    """Replies given in advance (constrained answer first, then each choice alone),
    counting what is asked."""

    def __init__(self, replies: list[tuple[str, list[TokenRecord]]]) -> None:
        self.replies = replies
        self.asked: list[Any] = []

    def ask(self, item: Item, choice: Any) -> tuple[str, list[TokenRecord]]:
        self.asked.append(choice)
        return self.replies[len(self.asked) - 1]


def _item() -> Item:
    return Item(id="q", prompt="Capital of France?", answers=("Paris",), choices=("Paris", "Rome"))


def test_a_server_that_reports_the_model_s_own_logprobs_is_scored_by_each_choice() -> None:
    # The constrained answer spelled Paris in two tokens (-1.4 in all); alone, on its
    # canonical token, it is -0.3: each choice is scored on its own decode alone, the
    # chosen one too, so both are on the same path.
    raw = [TokenRecord(-1.2, (-0.3, -1.2, -3.0)), TokenRecord(-0.2, (-0.2, -2.0))]
    paris = [TokenRecord(-0.3, (-0.3, -1.2, -3.0))]  # the model's top-k: all finite
    rome = [TokenRecord(-1.9, (-0.3, -1.9, -3.0)), TokenRecord(-0.1, (-0.1, -4.0))]
    answerer = _Scripted([("Paris", raw), ("Paris", paris), ("Rome", rome)])
    reply = answerer.answer(_item())
    assert answerer.asked == [("Paris", "Rome"), ["Paris"], ["Rome"]]
    assert not reply.masked
    assert reply.tokens == raw  # the answer's own measures keep the tokens it was written in
    # softmax over the choices' summed logprobs: Paris -0.3, Rome -2.0
    assert reply.field_prob() == pytest.approx(1 / (1 + math.exp(-1.7)))


@pytest.mark.parametrize("seen_in", ["answer", "alone"])
def test_a_server_that_masks_is_scored_by_the_constrained_answer(seen_in: str) -> None:
    masked_top = (-0.51, -0.92, -9999.0)  # a forbidden token listed at minus infinity
    answer = [TokenRecord(-0.51, masked_top if seen_in == "answer" else (-0.51, -0.92)),
              TokenRecord(-0.02, (-0.02, -4.0))]  # fmt: skip
    paris_alone = [TokenRecord(0.0, (0.0, -9999.0, -9999.0))]
    answerer = _Scripted([("Paris", answer), ("Paris", paris_alone)])
    reply = answerer.answer(_item())
    assert reply.masked
    # asked no more than it took to see the mask
    assert answerer.asked == ([("Paris", "Rome")] if seen_in == "answer"
                              else [("Paris", "Rome"), ["Paris"]])  # fmt: skip
    assert reply.field_prob() == pytest.approx(math.exp(-0.53))
    assert Reply("x", [], masked=True).field_prob() is None
