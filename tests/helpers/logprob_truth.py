"""The check that reported logprobs are the distribution tokens are drawn from.

If a step's token is sampled from the distribution whose top-1 probability is reported
as p, the sampled token is the reported top-1 with probability exactly p. Over n steps
the number of hits is a sum of independent Bernoulli(p_i) draws, so

    z = (hits - sum p_i) / sqrt(sum p_i (1 - p_i))

is close to standard normal when the logprobs are true, and grows like sqrt(n) when they
describe another distribution (the model's own before temperature or top-k/top-p/min-p
truncation, say). The same holds within each bin of reported probability, which catches
a distribution that is right on average but wrong in shape.

`TopOneTally` counts; `assert_true` / `assert_false` are the tests' verdicts, with a
message that carries the numbers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: |z| above this is a failure of the identity; a true distribution passes with
#: probability 1 - 6e-5 per test (and the runs are seeded, so a pass stays a pass).
TRUE_BOUND = 4.0
#: Bins of reported top-1 probability checked separately.
BIN_EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0 + 1e-9)
#: A bin with fewer steps than this is too small to say anything and is not checked.
MIN_BIN = 60


def z_score(hits: float, probs: Sequence[float]) -> float:
    """The binomial z of `hits` successes in independent trials with chances `probs`."""
    var = sum(p * (1.0 - p) for p in probs)
    if var <= 0.0:
        return 0.0 if hits == sum(probs) else math.inf
    return (hits - sum(probs)) / math.sqrt(var)


@dataclass
class TopOneTally:
    """Per step: the reported top-1 probability and whether the sampled token was it."""

    label: str = ""
    probs: list[float] = field(default_factory=list)
    hits: list[bool] = field(default_factory=list)

    def add(self, sampled: Any, top_one: Any, top_logprob: float) -> None:
        """Count one step: `sampled` and `top_one` identify the drawn token and the
        reported most likely one (an id, or anything comparable), `top_logprob` the
        latter's reported logprob."""
        self.probs.append(math.exp(top_logprob))
        self.hits.append(sampled == top_one)

    @property
    def n(self) -> int:
        return len(self.probs)

    @property
    def z(self) -> float:
        return z_score(sum(self.hits), self.probs)

    def bins(self) -> list[tuple[float, float, int, int, float, float]]:
        """(low, high, steps, hits, expected hits, z) per bin of reported probability."""
        out = []
        for lo, hi in itertools.pairwise(BIN_EDGES):
            idx = [i for i, p in enumerate(self.probs) if lo <= p < hi]
            probs = [self.probs[i] for i in idx]
            hits = sum(self.hits[i] for i in idx)
            out.append((lo, min(hi, 1.0), len(idx), hits, sum(probs), z_score(hits, probs)))
        return out

    def summary(self) -> str:
        """One line: the counts, z, and every bin's."""
        bins = " ".join(
            f"[{lo:.1f},{hi:.1f}) n={k} hits={h} exp={e:.1f} z={z:+.2f}"
            for lo, hi, k, h, e, z in self.bins()
            if k
        )
        return (
            f"{self.label}: n={self.n} hits={sum(self.hits)} expected={sum(self.probs):.1f} "
            f"z={self.z:+.2f}; {bins}"
        )

    def assert_true(self, min_steps: int, bound: float = TRUE_BOUND) -> None:
        """The identity holds overall and in every bin with at least `MIN_BIN` steps."""
        assert self.n >= min_steps, f"only {self.n} steps (< {min_steps}): {self.summary()}"
        assert abs(self.z) < bound, f"reported logprobs are not the sampled ones: {self.summary()}"
        for lo, hi, k, _, _, z in self.bins():
            if k >= MIN_BIN:
                assert abs(z) < bound, f"bin [{lo:.1f},{hi:.1f}) disagrees: {self.summary()}"

    def assert_false(self, bound: float) -> None:
        """The identity visibly fails: |z| is above `bound` (well beyond chance)."""
        assert abs(self.z) > bound, f"expected a visible failure (|z| > {bound}): {self.summary()}"


def tally(label: str, steps: Iterable[tuple[Any, Any, float]]) -> TopOneTally:
    """A tally of `(sampled, top_one, top_logprob)` triples."""
    t = TopOneTally(label)
    for sampled, top_one, lp in steps:
        t.add(sampled, top_one, lp)
    return t


def chat_entry_steps(entries: Iterable[Any]) -> list[tuple[Any, Any, float]]:
    """The steps of OpenAI chat `logprobs.content` entries (objects or dicts): a token is
    identified by its `(token, bytes)` spelling, as an outside client sees it. The top-1
    is the alternative with the highest logprob, not the first listed: vLLM lists the
    sampled token first among `top_logprobs`, so ask for a few (5) alternatives."""

    def get(obj: Any, key: str) -> Any:
        return obj[key] if isinstance(obj, dict) else getattr(obj, key)

    out = []
    for e in entries:
        tops = get(e, "top_logprobs")
        if not tops:
            continue
        top = max(tops, key=lambda a: get(a, "logprob"))
        mine = (get(e, "token"), tuple(get(e, "bytes") or ()))
        best = (get(top, "token"), tuple(get(top, "bytes") or ()))
        out.append((mine, best, get(top, "logprob")))
    return out
