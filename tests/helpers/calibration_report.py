"""`report.json` of `tokentrail calibrate` checked against an independent recomputation
from its `items.jsonl` (scikit-learn's AUROC and Brier, a plain loop for ECE), so that a
report cannot drift from the answers it claims to summarise. Needs scikit-learn."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path
from typing import Any

import pytest


def recomputed_ece(conf: list[float], y: list[int]) -> float:
    """ECE over 10 equal-width bins (the top bin holds 1.0)."""
    total = 0.0
    for b in range(10):
        idx = [i for i, c in enumerate(conf) if min(int(c * 10), 9) == b]
        if idx:
            acc = sum(y[i] for i in idx) / len(idx)
            mean = sum(conf[i] for i in idx) / len(idx)
            total += abs(acc - mean) * len(idx) / len(conf)
    return total


def check_floor(conf: list[float], y: list[int], floor: dict[str, float], draws: int = 400) -> None:
    """report.json's ``if_calibrated.ece`` against outcomes drawn as Bernoulli(conf) here,
    with Python's own generator (so within the draws' noise, not to the digit)."""
    rng = random.Random(17)
    drawn = [recomputed_ece(conf, [int(rng.random() < c) for c in conf]) for _ in range(draws)]
    measured = recomputed_ece(conf, y)
    assert floor["median"] == pytest.approx(statistics.median(drawn), abs=0.005, rel=0.15)
    assert floor["median"] <= floor["p95"]
    assert floor["p"] == pytest.approx(sum(d >= measured - 1e-12 for d in drawn) / draws, abs=0.1)


def check_report_against_items(out: Path, n: int) -> dict[str, Any]:
    """The report in `out` against its `n` items; returns the report."""
    from sklearn.metrics import brier_score_loss, roc_auc_score

    report = json.loads((out / "report.json").read_text())
    rows = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines()]
    assert report["n"] == len(rows) == n
    assert set(rows[0]) == {"id", "output", "correct", "measures", "calibrated"}
    assert report["accuracy"] == pytest.approx(sum(r["correct"] for r in rows) / n)
    assert report["primary"] in report["measures"]
    for name, figures in report["measures"].items():
        pairs = [(r["calibrated"] if name == "calibrated" else r["measures"][name],
                  int(r["correct"])) for r in rows]
        pairs = [(c, y) for c, y in pairs if c is not None]
        conf, y = [c for c, _ in pairs], [y for _, y in pairs]
        assert figures["n"] == len(pairs)
        assert figures["ece"] == pytest.approx(recomputed_ece(conf, y), abs=1e-6)
        assert figures["brier"] == pytest.approx(brier_score_loss(y, conf), abs=1e-6)
        if 0 < sum(y) < len(y):
            assert figures["auroc"] == pytest.approx(roc_auc_score(y, conf), abs=1e-6)
        if name == report["primary"]:  # per level: counts and accuracy of those answers
            check_floor(conf, y, figures["if_calibrated"]["ece"])
            cuts = (0.2, 0.45, 0.7, 0.9)
            for entry in report["levels"]:
                ys = [y for c, y in pairs if sum(c >= t for t in cuts) == entry["level"]]
                assert entry["n"] == len(ys)
                assert entry["accuracy"] == (sum(ys) / len(ys) if ys else None)
                assert (entry["p_shortfall"] is None) == (not ys)
                assert entry["p_shortfall"] is None or 0 < entry["p_shortfall"] <= 1
    return report
