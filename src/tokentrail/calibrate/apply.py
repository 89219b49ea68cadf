"""A fitted calibration map, loaded and applied: measure in, probability of being right out.

`Calibration.load(path)` reads what `tokentrail calibrate --fit` wrote, or a map that
ships with tokentrail by its name (`builtin_calibrations`: ``smollm2``, fitted on the
1,431 questions of ``benchmarks/data/calibration/atlas.jsonl``). Applying it needs
nothing beyond the standard library (no numpy, no scikit-learn), so `generate` and
`serve` can take `--calibration` on any install. Two kinds of map, per measure:

- ``temperature``: sigmoid(logit(p) / temperature + bias) (temperature scaling with a
  shift, i.e. Platt scaling on the measure's logit);
- ``isotonic``: a monotone step function, linearly interpolated between its points and
  flat past its ends (scikit-learn's `IsotonicRegression` with out_of_bounds="clip");
- ``constant``: one probability (the base rate: a measure that carried nothing the
  cross-validation could use, or a set whose answers were all right or all wrong).

A temperature or isotonic map may also carry ``bins`` (``{"edges": [...], "p": [...]}``,
one more ``p`` than ``edges``): the measure's range cut at ``edges`` and one probability
per piece, the mean of what the map's own curve says over the answers it was fitted on
that fell there (the scaling-binning calibrator of Kumar, Liang and Ma, "Verified
uncertainty calibration", NeurIPS 2019). Such a map says only those few probabilities, each
a claim about a group of answers large enough to check (`tokentrail.calibrate.fit`).

A map's ``rows`` says which answers it was fitted on and applies to: ``free`` (free
text), ``choice`` (a constrained choice, which has ``field_prob``) or ``all``. Its
``ceiling`` (optional) caps what it says: the most confident level (calibrated at least
`tokentrail.segment.CONFIDENCE_LEVELS`' last cut) is given only as far as the answers the
map was fitted on back it (`tokentrail.calibrate.fit`).
"""

from __future__ import annotations

import json
import logging
import math
import os
from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

from ..errors import CalibrationError
from ..segment import Confidence
from ..weakid import IdWeakMap
from .measures import MEASURES, SEGMENT_MEASURES, segment_measures

log = logging.getLogger(__name__)

__all__ = [
    "FORMAT", "Calibration", "apply_map", "builtin_calibrations", "check_fingerprint",
    "is_choice",
]

#: The `format` field of a calibration file.
FORMAT = "tokentrail-calibration"
#: The calibrations that ship with tokentrail: ``NAME.json``, each fitted with
#: `tokentrail calibrate DATA --fit` on the model it is named after (its fingerprint says
#: which; `docs/calibration.md` has the command).
BUILTIN = Path(__file__).with_name("maps")
#: Probabilities are kept this far from 0 and 1 before taking a logit.
EPS = 1e-6
#: A chance-adjusted constant is kept within [CHANCE_FLOOR, 1 - CHANCE_FLOOR].
CHANCE_FLOOR = 0.01


def logit(p: float) -> float:
    p = min(max(p, EPS), 1.0 - EPS)
    return math.log(p / (1.0 - p))


def sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def apply_map(spec: Mapping[str, Any], value: float, chance: float | None = None) -> float:
    """The calibrated probability of a measure's `value` under one map `spec`; `chance`
    (1/k for a choice among k) lets a constant map with a ``skill`` follow k (its own
    rate for a k it was fitted on, ``by_k``). Never above the map's ``ceiling`` (what
    its fit backs at the most confident level; see the module)."""
    bins = spec.get("bins")
    p = _mapped(spec, value, chance) if bins is None else _binned(bins, value)
    ceiling = spec.get("ceiling")
    return p if ceiling is None else min(p, float(ceiling))


def _binned(bins: Mapping[str, Any], value: float) -> float:
    return float(bins["p"][bisect_right(bins["edges"], value)])


def _mapped(spec: Mapping[str, Any], value: float, chance: float | None) -> float:
    kind = spec.get("kind")
    if kind == "constant" and chance is not None and "skill" in spec:
        rate = spec.get("by_k", {}).get(str(round(1.0 / chance)))
        p = chance + (1.0 - chance) * spec["skill"] if rate is None else rate
        return min(max(p, CHANCE_FLOOR), 1 - CHANCE_FLOOR)
    if kind == "temperature":
        return sigmoid(logit(value) / spec["temperature"] + spec["bias"])
    if kind == "isotonic":
        return _interp(value, spec["x"], spec["y"])
    if kind == "constant":
        return float(spec["p"])
    raise CalibrationError(f"unknown calibration map kind {kind!r}")


def is_choice(measures: Mapping[str, float | None]) -> bool:
    """Whether an answer with these measures was a constrained choice."""
    return measures.get("field_prob") is not None


def _chance(measures: Mapping[str, Any]) -> float | None:
    c = measures.get("chance")
    return c if isinstance(c, float) and 0.0 < c < 1.0 and is_choice(measures) else None


def _applies(spec: Mapping[str, Any], choice: bool) -> bool:
    rows = spec.get("rows", "all")
    return rows == "all" or rows == ("choice" if choice else "free")


def _check_map(name: str, spec: Any) -> None:
    ok = isinstance(spec, dict) and spec.get("rows", "all") in ("all", "free", "choice")
    ceiling = spec.get("ceiling") if ok else None
    ok = ok and (ceiling is None or (isinstance(ceiling, (int, float)) and 0 < ceiling <= 1))
    if ok and spec.get("kind") == "temperature":
        t = spec.get("temperature")
        ok = isinstance(t, (int, float)) and t > 0 and isinstance(spec.get("bias"), (int, float))
    elif ok and spec.get("kind") == "isotonic":
        xs, ys = spec.get("x"), spec.get("y")
        ok = isinstance(xs, list) and isinstance(ys, list) and len(xs) == len(ys) > 0
        ok = ok and all(a <= b for a, b in pairwise(xs))
    elif ok and spec.get("kind") == "constant":
        ok = isinstance(spec.get("p"), (int, float))
        ok = ok and isinstance(spec.get("skill", 0.0), (int, float))
        by_k = spec.get("by_k", {})
        ok = ok and isinstance(by_k, dict) and all(
            isinstance(k, str) and k.isdigit() and isinstance(v, (int, float)) and 0 <= v <= 1
            for k, v in by_k.items())
    else:
        ok = False
    if ok and "bins" in spec:
        ok = spec.get("kind") in ("temperature", "isotonic") and _bins_ok(spec["bins"])
    if not ok:
        raise CalibrationError(f"the calibration map for {name!r} is malformed: {spec!r:.200}")


def _bins_ok(bins: Any) -> bool:
    edges, ps = (bins.get("edges"), bins.get("p")) if isinstance(bins, dict) else (None, None)
    if not (isinstance(edges, list) and isinstance(ps, list) and len(ps) == len(edges) + 1):
        return False
    numbers = all(isinstance(v, (int, float)) and math.isfinite(v) for v in edges + ps)
    return numbers and all(a < b for a, b in pairwise(edges)) and all(0 <= v <= 1 for v in ps)


def check_fingerprint(fitted: Mapping[str, Any], running: Mapping[str, Any]) -> None:
    """Refuse (CalibrationError) a map fitted for another model: a tokenizer or weights
    hash that both sides have and that differ. Where no hash can be compared (a map
    fitted over a URL), the model names must agree; a map that cannot be checked at all
    is used with a warning."""
    compared = False
    for key, what in (("tokenizer", "tokenizer"), ("weights", "weights")):
        a, b = fitted.get(key), running.get(key)
        if a and b:
            compared = True
            if a != b:
                raise CalibrationError(
                    f"this calibration was fitted for another model: its {what} fingerprint "
                    f"{str(a)[:12]} ({fitted.get('name')}) is not this model's {str(b)[:12]} "
                    f"({running.get('name')}); fit one for this model with "
                    "`tokentrail calibrate DATA --fit OUT.json`"
                )
    if compared:
        return
    a, b = fitted.get("name"), running.get("name")
    if a and b and a != b:
        raise CalibrationError(
            f"this calibration was fitted for model {a!r}, not {b!r} (no tokenizer or weights "
            "fingerprint to compare)"
        )
    log.warning("calibration fitted for %r cannot be checked against this model by "
                "fingerprint; using it as given", a)


@dataclass
class Calibration:
    """Per-measure maps to the probability that an answer (or segment) is right.

    `ranking` lists the fitted measures best first (cross-validated log loss); an answer
    is calibrated with the first one it has. `segment_measure` is the best measure a
    streamed segment's `Confidence` gives, the one `generate` and `serve` apply.
    """

    maps: dict[str, dict[str, Any]]
    ranking: list[str]
    segment_measure: str | None
    fingerprint: dict[str, Any] = field(default_factory=dict)
    fitted_on: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    #: The models already checked against `fingerprint`, each with the tokenizers it
    #: was checked with, by identity (an MLX module is a dict): an entry goes with its
    #: model, so a model once checked and then freed is never mistaken for another that
    #: takes its place in memory (`fingerprint.calibration_for`).
    checked: IdWeakMap[IdWeakMap[bool]] = field(
        default_factory=IdWeakMap, repr=False, compare=False
    )

    @classmethod
    def from_dict(cls, data: Any, source: str = "") -> Calibration:
        """A calibration from its JSON form, checked."""
        where = f"{source}: " if source else ""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CalibrationError(f"{where}not a tokentrail calibration file (format "
                                   f"{FORMAT!r} expected)")
        maps = data.get("maps")
        if not isinstance(maps, dict) or not maps:
            raise CalibrationError(f"{where}the calibration holds no maps")
        for name, spec in maps.items():
            if name not in MEASURES:
                raise CalibrationError(f"{where}unknown measure {name!r} in the calibration")
            _check_map(name, spec)
        ranking = [m for m in data.get("ranking", []) if m in maps] or sorted(maps)
        seg = data.get("segment_measure")
        if seg is not None and (seg not in maps or seg not in SEGMENT_MEASURES
                                or maps[seg].get("rows", "all") == "choice"):
            raise CalibrationError(f"{where}segment_measure {seg!r} has no usable map")
        return cls(maps, ranking, seg, dict(data.get("fingerprint") or {}),
                   dict(data.get("fitted_on") or {}), source)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Calibration:
        """Read a calibration file, or the built-in calibration of that name (a file of
        that name comes first); a missing, non-JSON or malformed one is a
        CalibrationError naming it."""
        name = os.fspath(path)
        if name in builtin_calibrations() and not os.path.exists(name):
            path = BUILTIN / f"{name}.json"
        elif not os.path.exists(name) and os.sep not in name and "." not in name:
            raise CalibrationError(
                f"no calibration file {name!r}, and no built-in calibration of that name "
                f"(built in: {', '.join(builtin_calibrations()) or 'none'})"
            )
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise CalibrationError(f"cannot read calibration {path}: {e.strerror or e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CalibrationError(f"calibration {path} is not JSON: {e}") from None
        return cls.from_dict(data, str(path))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": 1, "fingerprint": self.fingerprint,
            "fitted_on": self.fitted_on, "ranking": self.ranking,
            "segment_measure": self.segment_measure, "maps": self.maps,
        }

    def check(self, fingerprint: Mapping[str, Any]) -> Calibration:
        """Self, after refusing it for a model whose fingerprint is another's."""
        check_fingerprint(self.fingerprint, fingerprint)
        return self

    def map(self, measure: str, value: float) -> float:
        """`value` of `measure` mapped to a probability of being right."""
        try:
            spec = self.maps[measure]
        except KeyError:
            raise CalibrationError(f"no calibration map for measure {measure!r}") from None
        return apply_map(spec, value)

    def first_measure(self, choice: bool = False) -> str | None:
        """The best-ranked measure whose map applies to answers of that kind (free text,
        or with `choice` a constrained choice); None when none does."""
        return next((m for m in self.ranking if _applies(self.maps[m], choice)), None)

    def answer(self, measures: Mapping[str, float | None]) -> tuple[float | None, str | None]:
        """(probability, measure used) for an answer's measures: the best-ranked measure
        it has whose map was fitted on answers of its kind (free text or choice);
        (None, None) when it has none of them."""
        choice = is_choice(measures)
        for name in self.ranking:
            if not _applies(self.maps[name], choice):
                continue
            v = measures.get(name)
            if v is not None and math.isfinite(v):
                return apply_map(self.maps[name], v, _chance(measures)), name
        return None, None

    def segment(self, confidence: Confidence) -> float | None:
        """The calibrated probability of a segment (None: no segment measure fitted)."""
        if self.segment_measure is None:
            return None
        v = segment_measures(confidence).get(self.segment_measure)
        return None if v is None or not math.isfinite(v) else self.map(self.segment_measure, v)

    def confidence(self, conf: Confidence | None) -> Confidence | None:
        """`conf` with `calibrated` set (a new `Confidence`; `level` then follows it);
        None stays None. `output.processor.OutputProcessor` applies it to each record's
        segment and channel confidences."""
        if conf is None:
            return None
        return replace(conf, calibrated=self.segment(conf))


def builtin_calibrations() -> list[str]:
    """The names of the calibrations that ship with tokentrail (`Calibration.load`)."""
    return sorted(p.stem for p in BUILTIN.glob("*.json"))
