"""How well a confidence measure tells right answers from wrong ones, and whether its
numbers are probabilities: ECE, Brier score, AUROC, PRR, with bootstrap intervals.

`conf` is the measure per answer (in [0, 1], higher = surer), `correct` 1 or 0 per
answer. Conventions:

- ``ece``: 10 equal-width bins [0, 0.1), ..., [0.9, 1.0] (1.0 in the last); the
  size-weighted mean of |accuracy - mean confidence| per bin. ``ece_equal_mass``: the
  same over 10 bins holding equal numbers of answers, cut at the confidences' quantiles
  (scikit-learn's ``calibration_curve(strategy="quantile")``): equal confidences share
  a bin.
- ``brier``: mean squared difference between confidence and correctness.
- ``auroc``: the probability that a right answer has a higher confidence than a wrong
  one (ties count half); None with only one class.
- ``prr``: lm-polygraph's Prediction Rejection Ratio. Answers are rejected from the least
  confident up; the curve is the mean correctness of those kept, at each number kept;
  PRR = (area of the measure's curve - area of random rejection) / (area of the oracle's
  curve, which rejects wrong answers first, - random's). 1 is perfect, 0 is random.
  Answers of equal confidence count as rejected in random order (the expected curve,
  as AUROC counts ties half), so no figure depends on the answers' order.
- ``ci95``: percentile intervals of each figure over bootstrap resamples of the answers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = [
    "BINS",
    "auroc",
    "bin_index",
    "bootstrap_ci",
    "brier",
    "ece",
    "ece_equal_mass",
    "mass_index",
    "pairs_as_arrays",
    "prr",
    "reliability_bins",
    "summarize",
]

#: Bins of the ECE and the reliability diagram.
BINS = 10
Array = np.ndarray


def pairs_as_arrays(conf: Sequence[float], correct: Sequence[int | bool]) -> tuple[Array, Array]:
    """`conf` and `correct` as float arrays; ValueError unless two lists of one length."""
    c = np.asarray(conf, dtype=np.float64)
    y = np.asarray(correct, dtype=np.float64)
    if c.shape != y.shape or c.ndim != 1:
        raise ValueError(f"conf and correct must be two lists of one length, got "
                         f"{c.shape} and {y.shape}")
    return c, y


def bin_index(c: Array, bins: int = BINS) -> Array:
    """Each confidence's equal-width bin (1.0 in the last)."""
    return np.minimum((c * bins).astype(np.int64), bins - 1)


def mass_index(c: Array, bins: int = BINS) -> Array:
    """Each confidence's equal-mass bin, cut at the confidences' quantiles as
    scikit-learn's ``calibration_curve(strategy="quantile")`` cuts them."""
    edges = np.percentile(c, np.linspace(0.0, 100.0, bins + 1))
    return np.searchsorted(edges[1:-1], c)


def ece(conf: Sequence[float], correct: Sequence[int | bool], bins: int = BINS) -> float:
    """Expected calibration error over `bins` equal-width bins."""
    c, y = pairs_as_arrays(conf, correct)
    if not len(c):
        return float("nan")
    idx = bin_index(c, bins)
    gap = np.bincount(idx, weights=y - c, minlength=bins)  # per bin: sum(y) - sum(c)
    return float(np.abs(gap).sum() / len(c))


def ece_equal_mass(
    conf: Sequence[float], correct: Sequence[int | bool], bins: int = BINS
) -> float:
    """Expected calibration error over `bins` bins of (nearly) equal count: cut at the
    confidences' quantiles as scikit-learn's ``calibration_curve(strategy="quantile")``
    cuts them, so that equal confidences always share a bin and the figure does not
    depend on the answers' order (a map that says a few figures puts many answers on
    each)."""
    c, y = pairs_as_arrays(conf, correct)
    if not len(c):
        return float("nan")
    gap = np.bincount(mass_index(c, bins), weights=y - c, minlength=bins)
    return float(np.abs(gap).sum() / len(c))


def brier(conf: Sequence[float], correct: Sequence[int | bool]) -> float:
    """Mean squared error of the confidence as a probability of being right."""
    c, y = pairs_as_arrays(conf, correct)
    return float(np.mean((c - y) ** 2)) if len(c) else float("nan")


def _tie_groups(c: Array) -> tuple[Array, Array, Array]:
    """(order, starts, ends): `c`'s stable ascending order, and where each run of equal
    confidences starts and ends in it."""
    order = np.argsort(c, kind="stable")
    sorted_c = c[order]
    starts = np.flatnonzero(np.r_[True, sorted_c[1:] != sorted_c[:-1]])
    return order, starts, np.r_[starts[1:], len(c)]


def _ranks(c: Array) -> Array:
    """1-based ranks, ties given their average rank."""
    order, starts, ends = _tie_groups(c)
    ranks = np.empty(len(c))
    for s, e in zip(starts, ends, strict=True):
        ranks[order[s:e]] = (s + e + 1) / 2.0
    return ranks


def auroc(conf: Sequence[float], correct: Sequence[int | bool]) -> float | None:
    """Area under the ROC curve of `conf` separating right (1) from wrong (0)."""
    c, y = pairs_as_arrays(conf, correct)
    pos = int(y.sum())
    neg = len(y) - pos
    if pos == 0 or neg == 0:
        return None
    r = _ranks(c)
    return float((r[y == 1].sum() - pos * (pos + 1) / 2) / (pos * neg))


def _kept_area(quality_in_reject_order: Array) -> float:
    """Mean, over k = n..1 answers kept, of the mean quality of the k kept, where the
    answers are rejected in the given order (the first one first)."""
    q = quality_in_reject_order[::-1]  # kept first
    n = len(q)
    return float(np.mean(np.cumsum(q) / np.arange(1, n + 1)))


def _tied_means(c: Array, y: Array) -> Array:
    """`y` in rejection order (least confident first), each answer's value replaced by
    the mean of the answers with its confidence: the expected kept curve when ties are
    rejected in random order, so that equal confidences (a map's few figures, a level)
    give one figure whatever the answers' order."""
    order, starts, ends = _tie_groups(c)
    sizes = ends - starts
    return np.repeat(np.add.reduceat(y[order], starts) / sizes, sizes)


def prr(conf: Sequence[float], correct: Sequence[int | bool]) -> float | None:
    """lm-polygraph's Prediction Rejection Ratio of `conf` (see the module docstring)."""
    c, y = pairs_as_arrays(conf, correct)
    if len(c) < 2:
        return None
    measure = _kept_area(_tied_means(c, y))
    oracle = _kept_area(np.sort(y))
    rand = float(y.mean())
    if oracle - rand <= 0:
        return None
    return (measure - rand) / (oracle - rand)


def reliability_bins(
    conf: Sequence[float], correct: Sequence[int | bool], bins: int = BINS
) -> list[dict[str, float | int | None]]:
    """Per equal-width bin: its range, count, mean confidence and accuracy."""
    c, y = pairs_as_arrays(conf, correct)
    idx = bin_index(c, bins)
    out = []
    for b in range(bins):
        m = idx == b
        n = int(m.sum())
        out.append({
            "lo": b / bins, "hi": (b + 1) / bins, "n": n,
            "confidence": float(c[m].mean()) if n else None,
            "accuracy": float(y[m].mean()) if n else None,
        })
    return out


#: The figures `summarize` reports, by name.
FIGURES: dict[str, Callable[[Array, Array], float | None]] = {
    "ece": ece,
    "ece_equal_mass": ece_equal_mass,
    "brier": brier,
    "auroc": auroc,
    "prr": prr,
}


def bootstrap_ci(
    conf: Sequence[float],
    correct: Sequence[int | bool],
    n_boot: int = 1000,
    seed: int = 0,
) -> dict[str, list[float] | None]:
    """95% percentile intervals of every figure over `n_boot` resamples (seeded)."""
    c, y = pairs_as_arrays(conf, correct)
    rng = np.random.default_rng(seed)
    got: dict[str, list[float]] = {name: [] for name in FIGURES}
    if len(c) and n_boot > 0:
        for _ in range(n_boot):
            pick = rng.integers(0, len(c), len(c))
            for name, fn in FIGURES.items():
                v = fn(c[pick], y[pick])
                if v is not None and np.isfinite(v):
                    got[name].append(v)
    return {
        name: [float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5))] if v else None
        for name, v in got.items()
    }


def summarize(
    conf: Sequence[float], correct: Sequence[int | bool], n_boot: int = 1000, seed: int = 0
) -> dict[str, object]:
    """Every figure of one measure, with its n and 95% intervals."""
    c, y = pairs_as_arrays(conf, correct)
    out: dict[str, object] = {"n": len(c)}
    for name, fn in FIGURES.items():
        v = fn(c, y)
        out[name] = None if v is None or not np.isfinite(v) else round(float(v), 6)
    out["ci95"] = {
        k: None if v is None else [round(x, 6) for x in v]
        for k, v in bootstrap_ci(c, y, n_boot, seed).items()
    }
    return out
