"""What the same confidences would show on the same number of answers if they were
perfectly calibrated: the ECE's floor, how unusual the measured ECE is against it, and
each reliability bin's consistency band.

Consistency resampling (Bröcker and Smith, "Increasing the reliability of reliability
diagrams", Weather and Forecasting 22, 2007): outcomes are drawn as
Bernoulli(confidence) for every answer, `draws` times (seeded), and each draw is
scored with `metrics`' own conventions. An ECE is a sum of absolute gaps, so it is
above zero on any finite set even where every figure is exactly right: on a hundred
answers with confidences spread over the range a perfectly calibrated measure shows
0.06–0.08. The floor says which part of a measured ECE is that noise:

- ``median``, ``p95``: the median and 95th percentile of the ECE over the draws;
- ``p``: the share of draws whose ECE is at least the measured one (with the measured
  set counted among them, so never 0). A small ``p`` (say below 0.05) says the
  confidences are miscalibrated on this set beyond what its size explains; a large one
  says the set cannot tell them from calibrated, which on a small set is a weak claim.
- ``band`` per equal-width bin: the 2.5th and 97.5th percentiles of the bin's accuracy
  over the draws, where a calibrated measure's accuracy falls 95% of the time (drawn
  on the reliability diagram).

`shortfall_p` asks the one-sided question a confidence level's promise raises (answers
shown at a level are right at least as often as their figures say): the share of draws
in which the answers are right as rarely as they were, or more rarely. Small: the
figures overstate these answers beyond what their number explains.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .metrics import BINS, bin_index, ece, ece_equal_mass, mass_index, pairs_as_arrays

__all__ = ["DRAWS", "consistency", "shortfall_p"]

#: Draws of outcomes per measure (the Monte Carlo error of the median is then about
#: 1% of it).
DRAWS = 1000
#: Outcomes drawn at a time: bounds the memory of a large set.
_BLOCK = 4_000_000


def _gaps(c: np.ndarray, draws: int, seed: int, onehots: list[np.ndarray]) -> list[np.ndarray]:
    """Per one-hot bin matrix (answers × bins): each draw's per-bin sum of outcomes,
    (draws × bins), with outcomes drawn as Bernoulli(c) (c clipped to [0, 1])."""
    rng = np.random.default_rng(seed)
    c = np.clip(c, 0.0, 1.0)
    out: list[list[np.ndarray]] = [[] for _ in onehots]
    step = max(1, _BLOCK // max(1, len(c)))
    for start in range(0, draws, step):
        y = (rng.random((min(step, draws - start), len(c))) < c).astype(np.float64)
        for got, m in zip(out, onehots, strict=True):
            got.append(y @ m)
    return [np.concatenate(got) for got in out]


def _onehot(idx: np.ndarray, bins: int) -> np.ndarray:
    m = np.zeros((len(idx), bins))
    m[np.arange(len(idx)), idx] = 1.0
    return m


def _share(count: int, draws: int) -> float:
    """A p from `count` of `draws` drawn sets as extreme as the measured one, the measured
    set counted among them (never 0)."""
    return round((1 + count) / (1 + draws), 6)


def _floor(right: np.ndarray, m: np.ndarray, c: np.ndarray, measured: float) -> dict[str, float]:
    """The floor of one kind of ECE from each draw's per-bin sums of outcomes."""
    drawn = np.abs(right - c @ m).sum(axis=1) / len(c)
    beyond = int(np.count_nonzero(drawn >= measured - 1e-12))
    return {
        "median": round(float(np.median(drawn)), 6),
        "p95": round(float(np.percentile(drawn, 95)), 6),
        "p": _share(beyond, len(drawn)),
    }


def consistency(
    conf: Sequence[float], correct: Sequence[int | bool], draws: int = DRAWS, seed: int = 0,
    bins: int = BINS,
) -> dict[str, Any]:
    """``{"ece": floor, "ece_equal_mass": floor, "bands": [[lo, hi] or None per bin]}``
    for `conf` measured against `correct` (see the module docstring); every figure None
    without answers."""
    c, y = pairs_as_arrays(conf, correct)
    if not len(c) or draws < 1:
        return {"ece": None, "ece_equal_mass": None, "bands": [None] * bins}
    width, mass = _onehot(bin_index(c, bins), bins), _onehot(mass_index(c, bins), bins)
    by_width, by_mass = _gaps(c, draws, seed, [width, mass])
    counts = width.sum(axis=0)
    bands: list[list[float] | None] = []
    for b in range(bins):
        if not counts[b]:
            bands.append(None)
            continue
        acc = by_width[:, b] / counts[b]
        bands.append([round(float(np.percentile(acc, 2.5)), 6),
                      round(float(np.percentile(acc, 97.5)), 6)])
    return {
        "ece": _floor(by_width, width, c, ece(c, y, bins)),
        "ece_equal_mass": _floor(by_mass, mass, c, ece_equal_mass(c, y, bins)),
        "bands": bands,
    }


def shortfall_p(
    conf: Sequence[float], correct: Sequence[int | bool], draws: int = DRAWS, seed: int = 0
) -> float | None:
    """The share of draws of Bernoulli(conf) outcomes with at most as many right answers
    as `correct` has (the measured set counted among them); None without answers."""
    c, y = pairs_as_arrays(conf, correct)
    if not len(c) or draws < 1:
        return None
    (right,) = _gaps(c, draws, seed, [np.ones((len(c), 1))])
    return _share(int(np.count_nonzero(right[:, 0] <= y.sum() + 1e-9)), draws)
