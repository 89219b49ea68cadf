"""The values the aligner emits: segments of final text and the tokens behind them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple, get_type_hints

__all__ = [
    "CONFIDENCE_LEVELS",
    "LEVEL_NAMES",
    "WIRE_NEG_INF",
    "Alternative",
    "Confidence",
    "OneTokenSegment",
    "Segment",
    "TokenSpan",
    "confidence_level",
    "confidence_of",
    "json_number",
    "probability_level",
]

#: What OpenAI's API sends for a logprob of -inf (JSON has no infinities).
WIRE_NEG_INF = -9999.0


def json_number(x: float | None, neg_inf: float | None = None) -> float | None:
    """`x` as JSON can carry it: the one rule for non-finite figures everywhere tokentrail
    writes JSON (extension, CLI, realign). NaN and +inf become null; -inf becomes
    `neg_inf` (null by default; logprobs pass `WIRE_NEG_INF`, as OpenAI does)."""
    if x is None or math.isfinite(x):
        return x
    return neg_inf if x < 0 else None


#: The one definition of "how sure", shared by the CLI's colours and the page's shading:
#: a segment's level is how many of these its tokens' geometric-mean probability
#: (exp of the mean logprob) reaches. The geometric mean does not fall with a
#: segment's length, as the product of its tokens' probabilities would.
CONFIDENCE_LEVELS: tuple[float, ...] = (0.2, 0.45, 0.7, 0.9)
#: A name for each level, 0 (least sure) to len(CONFIDENCE_LEVELS).
LEVEL_NAMES: tuple[str, ...] = ("unsure", "doubtful", "hesitant", "sure", "certain")


def confidence_level(mean_logprob: float | None) -> int | None:
    """The level (0..4) of a segment whose tokens' mean logprob is `mean_logprob`;
    None when there is no logprob to judge by."""
    if mean_logprob is None or math.isnan(mean_logprob):
        return None
    p = math.exp(mean_logprob) if mean_logprob < 709.0 else math.inf
    return probability_level(p)


def probability_level(p: float) -> int:
    """The level (0..4) of probability `p`: how many of `CONFIDENCE_LEVELS` it reaches.
    A calibrated probability is judged by the same cut-offs as a geometric mean."""
    return sum(1 for limit in CONFIDENCE_LEVELS if p >= limit)


@dataclass(slots=True)
class Alternative:
    """One candidate the model weighed at a step: its id, logprob, raw bytes and text.

    `text` is the token's bytes decoded alone (a partial character shows as U+FFFD).
    `display` is what choosing it would have shown: with the incomplete UTF-8 bytes held
    before that step, the character it completes (`'é'`); bytes that make no complete
    character as `<0xC3>`, never U+FFFD. Empty where not computed (read `text`).
    """

    id: int
    logprob: float
    bytes: bytes
    text: str
    display: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "logprob": self.logprob,
            "bytes": list(self.bytes),
            "text": self.text,
            "display": self.display or self.text,
        }


class TokenSpan(NamedTuple):
    """A token's share of one segment.

    `index` is the token's position in the stream, `id` its vocabulary id, and
    `start`/`end` the byte offsets, within that token's own bytes, that this segment
    consumed. A token whose bytes are split across segments appears in each with its
    own range; a token with no bytes (a skipped special token) has ``start == end``.
    `from_draft` says that a draft model proposed the token (speculative decoding) and
    the target model accepted it, as mlx-lm's `GenerationResponse.from_draft` does.

    A named tuple (immutable), so that the aligner's hot path builds one with a single
    C call: reading every segment's tokens must cost no more than the text alone did.
    """

    index: int
    id: int
    start: int
    end: int
    logprob: float | None = None
    top_logprobs: tuple[Alternative, ...] | None = None
    from_draft: bool = False

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": self.index,
            "id": self.id,
            "start": self.start,
            "end": self.end,
        }
        if self.logprob is not None:
            out["logprob"] = self.logprob
        if self.top_logprobs is not None:
            out["top_logprobs"] = [alt.to_dict() for alt in self.top_logprobs]
        if self.from_draft:
            out["from_draft"] = True
        return out


# The constructor NamedTuple generates carries the annotations as strings, to be read in
# another module's namespace; give it the resolved types so documentation tools and
# `typing.get_type_hints` can read them.
TokenSpan.__new__.__annotations__ = get_type_hints(TokenSpan)


@dataclass(slots=True)
class Confidence:
    """How sure the model was of a segment, aggregated over its tokens' logprobs.

    `entropy` is the mean, over tokens with alternatives, of the entropy (nats) of the
    renormalised top-k distribution; it is None when no alternatives were given.
    `calibrated` is the probability that the text is right, from a calibration map
    (`tokentrail.calibrate.Calibration`); once set, `level` follows it.
    """

    mean_logprob: float
    min_logprob: float
    perplexity: float
    probability: float
    entropy: float | None = None
    n_tokens: int = 0
    calibrated: float | None = None

    @property
    def level(self) -> int | None:
        """How sure, 0 (least) to 4 (see `CONFIDENCE_LEVELS`); None without logprobs.
        With a calibrated probability, the level of that probability."""
        if self.calibrated is not None:
            return probability_level(self.calibrated)
        return confidence_level(self.mean_logprob)

    def to_dict(self) -> dict[str, Any]:
        # JSON has no infinities: a saturated figure is reported as null.
        out: dict[str, Any] = {
            "mean_logprob": json_number(self.mean_logprob),
            "min_logprob": json_number(self.min_logprob),
            "perplexity": json_number(self.perplexity),
            "probability": json_number(self.probability),
            "entropy": json_number(self.entropy),
            "n_tokens": self.n_tokens,
            "level": self.level,
        }
        if self.calibrated is not None:  # only with a calibration: the shape stays
            out["calibrated"] = self.calibrated
        return out


def _exp(x: float) -> float:
    """exp() that saturates to inf instead of raising for very negative logprobs."""
    return math.exp(x) if x < 709.0 else math.inf


def _entropy(top: tuple[Alternative, ...], shift: float = 0.0) -> float | None:
    """The entropy over listed alternatives, renormalised (p_i = e^l_i / z):
    H = -sum p_i log p_i = log z - sum(e^l_i * l_i) / z, in one pass. Where every
    e^l_i is so small that it loses digits (l_i below about -690), again with the
    logprobs shifted by their largest (the same H, computed on normal numbers)."""
    exp = math.exp
    z = weighted = 0.0
    for a in top:
        lp = a.logprob - shift
        p = exp(lp)
        if p > 0.0:
            z += p
            weighted += p * lp
    if z < 1e-300 and shift == 0.0:
        finite = [a.logprob for a in top if a.logprob > -math.inf]
        if finite:
            return _entropy(top, max(finite))
    return max(0.0, math.log(z) - weighted / z) if z > 0.0 else None


def confidence_of(tokens: tuple[TokenSpan, ...] | list[TokenSpan]) -> Confidence | None:
    """Aggregate the logprobs of `tokens`; None when none of them carries a logprob."""
    if len(tokens) == 1:  # most segments: the same figures without the lists and sums
        t = tokens[0]
        lp = t.logprob
        if lp is None:
            return None
        lp = float(lp)
        return Confidence(lp, lp, _exp(-lp), _exp(lp),
                          _entropy(t.top_logprobs) if t.top_logprobs else None, 1)  # fmt: skip
    lps = [t.logprob for t in tokens if t.logprob is not None]
    if not lps:
        return None
    mean = math.fsum(lps) / len(lps)
    entropies = []
    for t in tokens:
        if t.top_logprobs:
            h = _entropy(t.top_logprobs)
            if h is not None:
                entropies.append(h)
    return Confidence(
        mean_logprob=mean,
        min_logprob=min(lps),
        perplexity=_exp(-mean),
        probability=_exp(math.fsum(lps)),
        entropy=math.fsum(entropies) / len(entropies) if entropies else None,
        n_tokens=len(lps),
    )


@dataclass(slots=True, eq=False)
class Segment:
    """A piece of text that became final, with the tokens whose bytes make it up."""

    text: str
    tokens: tuple[TokenSpan, ...] = field(default_factory=tuple)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Segment):
            return NotImplemented
        return self.text == other.text and tuple(self.tokens) == tuple(other.tokens)

    __hash__ = None  # type: ignore[assignment]

    @property
    def confidence(self) -> Confidence | None:
        return confidence_of(self.tokens)

    @property
    def token_ids(self) -> list[int]:
        return [t.id for t in self.tokens]

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "tokens": [t.to_dict() for t in self.tokens]}


#: A TokenSpan from all seven fields without the Python-level `__new__` and its
#: defaults handling: one C call, for the aligner's hot path (callers pass every field).
new_span = tuple.__new__


class OneTokenSegment(Segment):
    """A segment made by exactly one whole token (the aligner's hot path): its two slots
    set directly, without the dataclass constructor's default handling."""

    __slots__ = ()

    def __init__(self, text: str, tokens: tuple[TokenSpan, ...]) -> None:
        self.text = text
        self.tokens = tokens

    def __repr__(self) -> str:
        return f"Segment(text={self.text!r}, tokens={self.tokens!r})"
