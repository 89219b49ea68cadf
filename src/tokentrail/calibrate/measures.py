"""The confidence measures scored for each answer, side by side.

Each is a number in [0, 1] where higher means surer, so that every one can be binned
against accuracy (ECE) and ranked (AUROC, PRR) the same way:

- ``prob``: the answer span's probability, the product of its tokens' probabilities;
- ``geo_prob``: their geometric mean (exp of the mean logprob; what `level` is cut on);
- ``first_prob``: the first answer token's probability;
- ``min_prob``: the least probable token's probability;
- ``margin``: the mean, over the span's tokens, of top-1 minus top-2 probability (from
  the returned alternatives);
- ``exp_neg_entropy``: exp(-H), H the mean entropy (nats) of the renormalised top-k
  alternatives (1 when the model had no doubt);
- ``level``: the segment level of the span (`tokentrail.segment.CONFIDENCE_LEVELS`), / 4;
- ``field_prob``: with choices, the chosen choice's probability among the choices, each
  scored by the model's own logprob of its tokens (from a server that reports logprobs
  after the constraint's mask, the constrained answer's own masked probability:
  `tokentrail.calibrate.answer`).

The answer span is the whole reply without its end-of-sequence token (prompts ask for the
answer alone); a reply with nothing else keeps the end token so that it is scored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..segment import CONFIDENCE_LEVELS, Confidence, confidence_level

__all__ = [
    "MEASURES",
    "SEGMENT_MEASURES",
    "TokenRecord",
    "choice_probability",
    "measures_of",
    "segment_measures",
]

#: Every measure, in the order reports list them.
MEASURES: tuple[str, ...] = (
    "prob", "geo_prob", "first_prob", "min_prob", "margin", "exp_neg_entropy", "level",
    "field_prob",
)
#: The measures a streamed segment's `Confidence` alone determines: the ones a calibration
#: can map at generation time.
SEGMENT_MEASURES: tuple[str, ...] = ("prob", "geo_prob", "min_prob", "exp_neg_entropy", "level")


@dataclass(frozen=True, slots=True)
class TokenRecord:
    """One generated token: its logprob and the logprobs of the returned alternatives."""

    logprob: float
    top: tuple[float, ...] = ()


def _entropy(top: Sequence[float]) -> float | None:
    ps = [math.exp(lp) for lp in top]
    z = math.fsum(ps)
    if z <= 0:
        return None
    return -math.fsum(p / z * math.log(p / z) for p in ps if p > 0)


def _margin(top: Sequence[float]) -> float | None:
    if not top:
        return None
    ps = sorted((math.exp(lp) for lp in top), reverse=True)
    return ps[0] - (ps[1] if len(ps) > 1 else 0.0)


def _mean(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return math.fsum(got) / len(got) if got else None


def measures_of(
    tokens: Sequence[TokenRecord], field_prob: float | None = None
) -> dict[str, float | None]:
    """Every measure of an answer span (None where it cannot be computed)."""
    out: dict[str, float | None] = dict.fromkeys(MEASURES)
    out["field_prob"] = field_prob
    if not tokens:
        return out
    lps = [t.logprob for t in tokens]
    mean = math.fsum(lps) / len(lps)
    level = confidence_level(mean)
    entropy = _mean([_entropy(t.top) for t in tokens if t.top])
    out.update(
        prob=math.exp(math.fsum(lps)),
        geo_prob=math.exp(mean),
        first_prob=math.exp(lps[0]),
        min_prob=math.exp(min(lps)),
        margin=_mean([_margin(t.top) for t in tokens]),
        exp_neg_entropy=None if entropy is None else math.exp(-entropy),
        level=None if level is None else level / len(CONFIDENCE_LEVELS),
    )
    return out


def segment_measures(confidence: Confidence) -> dict[str, float | None]:
    """The measures a segment's `Confidence` gives (`SEGMENT_MEASURES`), as for an answer."""
    level = confidence_level(confidence.mean_logprob)
    return {
        "prob": confidence.probability,
        "geo_prob": math.exp(confidence.mean_logprob),
        "min_prob": math.exp(confidence.min_logprob),
        "exp_neg_entropy": None if confidence.entropy is None else math.exp(-confidence.entropy),
        "level": None if level is None else level / len(CONFIDENCE_LEVELS),
    }


def choice_probability(scores: Mapping[str, float], chosen: str) -> float | None:
    """`chosen`'s probability among the choices whose summed logprobs are `scores`
    (a softmax over them); None when it was not scored or nothing was finite."""
    if chosen not in scores:
        return None
    finite = [s for s in scores.values() if math.isfinite(s)]
    if not finite or not math.isfinite(scores[chosen]):
        return 0.0 if finite else None
    top = max(finite)
    z = math.fsum(math.exp(s - top) for s in finite)
    return math.exp(scores[chosen] - top) / z
