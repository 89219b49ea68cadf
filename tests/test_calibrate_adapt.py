"""A calibration applied to another set: its base rate estimated from the unlabelled
answers (`tokentrail.calibrate.adapt`, Saerens et al. 2002).

The oracle is the data's own construction: answers are drawn so that right and wrong
ones have fixed confidence distributions and only the share of right answers differs
between the set a map is fitted on and the set it is applied to (label shift). There
the estimate must find the true share, and the moved figures must be better calibrated
than the map's own. The end-to-end test runs the real CLI on answers written as a
finished run's items.jsonl (`--resume`, so nothing is decoded) and checks that
report.json agrees with items.jsonl.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("sklearn", reason="pip install -e '.[calibrate]'")

from tokentrail.calibrate.adapt import MIN_ANSWERS, adapt_rows, estimate_base_rate, shift
from tokentrail.calibrate.fit import fit_calibration
from tokentrail.calibrate.metrics import ece


def draw(n: int, rate: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n answers right with probability `rate`; a right answer's confidence ~ Beta(5, 2),
    a wrong one's ~ Beta(2, 5), whatever the rate (label shift)."""
    rng = np.random.default_rng(seed)
    y = rng.random(n) < rate
    x = np.where(y, rng.beta(5, 2, n), rng.beta(2, 5, n))
    return np.clip(x, 1e-4, 1 - 1e-4), y


def rows_of(x: np.ndarray, y: np.ndarray) -> list[dict]:
    return [{"id": str(i), "correct": bool(b), "measures": {"prob": float(v)}}
            for i, (v, b) in enumerate(zip(x, y, strict=True))]


def posterior(x: np.ndarray, base: float) -> np.ndarray:
    """The exact P(right | x) at base rate `base` (Beta(5,2) against Beta(2,5): the
    likelihood ratio is (x / (1 - x))^3)."""
    lr = (x / (1 - x)) ** 3
    return base * lr / (base * lr + 1 - base)


@given(st.floats(0.01, 0.99), st.floats(0.02, 0.98), st.floats(0.02, 0.98))
def test_shift_is_bayes_with_another_prior(c: float, base: float, to: float) -> None:
    moved = shift(c, base, to)
    assert 0.0 <= moved <= 1.0
    assert shift(c, base, base) == pytest.approx(c)
    assert shift(moved, to, base) == pytest.approx(c, abs=1e-9)  # and back
    if to > base:  # a higher base rate never lowers a probability
        assert moved >= c - 1e-12


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([0.1, 0.25, 0.5, 0.75, 0.9]), st.integers(0, 2**16))
def test_the_estimate_finds_the_true_share_under_label_shift(rate: float, seed: int) -> None:
    x, y = draw(4000, rate, seed)
    base = 0.5
    got = estimate_base_rate(posterior(x, base).tolist(), base)
    assert abs(got - y.mean()) < 0.04  # a few standard errors on 4000 answers


@pytest.mark.parametrize("target", [0.15, 0.9])
def test_adapting_a_fitted_map_lowers_ece_on_a_shifted_set(target: float) -> None:
    fit_x, fit_y = draw(600, 0.5, 1)
    cal = fit_calibration(rows_of(fit_x, fit_y), {}, {"data": "a"})
    assert abs(cal.maps["prob"]["base_rate"] - fit_y.mean()) < 1e-12
    x, y = draw(1500, target, 2)
    got = [cal.answer({"prob": float(v)}) for v in x]
    rows = [{"calibrated": p} for p, _ in got]
    before = np.array([r["calibrated"] for r in rows])
    moved = adapt_rows(rows, [m for _, m in got], cal.maps)
    after = np.array([r["calibrated"] for r in rows])
    assert set(moved) == {"prob"} and moved["prob"]["n"] == 1500
    assert abs(moved["prob"]["to"] - y.mean()) < 0.06
    assert ece(before, y) > 0.1  # the map carries the other base rate
    assert ece(after, y) < ece(before, y) / 2
    assert ece(after, y) < 0.06


def test_groups_left_as_they_are() -> None:
    maps = {"prob": {"kind": "temperature", "temperature": 1.0, "bias": 0.0, "base_rate": 0.5},
            "field_prob": {"kind": "constant", "p": 0.4, "base_rate": 0.4},
            "margin": {"kind": "temperature", "temperature": 1.0, "bias": 0.0}}
    few = [{"calibrated": 0.9} for _ in range(MIN_ANSWERS - 1)]
    constant = [{"calibrated": 0.4} for _ in range(100)]
    unknown = [{"calibrated": 0.1} for _ in range(100)]
    missing = [{"calibrated": None} for _ in range(5)]
    rows = few + constant + unknown + missing
    used = (["prob"] * len(few) + ["field_prob"] * 100 + ["margin"] * 100 + [None] * 5)
    assert adapt_rows(rows, used, maps) == {}
    assert [r["calibrated"] for r in rows] == [r["calibrated"] for r in
                                               few + constant + unknown + missing]


def test_calibrate_cli_adapts_on_another_set_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("mlx_lm", reason="the demo model runs on MLX: pip install -e '.[mlx]'")
    from tokentrail.cli import main

    def finished_run(name: str, x: np.ndarray, y: np.ndarray) -> tuple[Path, Path]:
        """A labelled set and a run folder whose items.jsonl already holds every answer
        (`--resume` then decodes nothing): right answers say "yes", wrong ones "no"."""
        data, out = tmp_path / f"{name}.jsonl", tmp_path / name
        out.mkdir()
        data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": "?", "answer": "yes"})
                                + "\n" for i in range(len(x))))
        (out / "items.jsonl").write_text("".join(
            json.dumps({"id": f"q{i}", "output": "yes" if b else "no", "correct": None,
                        "measures": {"prob": float(v)}, "calibrated": None}) + "\n"
            for i, (v, b) in enumerate(zip(x, y, strict=True))))
        return data, out

    def run(*args: str) -> dict:
        code = main(["calibrate", *args, "--resume", "--bootstrap", "20", "--quiet"])
        assert code == 0, capsys.readouterr().err
        return json.loads((Path(args[2]) / "report.json").read_text())

    a_data, a_out = finished_run("a", *draw(400, 0.5, 3))
    x, y = draw(600, 0.15, 4)
    b_data, b_out = finished_run("b", x, y)
    cal = tmp_path / "a.cal.json"
    assert run(str(a_data), "--out", str(a_out), "--fit", str(cal))["adapted"] is None
    plain = run(str(b_data), "--out", str(b_out), "--calibration", str(cal), "--no-adapt")
    assert plain["adapted"] is None
    adapted = run(str(b_data), "--out", str(b_out), "--calibration", str(cal))
    assert set(adapted["adapted"]) == {"prob"}
    assert abs(adapted["adapted"]["prob"]["to"] - y.mean()) < 0.06
    assert adapted["measures"]["calibrated"]["ece"] < plain["measures"]["calibrated"]["ece"]
    rows = [json.loads(line) for line in (b_out / "items.jsonl").read_text().splitlines()]
    conf = [r["calibrated"] for r in rows]
    assert adapted["measures"]["calibrated"]["ece"] == pytest.approx(
        ece(conf, [r["correct"] for r in rows]), abs=1e-6)
    # the map's own set, the other half: the same base rate, nothing moved
    same = run(str(a_data), "--out", str(a_out), "--calibration", str(cal), "--half", "2")
    assert same["adapted"] is None
