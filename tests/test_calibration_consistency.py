"""What a perfectly calibrated confidence would show on the same answers
(`tokentrail.calibrate.consistency`): the ECE's floor, its p, and each bin's band.

Oracles: where every answer has one confidence q the ECE is |K/n - q| with K binomial,
so the floor's median, the p of a measured count and a bin's 95% band are exact
binomial figures (scipy.stats); and over many sets drawn calibrated the p is uniform
(about 5% below 0.05), while sets drawn miscalibrated are told apart."""

from __future__ import annotations

import numpy as np
import pytest

from tokentrail.calibrate.consistency import consistency
from tokentrail.calibrate.metrics import ece
from tokentrail.calibrate.report import build_report

stats = pytest.importorskip("scipy.stats")


@pytest.mark.parametrize(("n", "q", "right"), [(60, 0.5, 36), (60, 0.5, 30), (120, 0.3, 45)])
def test_one_confidence_matches_the_binomial(n: int, q: float, right: int) -> None:
    conf = [q] * n
    correct = [1] * right + [0] * (n - right)
    got = consistency(conf, correct, draws=8000, seed=3)["ece"]
    k = np.arange(n + 1)
    pmf = stats.binom.pmf(k, n, q)
    gaps = np.abs(k / n - q)
    measured = abs(right / n - q)
    assert ece(conf, correct) == pytest.approx(measured)
    exact_p = float(pmf[gaps >= measured - 1e-12].sum())
    assert got["p"] == pytest.approx(exact_p, abs=0.02)
    # The exact median of |K/n - q|: the smallest gap whose cumulative share reaches 1/2.
    order = np.argsort(gaps, kind="stable")
    cdf = np.cumsum(pmf[order])
    exact_median = float(gaps[order][np.searchsorted(cdf, 0.5)])
    assert abs(got["median"] - exact_median) <= 1.0 / n + 1e-9


def test_a_bins_band_is_the_binomial_interval() -> None:
    m = 40
    conf = [0.35] * m + [0.85] * 25  # bins 3 and 8
    correct = [1] * 14 + [0] * 26 + [1] * 20 + [0] * 5
    bands = consistency(conf, correct, draws=8000, seed=1)["bands"]
    assert [i for i, b in enumerate(bands) if b is not None] == [3, 8]
    for b, q, size in ((3, 0.35, m), (8, 0.85, 25)):
        lo, hi = stats.binom.ppf([0.025, 0.975], size, q) / size
        assert abs(bands[b][0] - lo) <= 1.0 / size + 1e-9
        assert abs(bands[b][1] - hi) <= 1.0 / size + 1e-9


def test_p_is_uniform_on_calibrated_sets_and_small_on_miscalibrated_ones() -> None:
    rng = np.random.default_rng(11)
    calibrated, overconfident = [], []
    for _ in range(200):
        c = rng.beta(2.0, 2.0, 150)
        calibrated.append(consistency(c, rng.random(150) < c, draws=400, seed=1)["ece"]["p"])
    for _ in range(40):
        c = rng.beta(2.0, 2.0, 400)
        y = rng.random(400) < c**2  # right less often than said
        overconfident.append(consistency(c, y, draws=400, seed=1)["ece"]["p"])
    calibrated_p = np.array(calibrated)
    assert 0.01 <= np.mean(calibrated_p < 0.05) <= 0.11
    assert 0.38 <= np.mean(calibrated_p < 0.5) <= 0.62
    assert np.mean(np.array(overconfident) < 0.05) >= 0.95


def test_the_floor_shrinks_with_the_number_of_answers() -> None:
    rng = np.random.default_rng(5)
    medians = []
    for n in (100, 400, 1600):
        c = rng.uniform(0.0, 1.0, n)
        medians.append(consistency(c, rng.random(n) < c, draws=500)["ece"]["median"])
    # About 1/sqrt(n): each fourfold more answers halves it (within the draws' noise).
    assert medians[0] > medians[1] > medians[2]
    assert 1.5 < medians[0] / medians[1] < 2.7 and 1.5 < medians[1] / medians[2] < 2.7


def test_seeded_empty_and_malformed() -> None:
    c, y = [0.2, 0.9, 0.6, 0.4], [0, 1, 1, 0]
    assert consistency(c, y, seed=7) == consistency(c, y, seed=7)
    empty = consistency([], [])
    assert empty["ece"] is None and empty["ece_equal_mass"] is None
    assert empty["bands"] == [None] * 10
    with pytest.raises(ValueError, match="one length"):
        consistency([0.5, 0.5], [1])


def test_the_report_carries_the_floor_and_the_bands() -> None:
    rng = np.random.default_rng(2)
    c = rng.uniform(0.05, 0.95, 300)
    rows = [{"id": str(i), "output": "", "correct": bool(y), "calibrated": None,
             "measures": {"prob": float(v), "geo_prob": float(v) ** 0.5}}
            for i, (v, y) in enumerate(zip(c, rng.random(300) < c, strict=True))]
    report = build_report(rows, n_boot=0)
    calibrated, inflated = report["measures"]["prob"], report["measures"]["geo_prob"]
    for figures in (calibrated, inflated):
        floor = figures["if_calibrated"]["ece"]
        assert 0 < floor["median"] <= floor["p95"] and 0 < floor["p"] <= 1
        assert figures["if_calibrated"]["ece_equal_mass"]["median"] > 0
        for b in figures["bins"]:
            assert (b["band"] is None) == (b["n"] == 0)
            if b["band"] is not None:
                assert 0 <= b["band"][0] <= b["band"][1] <= 1
    assert calibrated["if_calibrated"]["ece"]["p"] > 0.05  # drawn calibrated
    assert inflated["if_calibrated"]["ece"]["p"] < 0.01  # sqrt(c) overstates every answer


def test_a_fitted_map_says_what_to_expect_on_answers_it_never_saw() -> None:
    """`fit_map`'s ``cv_ece``: over ten sets of 400 answers right with probability c³,
    its cross-validated ECE is about what the map then shows on 400 fresh answers (the
    median within a factor of 1.5), and about its own floor (the map is unbiased)."""
    from tokentrail.calibrate.apply import apply_map
    from tokentrail.calibrate.fit import fit_map

    rng = np.random.default_rng(4)
    said, fresh, floors = [], [], []
    for i in range(10):
        c = rng.uniform(0.0, 1.0, 400)
        spec = fit_map(c, rng.random(400) < c**3, seed=i)
        new = rng.uniform(0.0, 1.0, 400)
        got = [apply_map(spec, float(v), None) for v in new]
        fresh.append(ece(got, rng.random(400) < new**3))
        said.append(spec["cv_ece"]["ece"])
        floors.append(spec["cv_ece"]["if_calibrated"])
    assert 1 / 1.5 < np.median(said) / np.median(fresh) < 1.5
    assert 0.5 < np.median(said) / np.median(floors) < 2.0


def test_no_cross_validated_ece_without_a_cross_validation() -> None:
    from tokentrail.calibrate.fit import fit_map

    spec = fit_map([0.1 * k for k in range(1, 10)] * 2, [1] * 17 + [0])  # one wrong answer
    assert "cv_ece" not in spec


@pytest.mark.parametrize(("n", "q", "right"), [(40, 0.9, 31), (40, 0.9, 36), (200, 0.6, 100)])
def test_a_levels_shortfall_is_the_binomial_tail(n: int, q: float, right: int) -> None:
    """`shortfall_p`: with every answer said q, the share of draws with at most `right`
    right is the binomial CDF (scipy), the measured set counted among the draws."""
    from tokentrail.calibrate.consistency import shortfall_p

    got = shortfall_p([q] * n, [1] * right + [0] * (n - right), draws=8000, seed=2)
    assert got == pytest.approx(float(stats.binom.cdf(right, n, q)), abs=0.015)
    assert shortfall_p([], []) is None


def test_the_report_says_whether_a_level_is_overstated_beyond_its_size() -> None:
    """Answers said 0.95 and right 70% of the time (in the top level) are flagged; answers
    said 0.3 and right 30% of the time are not."""
    rows = [{"id": str(i), "output": "", "correct": i % 10 < 7, "calibrated": 0.95,
             "measures": {}} for i in range(60)]
    rows += [{"id": f"b{i}", "output": "", "correct": i % 10 < 3, "calibrated": 0.3,
              "measures": {}} for i in range(60)]
    levels = build_report(rows, n_boot=0)["levels"]
    top, low = levels[-1], next(e for e in levels if e["n"] and abs(e["confidence"] - 0.3) < 1e-9)
    assert top["n"] == 60 and top["p_shortfall"] < 0.001
    assert low["p_shortfall"] > 0.3
    assert all(e["p_shortfall"] is None for e in levels if not e["n"])


def test_the_terminal_and_the_page_show_each_levels_promise(tmp_path) -> None:
    """The levels' check reaches the reader, not only report.json: the terminal's second
    table and report.html list each level that holds answers, most confident first, with
    the figures counted here from the rows (60 said 0.95 and 42 of them right; 60 said
    0.3 and 18 right), within 80 columns."""
    import re

    from rich.console import Console

    from tokentrail.calibrate.report import print_table, write_html

    rows = [{"id": str(i), "output": "", "correct": i % 10 < 7, "calibrated": 0.95,
             "measures": {}} for i in range(60)]
    rows += [{"id": f"b{i}", "output": "", "correct": i % 10 < 3, "calibrated": 0.3,
              "measures": {}} for i in range(60)]
    report = build_report(rows, n_boot=0)
    console = Console(record=True, width=80)
    print_table(report, console)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "levels of calibrated" in text
    lines = [ln.split() for ln in text.splitlines()]
    certain = next(ln for ln in lines if ln[:1] == ["certain"])
    doubtful = next(ln for ln in lines if ln[:1] == ["doubtful"])
    assert certain[1:4] == ["60", "0.950", f"{42 / 60:.3f}"] and float(certain[4]) < 0.01
    assert doubtful[1:4] == ["60", "0.300", f"{18 / 60:.3f}"] and float(doubtful[4]) > 0.3
    names = [ln[0] for ln in lines if ln[:1] and ln[0] in ("certain", "sure", "doubtful")]
    assert names == ["certain", "doubtful"]  # empty levels are left out, the top first
    page = write_html(report, tmp_path).read_text(encoding="utf-8")
    cells = re.findall(r"<tr><td>(certain|doubtful)</td><td>(\d+)</td>", page)
    assert cells == [("certain", "60"), ("doubtful", "60")]
