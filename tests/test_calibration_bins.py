"""A free-text map binned into a few probabilities (scaling-binning, Kumar, Liang and Ma,
"Verified uncertainty calibration", NeurIPS 2019: `tokentrail.calibrate.fit.fit_bins`).

The oracles are fresh draws, not the code under test: answers whose chance of being right
is a known function of the measure (p = c ** 3), fitted on one sample and judged on
another; and the bins' definition itself (pieces of about equal numbers of answers, each
saying the mean of the map's curve over its answers), recomputed here with numpy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

for needed in ("numpy", "sklearn"):  # the calibrate extra
    pytest.importorskip(needed, reason="pip install -e '.[calibrate]'")
import tokentrail.calibrate.fit as fit  # noqa: E402

np = fit.np  # the fitter's own numpy

from tokentrail.calibrate import Calibration  # noqa: E402
from tokentrail.calibrate.apply import apply_map  # noqa: E402
from tokentrail.calibrate.metrics import ece  # noqa: E402
from tokentrail.errors import CalibrationError  # noqa: E402

CURVE = {"kind": "temperature", "temperature": 2.0, "bias": -0.5}


def _sigmoid_of_logit(c: np.ndarray) -> np.ndarray:
    z = np.log(c / (1 - c)) / CURVE["temperature"] + CURVE["bias"]
    return 1 / (1 + np.exp(-z))


def test_bins_hold_equal_shares_and_say_the_curves_mean_over_them() -> None:
    rng = np.random.default_rng(3)
    c = rng.uniform(0.01, 0.99, 300)
    bins = fit.fit_bins(CURVE, c, 4)
    assert bins is not None and len(bins["p"]) == len(bins["edges"]) + 1 == 4
    piece = np.searchsorted(bins["edges"], c, side="right")
    assert sorted(np.bincount(piece).tolist()) == [75, 75, 75, 75]
    curve = _sigmoid_of_logit(c)
    for b in range(4):
        assert bins["p"][b] == pytest.approx(curve[piece == b].mean())
    assert bins["p"] == sorted(bins["p"])  # a rising curve's pieces rise
    spec = {**CURVE, "bins": bins}
    said = {apply_map(spec, float(v)) for v in c}
    assert said == set(bins["p"])  # the map says its pieces' figures and nothing else
    assert apply_map(spec, 0.0) == bins["p"][0] and apply_map(spec, 1.0) == bins["p"][-1]


def test_values_that_cannot_be_cut_give_no_bins() -> None:
    assert fit.fit_bins(CURVE, np.full(50, 0.4), 3) is None
    # two distinct values: at most two pieces, whatever count is asked
    two = fit.fit_bins(CURVE, np.array([0.2] * 30 + [0.7] * 30), 5)
    assert two is not None and two["edges"] == [0.7] and len(two["p"]) == 2


def test_binning_measures_closer_to_calibrated_on_answers_it_never_saw() -> None:
    """Fitted on 200 answers and judged on 200 others, ten draws: the binned maps' ECE
    is lower in the median than the same fitter's without bins, at no cost in Brier
    score (the bins only say what the curve said, over groups large enough to check)."""
    def median_scores(counts: tuple[int, ...]) -> tuple[float, float, int]:
        saved, fit.BIN_COUNTS = fit.BIN_COUNTS, counts
        try:
            eces, briers, binned = [], [], 0
            for seed in range(10):
                rng = np.random.default_rng(seed)
                c = rng.uniform(0.05, 0.99, 400)
                y = (rng.random(400) < c**3).astype(float)
                spec = fit.fit_map(c[:200], y[:200], seed=seed)
                binned += "bins" in spec
                p = np.array([apply_map(spec, float(v)) for v in c[200:]])
                eces.append(ece(p, y[200:]))
                briers.append(float(np.mean((p - y[200:]) ** 2)))
            return float(np.median(eces)), float(np.median(briers)), binned
        finally:
            fit.BIN_COUNTS = saved

    with_bins, without = median_scores(fit.BIN_COUNTS), median_scores(())
    assert without[2] == 0 and with_bins[2] >= 5
    assert with_bins[0] < without[0] - 0.005
    assert with_bins[1] <= without[1] + 0.003


def test_a_fitted_file_keeps_its_bins_and_bad_bins_are_refused(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    c = rng.uniform(0.05, 0.99, 300)
    rows = [{"id": str(i), "output": "", "correct": bool(rng.random() < v ** 3),
             "measures": {"geo_prob": float(v)}, "calibrated": None} for i, v in enumerate(c)]
    cal = fit.fit_calibration(rows, {}, {"data": "synthetic"})
    spec = cal.maps["geo_prob"]
    assert "bins" in spec and spec["cv_log_loss"]["binned"] is not None
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal.to_dict()))
    back = Calibration.load(path)
    assert {back.map("geo_prob", float(v)) for v in c} <= set(spec["bins"]["p"])
    for bad in ({"edges": [0.5, 0.2], "p": [0.1, 0.2, 0.3]}, {"edges": [0.5], "p": [0.1]},
                {"edges": [0.5], "p": [0.1, 1.5]}, {"edges": "0.5", "p": [0.1, 0.2]},
                {"edges": [float("nan")], "p": [0.1, 0.2]}):
        with pytest.raises(CalibrationError, match="malformed"):
            Calibration.from_dict({"format": "tokentrail-calibration",
                                   "maps": {"geo_prob": {**CURVE, "bins": bad}}})
    with pytest.raises(CalibrationError, match="malformed"):  # a constant has no curve to bin
        Calibration.from_dict({"format": "tokentrail-calibration", "maps": {"geo_prob": {
            "kind": "constant", "p": 0.3, "bins": {"edges": [0.5], "p": [0.1, 0.2]}}}})
