"""A calibration applied to another question set: that set's base rate, estimated from
its own answers without their labels.

A map fitted on one set says, at each confidence, how often answers there were right;
it carries that set's base rate. Applied to a set where the model is right less (or
more) often, it over- (or under-) promises by about the difference. When the model's
confidences for right and for wrong answers look the same on both sets and only the
share of right answers differs ("label shift"), the new share can be estimated from the
unlabelled confidences: the expectation-maximisation of Saerens, Latinne and
Decaestecker (2002, "Adjusting the outputs of a classifier to new a priori
probabilities: a simple procedure", Neural Computation 14(1)). With source base rate
b and a guess q of the new one, every calibrated c becomes

    c' = (q/b) c / ((q/b) c + ((1-q)/(1-b)) (1-c)),

and q becomes the mean of the c'; repeated until q settles. q is the maximum-likelihood
base rate of the new set under label shift; a constant map (a measure that said
nothing) stays where it is, as it should, since every q is then a fixed point.

Where the shift is not only in the base rate (a family of questions the model gets right
more often while looking no surer), no estimate from unlabelled confidences can see it;
`docs/calibration.md` says so. Standard library only, like `apply`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableSequence, Sequence
from typing import Any

__all__ = ["MIN_ANSWERS", "adapt_rows", "estimate_base_rate", "shift"]

#: Fewest answers a map must calibrate in the new set before its base rate is estimated
#: (the estimate's standard error is about 0.5 / sqrt(n) at best).
MIN_ANSWERS = 30
#: The estimated base rate is kept within [BOUND, 1 - BOUND].
BOUND = 0.01


def shift(c: float, base: float, to: float) -> float:
    """Calibrated probability `c` under base rate `base`, moved to base rate `to`."""
    a = to / base * c
    b = (1.0 - to) / (1.0 - base) * (1.0 - c)
    return a / (a + b) if a + b > 0 else c


def estimate_base_rate(
    probs: Sequence[float], base: float, tol: float = 1e-7, max_iter: int = 1000
) -> float:
    """The base rate of the answers whose calibrated probabilities (under source base
    rate `base`) are `probs`, by expectation-maximisation (see the module)."""
    if not probs or not BOUND <= base <= 1.0 - BOUND:
        return base
    q = base
    for _ in range(max_iter):
        nq = math.fsum(shift(c, base, q) for c in probs) / len(probs)
        nq = min(max(nq, BOUND), 1.0 - BOUND)
        if abs(nq - q) < tol:
            return nq
        q = nq
    return q


def adapt_rows(
    rows: MutableSequence[dict[str, Any]],
    used: Sequence[str | None],
    maps: Mapping[str, Mapping[str, Any]],
) -> dict[str, dict[str, Any]]:
    """Move each row's ``calibrated`` to its set's estimated base rate, per map (`used[i]`
    is the measure whose map calibrated row i): rows calibrated by one map are one group.
    A group is left as it is when it has fewer than `MIN_ANSWERS` answers, its map is a
    constant (a measure that told nothing: no evidence to move it) or records no
    ``base_rate`` (files fitted before it was stored). Returns, per measure
    adapted, ``{"n", "from", "to"}`` (source and estimated base rate)."""
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(used):
        if name is not None and rows[i].get("calibrated") is not None:
            groups.setdefault(name, []).append(i)
    out: dict[str, dict[str, Any]] = {}
    for name, idx in groups.items():
        spec = maps[name]
        base = spec.get("base_rate")
        if spec.get("kind") == "constant" or not isinstance(base, (int, float)):
            continue
        if len(idx) < MIN_ANSWERS:
            continue
        if not BOUND <= base <= 1.0 - BOUND:
            continue
        to = estimate_base_rate([rows[i]["calibrated"] for i in idx], float(base))
        for i in idx:
            rows[i]["calibrated"] = shift(rows[i]["calibrated"], float(base), to)
        out[name] = {"n": len(idx), "from": round(float(base), 6), "to": round(to, 6)}
    return out
