"""Fitting calibration maps: per measure, temperature scaling, isotonic regression or a
constant (the base rate), the one with the lowest cross-validated log loss kept.

Answers decoded as a constrained choice (they carry ``field_prob``) and free-text
answers are different tasks to the model: a choice's tokens are forced to be one of a
few strings, so their probability is high whether or not the choice is right. Each
measure is therefore fitted on the free-text answers alone and ``field_prob`` on the
choices alone (a set that is all choices fits every measure on the choices); each map
records which answers it was fitted on (``rows``) and applies only to answers of that
kind (`tokentrail.calibrate.apply.Calibration.answer`).

A choice among k is right 1/k of the time by guessing, so a constant map for choices
also stores the rate as skill above guessing, s = mean((right - 1/k) / (1 - 1/k)), and
gives an answer with k choices 1/k + (1 - 1/k) s: a map fitted on two-way questions then
says something sensible about four-way ones (each row's ``measures.chance`` is its 1/k).
For a number of choices it was fitted on, it gives that number's own rate, pooled with
the skill's figure (``by_k``, `_rates_by_k`).

The most confident level is a promise (a segment or answer shown there is right at least
as often as its calibrated probability says), so a map gives it only as far as the answers
it was fitted on back it: each map has a ``ceiling``, the one-sided `TOP_BACKING` (95%)
Clopper-Pearson lower bound on how often the answers its cross-validation put at that
level (held out, calibrated at least `TOP`) were right, and it never says more than that.
A map whose held-out answers never reached the level, or whose bound falls below it, is
capped at `UNBACKED` (0.899): nothing it says is shown at the top level, and below it
the map's own values stand. This is the binomial-tail bound that selective classification uses to
certify a threshold's risk (Geifman and El-Yaniv, "Selective classification for deep
neural networks", 2017). Without it a map calibrated on average overstates the top level
about half the time by sampling noise alone (fitted on one half of facts.jsonl and shown
on the other, 100 random halvings: 54 of the 94 that showed the level overstated it;
generated.jsonl 32 of 47); with an 80% bound, 7 of 9 and 2 of 2: the fits that pass a
loose bound are the lucky draws, so the bound is 95% (none of 120 random halvings of
facts, knowledge and generated then shows the level; benchmarks/results/calibration.md).
With a model of SmolLM2-135M's size the top level is then rarely shown; a model right on
hundreds of answers the fit saw at the top keeps it.

Temperature scaling here is logistic regression on the measure's logit (a temperature
and a shift: Platt scaling); isotonic regression is scikit-learn's, each of its levels
Laplace-smoothed by the answers behind it (so that a block of a few answers, all right,
does not claim certainty) and kept within [0.01, 0.99]. The chosen kind is fitted on
every answer.

A free-text temperature or isotonic map may then be binned (scaling-binning, Kumar, Liang
and Ma, "Verified uncertainty calibration", NeurIPS 2019): the measure's range cut into a
few pieces holding about as many answers each, each piece saying the mean of the curve
over its answers. The same cross-validation keeps the fewest pieces of `BIN_COUNTS` whose
log loss is within one standard error of the best (the curve itself included): on a few
hundred answers a map then says a handful of figures, each a claim about a group large
enough to check, and is measurably closer to calibrated on answers it never saw
(benchmarks/results/calibration.md).

Each map also says what to expect of it on answers it never saw, from the same
cross-validation (``cv_ece``): the ECE of its held-out probabilities, and the ECE those
probabilities would show if they were perfectly calibrated (`consistency`'s median), so
that a set too small to be split still says how close the map comes and how much of the
figure is the set's size.

Needs numpy and scikit-learn (`pip install 'tokentrail[calibrate]'`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import CalibrationError
from ..segment import CONFIDENCE_LEVELS
from .apply import EPS, FORMAT, Calibration, apply_map, is_choice
from .consistency import consistency
from .measures import MEASURES, SEGMENT_MEASURES
from .metrics import ece

__all__ = ["fit_bins", "fit_calibration", "fit_kind", "fit_map", "log_loss", "top_ceiling"]

#: Isotonic outputs are kept within [ISO_FLOOR, 1 - ISO_FLOOR].
ISO_FLOOR = 0.01
#: Folds of the cross-validation that picks the kind of map, and how many times it is
#: repeated with another shuffle (a choice made on a hundred answers is noisy).
FOLDS = 5
REPEATS = 4
#: The kinds of map the cross-validation chooses among, simplest first.
KINDS = ("constant", "temperature", "isotonic")
#: For choices: an isotonic step function of ``field_prob`` fitted on one number of
#: choices says nothing about another (on facts.jsonl's four-way capitals it was chosen,
#: and on generated.jsonl's two-way questions its ECE was 0.30 against 0.07 for the
#: chance-adjusted constant), so choices get the smooth kinds only.
CHOICE_KINDS = ("constant", "temperature")
#: How many answers' worth of the shared skill a constant map's rate for one number of
#: choices is pooled with (`_rates_by_k`).
CHOICE_POOL = 10
#: The numbers of pieces a free-text temperature or isotonic map may be binned into
#: (scaling-binning, `fit_bins`), fewest first; the cross-validation weighs them against
#: the map's own curve, unbinned, and keeps the fewest within one standard error of the
#: best (`_choose`).
BIN_COUNTS = (2, 3, 4, 5, 6, 8, 10)
#: Draws of `consistency` behind a map's cross-validated ECE floor (``cv_ece``).
CV_DRAWS = 400
#: Fewest answers a measure needs to be fitted.
MIN_ITEMS = 10
#: The calibrated probability at which the most confident level begins.
TOP = CONFIDENCE_LEVELS[-1]
#: One-sided confidence with which a map's ceiling backs the most confident level.
TOP_BACKING = 0.95
#: The ceiling of a map that does not back the most confident level: the level below it,
#: at its top (0.899, not the float just under 0.9, which prints as 0.9).
UNBACKED = round(TOP - 0.001, 3)


def _sklearn() -> tuple[Any, Any, Any]:
    try:
        from sklearn.isotonic import IsotonicRegression
        from sklearn.linear_model import LogisticRegression
        from sklearn.model_selection import StratifiedKFold
    except ImportError:
        raise CalibrationError(
            "fitting a calibration needs scikit-learn: pip install 'tokentrail[calibrate]'"
        ) from None
    return IsotonicRegression, LogisticRegression, StratifiedKFold


def log_loss(p: Sequence[float] | np.ndarray, y: Sequence[int] | np.ndarray) -> float:
    """Mean negative log-likelihood of outcomes `y` under probabilities `p`."""
    q = np.clip(np.asarray(p, dtype=np.float64), EPS, 1 - EPS)
    t = np.asarray(y, dtype=np.float64)
    return float(-np.mean(t * np.log(q) + (1 - t) * np.log(1 - q)))


def _logits(c: np.ndarray) -> np.ndarray:
    q = np.clip(c, EPS, 1 - EPS)
    return np.log(q / (1 - q))


def fit_kind(
    kind: str, c: np.ndarray, y: np.ndarray, chance: np.ndarray | None = None
) -> dict[str, Any]:
    """One map of `kind` (``constant``, ``temperature`` or ``isotonic``) fitted on
    measure values `c` and outcomes `y`; `chance` (1/k per answer) adds a constant's
    skill above guessing."""
    iso_cls, lr_cls, _ = _sklearn()
    if y.min() == y.max() or kind == "constant":  # only a rate to state (Laplace)
        spec: dict[str, Any] = {"kind": "constant", "p": (float(y.sum()) + 1.0) / (len(y) + 2.0)}
        if chance is not None:  # choices: the rate as skill above guessing (see the module)
            spec["skill"] = float(np.mean((y - chance) / (1.0 - chance)))
            spec["by_k"] = _rates_by_k(y, chance, spec["skill"])
        return spec
    if kind == "temperature":
        lr = lr_cls(C=1e4, max_iter=1000).fit(_logits(c)[:, None], y.astype(int))
        a = float(lr.coef_[0, 0])
        if a <= 1e-6:  # the measure does not rise with correctness: a constant is honest
            return {"kind": "constant", "p": float(y.mean())}
        return {"kind": "temperature", "temperature": 1.0 / a, "bias": float(lr.intercept_[0])}
    iso = iso_cls(y_min=0.0, y_max=1.0, out_of_bounds="clip").fit(c, y)
    return {"kind": "isotonic", "x": [float(v) for v in iso.X_thresholds_],
            "y": _smoothed_blocks(iso, c)}


def _rates_by_k(y: np.ndarray, chance: np.ndarray, skill: float) -> dict[str, float]:
    """Per number of choices k seen: the rate right, pooled with what the shared skill says
    for k ((right + POOL * prior) / (n + POOL), prior = 1/k + (1 - 1/k) skill). Yes/no
    questions and four-way ones are often different tasks, not one skill at two levels of
    guessing (on knowledge.jsonl: yes/no capitals right 40%, below guessing, four-way
    opposites 45%, well above it); a number of choices the fit never saw gets the skill."""
    ks = np.rint(1.0 / chance).astype(int)
    out = {}
    for k in sorted(set(ks.tolist())):
        sel = ks == k
        prior = min(max(1.0 / k + (1.0 - 1.0 / k) * skill, 0.0), 1.0)  # a mean skill
        out[str(k)] = float((y[sel].sum() + CHOICE_POOL * prior) / (sel.sum() + CHOICE_POOL))
    return out


def _smoothed_blocks(iso: Any, c: np.ndarray) -> list[float]:
    """The isotonic fit's levels, each Laplace-smoothed by the number of answers in its
    block ((right + 1) / (n + 2)): a top block of 12 answers, all right, says 0.93, not
    0.99. Smoothing blocks of different sizes can break monotonicity, so the levels are
    made non-decreasing again (a running maximum)."""
    levels = iso.predict(c)
    sizes: dict[float, int] = {}
    for v in levels:
        sizes[float(v)] = sizes.get(float(v), 0) + 1
    out, top = [], 0.0
    for v in (float(v) for v in iso.y_thresholds_):
        n = sizes.get(v, 0)
        top = max(top, (v * n + 1.0) / (n + 2.0) if n else v)
        out.append(min(max(top, ISO_FLOOR), 1.0 - ISO_FLOOR))
    return out


def _item_losses(p: Sequence[float], y: np.ndarray) -> np.ndarray:
    q = np.clip(np.asarray(p, dtype=np.float64), EPS, 1 - EPS)
    return -(y * np.log(q) + (1 - y) * np.log(1 - q))


def _cv_losses(
    kind: str, c: np.ndarray, y: np.ndarray, seed: int, chance: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """Each answer's held-out log loss and held-out probability under `kind`, each
    averaged over the repeats (None: too few of the rarer outcome to cross-validate)."""

    def predict(train: np.ndarray, test: np.ndarray) -> dict[str, np.ndarray]:
        spec = fit_kind(kind, c[train], y[train], None if chance is None else chance[train])
        return {kind: _apply_each(spec, c, chance, test)}

    got = _cross_validate(c, y, seed, predict)
    return None if got is None else got[kind]


def _cross_validate(
    c: np.ndarray, y: np.ndarray, seed: int,
    predict: Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]],
) -> dict[str, tuple[np.ndarray, np.ndarray]] | None:
    """`FOLDS`-fold cross-validation repeated `REPEATS` times: `predict(train, test)`
    gives each option's probabilities for the `test` answers from a fit on `train`; per
    option, each answer's held-out log loss and probability averaged over the repeats
    (None: too few of the rarer outcome to cross-validate)."""
    _, _, kfold = _sklearn()
    minority = int(min(y.sum(), len(y) - y.sum()))
    folds = min(FOLDS, minority)
    if folds < 2:
        return None
    total: dict[str, np.ndarray] = {}
    held: dict[str, np.ndarray] = {}
    for r in range(REPEATS):
        split = kfold(n_splits=folds, shuffle=True, random_state=seed + r).split(c, y)
        for train, test in split:
            for name, p in predict(train, test).items():
                total.setdefault(name, np.zeros(len(y)))[test] += _item_losses(p, y[test])
                held.setdefault(name, np.zeros(len(y)))[test] += p
    return {name: (total[name] / REPEATS, held[name] / REPEATS) for name in total}


def fit_bins(
    spec: Mapping[str, Any], c: np.ndarray, count: int, said: np.ndarray | None = None
) -> dict[str, Any] | None:
    """Scaling-binning (Kumar, Liang and Ma, 2019): the measure values `c` cut into `count`
    pieces holding about as many answers each, each piece's probability the mean of what
    the map `spec` says over its answers (`said`, where already computed: a map's
    ``bins``, `tokentrail.calibrate.apply`). None where the values allow fewer than two
    pieces."""
    ordered = np.sort(c)
    cuts = {float(ordered[round(len(c) * b / count)]) for b in range(1, count)}
    edges = sorted(v for v in cuts if v > ordered[0])  # no piece left empty
    if not edges:
        return None
    if said is None:
        said = _apply_each(spec, c, None, np.arange(len(c)))
    piece = np.searchsorted(edges, c, side="right")
    return {"edges": edges, "p": [float(said[piece == b].mean()) for b in range(len(edges) + 1)]}


def _cv_bins(
    kind: str, c: np.ndarray, y: np.ndarray, seed: int
) -> dict[str, tuple[np.ndarray, np.ndarray]] | None:
    """Cross-validated losses and probabilities of `kind`'s map binned into each of
    `BIN_COUNTS` pieces (keyed by the count, as text)."""

    def predict(train: np.ndarray, test: np.ndarray) -> dict[str, np.ndarray]:
        spec = fit_kind(kind, c[train], y[train])
        said = _apply_each(spec, c, None, train)  # the curve over the fold, once
        out = {}
        for count in BIN_COUNTS:
            bins = fit_bins(spec, c[train], count, said)
            binned = spec if bins is None else {**spec, "bins": bins}
            out[str(count)] = _apply_each(binned, c, None, test)
        return out

    return _cross_validate(c, y, seed, predict)


def _apply_each(
    spec: Mapping[str, Any], c: np.ndarray, chance: np.ndarray | None, rows: np.ndarray
) -> np.ndarray:
    """The map `spec` applied to the answers at `rows` (each with its 1/k, for choices)."""
    return np.array([apply_map(spec, float(c[i]), None if chance is None else float(chance[i]))
                     for i in rows])


def top_ceiling(held: np.ndarray, y: np.ndarray) -> float:
    """The most a map may say (see the module): the `TOP_BACKING` lower bound
    (Clopper-Pearson) on the share right of the answers whose held-out probability
    `held` reached `TOP`, and never below `UNBACKED`."""
    top = held >= TOP
    n, k = int(top.sum()), int(y[top].sum())
    if k == 0:  # none reached the level, or none of those was right
        return UNBACKED
    from scipy.stats import beta  # scikit-learn's own dependency

    return max(float(beta.ppf(1.0 - TOP_BACKING, k, n - k + 1)), UNBACKED)


def _choose(losses: Mapping[str, np.ndarray], order: Sequence[str] = KINDS) -> str:
    """The simplest option (in `order`; by default `KINDS`': constant, temperature, isotonic) whose
    cross-validated loss is within one standard error of the best one's, the error taken
    over the answers' paired differences (the one-standard-error rule of Breiman et
    al., 1984): on a hundred answers a more flexible map must win by more than the
    noise to be kept."""
    best = min(losses, key=lambda k: float(losses[k].mean()))
    for kind in order:
        if kind not in losses:
            continue
        diff = losses[kind] - losses[best]
        se = float(diff.std(ddof=1)) / math.sqrt(len(diff)) if len(diff) > 1 else 0.0
        if float(diff.mean()) <= se:
            return kind
    return best


def fit_map(
    conf: Sequence[float],
    correct: Sequence[int | bool],
    seed: int = 0,
    chance: Sequence[float] | None = None,
) -> dict[str, Any]:
    """Temperature scaling, isotonic regression or a constant for one measure, chosen
    by repeated cross-validated log loss (`_choose`), fitted on all of it; a free-text
    curve binned (``bins``, `fit_bins`) into the fewest of `BIN_COUNTS` pieces the same
    rule keeps over the curve itself; with `cv_log_loss` per kind (and ``binned``), `n`,
    its `ceiling` (`top_ceiling` of what is kept's held-out probabilities) and, where it
    was cross-validated, `cv_ece` (those probabilities' ECE and its floor)."""
    c = np.asarray(conf, dtype=np.float64)
    y = np.asarray(correct, dtype=np.float64)
    ch = None if chance is None else np.asarray(chance, dtype=np.float64)
    kinds = KINDS if ch is None else CHOICE_KINDS
    per_item = {kind: _cv_losses(kind, c, y, seed, ch) for kind in kinds}
    scored = {k: v[0] for k, v in per_item.items() if v is not None}
    losses = {k: None if v is None else float(v[0].mean()) for k, v in per_item.items()}
    kind = _choose(scored) if scored else "temperature"
    spec = fit_kind(kind, c, y, ch)
    cv = per_item.get(kind)
    if cv is not None and ch is None and spec["kind"] in ("temperature", "isotonic"):
        options = {**(_cv_bins(kind, c, y, seed) or {}), "curve": cv}
        pick = _choose({k: v[0] for k, v in options.items()}, [*map(str, BIN_COUNTS), "curve"])
        bins = None if pick == "curve" else fit_bins(spec, c, int(pick))
        if bins is not None:
            spec["bins"] = bins
            cv = options[pick]
            losses["binned"] = float(cv[0].mean())
    # nothing held out (too few of one outcome): the map's own answers are bounded
    held = cv[1] if cv is not None else _apply_each(spec, c, ch, np.arange(len(c)))
    spec["ceiling"] = top_ceiling(held, y)
    spec["cv_log_loss"] = {k: None if v is None else round(v, 6) for k, v in losses.items()}
    if cv is not None:  # what to expect on answers like these that the map never saw
        spec["cv_ece"] = {"ece": round(ece(held, y), 6),
                          "if_calibrated": consistency(held, y, CV_DRAWS, seed)["ece"]["median"]}
    spec["n"] = len(c)
    return spec


def _rows_for(name: str, rows: Sequence[Mapping[str, Any]]) -> tuple[str, list[Any]]:
    """(kind, answers) a measure is fitted on: ``field_prob`` on the choices, the others
    on the free-text answers, or on every answer where either kind is too rare."""
    choice = [r for r in rows if is_choice(r["measures"])]
    free = [r for r in rows if not is_choice(r["measures"])]
    if min(len(choice), len(free)) < MIN_ITEMS:
        return "all", list(rows)
    return ("choice", choice) if name == "field_prob" else ("free", free)


def fit_calibration(
    rows: Sequence[Mapping[str, Any]],
    fingerprint: Mapping[str, Any],
    fitted_on: Mapping[str, Any],
    seed: int = 0,
) -> Calibration:
    """Fit every measure the scored answers `rows` (items.jsonl lines: `correct` and
    `measures`) carry; rank the measures by cross-validated log loss."""
    maps: dict[str, dict[str, Any]] = {}
    for name in MEASURES:
        kind, subset = _rows_for(name, rows)
        got = [(r["measures"].get(name), bool(r["correct"]), r["measures"].get("chance"))
               for r in subset]
        got = [g for g in got if g[0] is not None and math.isfinite(g[0])]
        if len(got) < MIN_ITEMS:
            continue
        chance = [g[2] for g in got]
        usable = kind == "choice" and all(isinstance(v, float) and 0 < v < 1 for v in chance)
        maps[name] = fit_map([g[0] for g in got], [g[1] for g in got], seed,
                             chance if usable else None)
        maps[name]["rows"] = kind
    if not maps:
        raise CalibrationError(
            f"too few scored answers to fit a calibration (at least {MIN_ITEMS} per measure)"
        )

    def best_loss(name: str) -> float:
        got = [v for v in maps[name]["cv_log_loss"].values() if v is not None]
        return min(got) if got else math.inf

    ranking = sorted(maps, key=best_loss)
    segment = next((m for m in ranking if m in SEGMENT_MEASURES
                    and maps[m]["rows"] in ("free", "all")), None)
    return Calibration.from_dict({
        "format": FORMAT, "fingerprint": dict(fingerprint), "fitted_on": dict(fitted_on),
        "ranking": ranking, "segment_measure": segment, "maps": maps,
    })
