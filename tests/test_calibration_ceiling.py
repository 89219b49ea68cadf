"""The most confident level is a promise: a map gives it only as far as the answers it
was fitted on back it (`tokentrail.calibrate.fit.top_ceiling`).

The oracle is statistics, not the code under test: the Clopper-Pearson lower bound for
k = n successes is alpha ** (1 / n); and on answers whose measure is calibrated by
construction (right with probability equal to the measure), a map calibrated on average
overstates the top level about half the time by sampling noise, while the capped map
must do so rarely.
"""

from __future__ import annotations

import pytest

for needed in ("numpy", "sklearn"):  # the calibrate extra
    pytest.importorskip(needed, reason="pip install -e '.[calibrate]'")
import tokentrail.calibrate.fit as fit  # noqa: E402

np = fit.np  # the fitter's own numpy

from tokentrail.calibrate import Calibration  # noqa: E402
from tokentrail.calibrate.apply import apply_map  # noqa: E402
from tokentrail.errors import CalibrationError  # noqa: E402
from tokentrail.segment import CONFIDENCE_LEVELS  # noqa: E402

TOP, TOP_BACKING, UNBACKED = fit.TOP, fit.TOP_BACKING, fit.UNBACKED
fit_map, top_ceiling = fit.fit_map, fit.top_ceiling


def test_the_ceiling_is_the_one_sided_lower_bound_of_the_top_answers() -> None:
    held = np.full(30, 0.95)
    assert CONFIDENCE_LEVELS[-1] == TOP
    assert CONFIDENCE_LEVELS[-2] < UNBACKED < TOP and len(repr(UNBACKED)) <= 5  # shown as is
    # 30 of 30 right: the lower bound is (1 - backing) ** (1 / 30) = 0.9478...
    assert top_ceiling(held, np.ones(30)) == pytest.approx((1 - TOP_BACKING) ** (1 / 30))
    # 28 of 30 right: the bound (about 0.87) is below the level: capped just under it
    assert top_ceiling(held, np.array([1.0] * 28 + [0.0] * 2)) == UNBACKED
    # nothing held out reached the level, or none of it was right: just under it
    assert top_ceiling(np.full(30, 0.5), np.ones(30)) == UNBACKED
    assert top_ceiling(held, np.zeros(30)) == UNBACKED
    # answers below the level do not count for or against it
    mixed = np.concatenate([np.full(100, 0.3), np.full(60, 0.97)])
    y = np.concatenate([np.zeros(100), np.ones(60)])
    assert top_ceiling(mixed, y) == pytest.approx((1 - TOP_BACKING) ** (1 / 60))


def test_a_map_never_says_more_than_its_ceiling() -> None:
    spec = {"kind": "temperature", "temperature": 0.5, "bias": 1.0, "ceiling": 0.8}
    assert apply_map({**spec, "ceiling": 1.0}, 0.99) > 0.99
    assert apply_map(spec, 0.99) == 0.8
    assert apply_map(spec, 0.1) == apply_map({**spec, "ceiling": 1.0}, 0.1) < 0.8
    for bad in ("high", 0, 1.5, [1]):
        with pytest.raises(CalibrationError, match="malformed"):
            Calibration.from_dict({
                "format": "tokentrail-calibration",
                "maps": {"geo_prob": {**spec, "ceiling": bad}},
            })


def test_thin_evidence_never_reaches_the_top_level() -> None:
    """Forty answers, the sure ones all right: isotonic regression with its smoothing
    would say about 0.93 at the top; forty answers back no certainty."""
    rng = np.random.default_rng(3)
    c = np.concatenate([rng.uniform(0.0, 0.5, 30), rng.uniform(0.95, 1.0, 10)])
    y = np.concatenate([(rng.random(30) < 0.2).astype(float), np.ones(10)])
    spec = fit_map(c, y)
    assert spec["ceiling"] < CONFIDENCE_LEVELS[-1]
    assert max(apply_map(spec, v) for v in np.linspace(0, 1, 101)) < CONFIDENCE_LEVELS[-1]


def test_ample_evidence_keeps_the_top_level() -> None:
    """A thousand answers with the measure at 0.99, right 99% of the time: the top level
    stays, and what it says is no more than the rate."""
    rng = np.random.default_rng(4)
    c = np.concatenate([rng.uniform(0.0, 0.6, 1000), np.full(1000, 0.99)])
    y = (rng.random(2000) < c).astype(float)
    spec = fit_map(c, y)
    top = apply_map(spec, 0.99)
    assert CONFIDENCE_LEVELS[-1] <= top <= spec["ceiling"]
    assert top <= y[1000:].mean()


def _overstated(spec: dict, rng: np.random.Generator) -> bool | None:
    """On a fresh sample of answers calibrated by construction: whether the answers the
    map shows at the top level are right less often than it says (None: none shown)."""
    c = rng.beta(4, 1, 2000)
    y = rng.random(2000) < c
    p = np.array([apply_map(spec, float(v)) for v in c])
    top = p >= CONFIDENCE_LEVELS[-1]
    if not top.any():
        return None
    return bool(y[top].mean() < p[top].mean())


def test_the_top_level_is_rarely_overstated_where_an_average_fit_is_half_the_time() -> None:
    """24 fits on 400 answers each, checked on fresh answers (seeded: 12 of 24 average
    fits overstate the top level; 1 of the 17 capped ones that show it does: the ceiling
    is a one-sided 95% bound)."""
    rng = np.random.default_rng(5)
    capped, uncapped = [], []
    for _ in range(24):
        c = rng.beta(4, 1, 400)  # a measure mostly near 1, calibrated: P(right) = c
        spec = fit_map(c, rng.random(400) < c)
        capped.append(_overstated(spec, rng))
        uncapped.append(_overstated({**spec, "ceiling": None}, rng))
    shown = [v for v in uncapped if v is not None]
    assert len(shown) >= 20
    assert sum(shown) >= 0.3 * len(shown)  # the average fit: a coin flip at the top
    kept = [v for v in capped if v is not None]
    assert len(kept) >= 15  # 400 answers this sure do back the top level, mostly
    assert sum(kept) <= 0.1 * len(kept)  # and it is rarely overstated


def test_the_fit_summary_says_how_far_the_top_level_is_backed(tmp_path) -> None:
    import json

    from tokentrail.calibrate.cli import fit_summary

    def saved(ceiling: float | None) -> str:
        spec = {"kind": "temperature", "temperature": 0.5, "bias": 0.0, "rows": "free"}
        if ceiling is not None:
            spec["ceiling"] = ceiling
        choice = {"kind": "constant", "p": 0.5, "rows": "choice", "ceiling": UNBACKED}
        path = tmp_path / f"{ceiling}.json"
        path.write_text(json.dumps({
            "format": "tokentrail-calibration", "ranking": ["field_prob", "min_prob"],
            "maps": {"field_prob": choice, "min_prob": spec},
        }))
        return fit_summary(str(path))

    # the free-text answers' measure is named, not the choices' ranked above it
    assert "answers use min_prob (temperature)" in saved(0.948)
    assert saved(0.948).endswith("is backed by these answers up to 0.948")
    assert saved(UNBACKED).endswith("is not backed by these answers: nothing will be shown there")
    assert saved(None).endswith("has no ceiling")
    binned = tmp_path / "binned.json"
    binned.write_text(json.dumps({"format": "tokentrail-calibration", "maps": {"min_prob": {
        "kind": "isotonic", "x": [0.0, 1.0], "y": [0.1, 0.8],
        "bins": {"edges": [0.3, 0.6], "p": [0.2, 0.4, 0.7]}}}}))
    assert "answers use min_prob (isotonic in 3 bins)" in fit_summary(str(binned))
