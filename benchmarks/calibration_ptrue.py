"""Can the model judge its own answers? P(True) (Kadavath et al. 2022, "Language Models
(Mostly) Know What They Know") against the answer's own probability.

For each free-text answer of a `tokentrail calibrate` run, the model (a GGUF file, on
llama.cpp through llama-cpp-python) is asked "Question: ... Proposed answer: ... Is the
proposed answer correct? Answer yes or no." and P(True) is P(yes) / (P(yes) + P(no))
over the top 20 tokens of one greedy step (any casing, with or without a leading
space). Prints, per run, how well P(True) and the run's `prob` separate right from wrong
(AUROC). A measure worth calibrating must rank first: on SmolLM2-135M-Instruct it does
not (`benchmarks/results/calibration.md`).

    python benchmarks/calibration_ptrue.py runs/facts benchmarks/data/calibration/facts.jsonl \
        --gguf ~/.cache/tokentrail/models/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from sklearn.metrics import roc_auc_score

from tokentrail.calibrate.data import read_items
from tokentrail.calibrate.run import ITEMS, read_rows

ASK = "Question: {q}\nProposed answer: {a}\nIs the proposed answer correct? Answer yes or no."


def question(prompt: Any) -> str:
    """The question's text: the last user message, or the prompt."""
    return prompt if isinstance(prompt, str) else str(prompt[-1]["content"])


def p_true(llm: Any, q: str, answer: str) -> float:
    reply = llm.create_chat_completion(
        [{"role": "user", "content": ASK.format(q=q, a=answer)}],
        max_tokens=1, temperature=0, logprobs=True, top_logprobs=20,
    )  # fmt: skip
    top = reply["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    said = {"yes": 0.0, "no": 0.0}
    for t in top:
        word = t["token"].strip().lower()
        if word in said:
            said[word] += math.exp(t["logprob"])
    total = said["yes"] + said["no"]
    return said["yes"] / total if total > 0 else 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a `tokentrail calibrate` output folder")
    ap.add_argument("data", type=Path, help="the labelled set it answered")
    ap.add_argument("--gguf", required=True, type=Path, help="the model's GGUF file")
    args = ap.parse_args()
    from llama_cpp import Llama

    llm = Llama(str(args.gguf), n_ctx=512, logits_all=True, verbose=False)
    items = {it.id: it for it in read_items(args.data)}
    rows = [r for r in read_rows(args.run / ITEMS)
            if r["measures"].get("field_prob") is None and r["correct"] is not None]
    y = [bool(r["correct"]) for r in rows]
    pt = [p_true(llm, question(items[r["id"]].prompt), r["output"]) for r in rows]
    prob = [r["measures"]["prob"] for r in rows]
    print(f"{args.run.name}: {len(rows)} free-text answers, right {sum(y) / len(y):.3f}; "
          f"AUROC P(True) {roc_auc_score(y, pt):.3f}, prob {roc_auc_score(y, prob):.3f}")


if __name__ == "__main__":
    main()
