"""Confidence-weighted answers over `n` replies to one prompt, and early stop (issue #31).

Pure functions of the replies' text and token logprobs: the server's response
(`tokentrail.server.voting`) and the library (`tokentrail.vote`) use the same ones.

- **An answer**: a reply's text normalised (`normalise`: stripped, whitespace collapsed,
  casefolded, trailing punctuation dropped), or, for a JSON reply (a JSON-constrained
  one, or text that parses as a JSON object or array), its parsed value: two replies
  give the same answer when the values are equal (key order and ``1`` vs ``1.0`` do not
  matter; ``true`` is not ``1``).
- **A reply's confidence** (`reply_confidence`): the calibrated probability where a
  calibration gave one, else the geometric mean of its tokens' probabilities
  (``exp`` of the mean logprob, the figure `Confidence.level` is cut on). The mean,
  not the product: the product falls with every token, so a long right answer would
  weigh less than a short wrong one; the geometric mean does not depend on length.
  DeepConf (Fu et al., 2025, "Deep Think with Confidence") weighs its votes the same
  way, by a mean of per-token confidence over the trace.
- **The winner** (`tally`): for ``"confidence"`` the answer with the highest summed
  confidence, for ``"majority"`` the one with the most replies; ties go to the other
  figure (count, resp. summed confidence), then to the answer whose first reply comes
  first. Stopped replies (early stop) have no answer and do not vote.
- **Early stop** (`EarlyStop`): DeepConf's online rule in probabilities. A reply's
  running confidence is the geometric mean of its last `WINDOW` tokens' probabilities;
  a finished reply's *lowest* window is its weakest stretch. Once one reply has
  finished, a reply still running whose current window falls below the median of the
  finished replies' lowest windows is stopped: it is already less sure than a typical
  finished reply ever was. DeepConf cuts at a percentile of its warm-up traces (the
  10th or the 90th); the median sits between its two settings.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import unicodedata
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from ..segment import Confidence, TokenSpan, confidence_of
from .record import TokenOutput

if TYPE_CHECKING:
    from ..engines.base import Step
    from .processor import OutputProcessor

__all__ = [
    "STOPPED_BY",
    "WINDOW",
    "Ballot",
    "EarlyStop",
    "Vote",
    "VoteGroup",
    "answer_of",
    "ballot_of",
    "feed_early",
    "normalise",
    "reply_confidence",
    "tally",
    "unique_tokens",
    "vote",
]

Rule = Literal["confidence", "majority"]
RULES: tuple[str, ...] = ("confidence", "majority")

#: Tokens in early stop's running window. DeepConf uses 2048 for long reasoning traces;
#: short answers need a short window, or no reply would fill one before it ends.
WINDOW = 16
#: `TokenOutput.stopped_by` (and the wire's `tokentrail.stopped_by`) of a reply early
#: stop ended.
STOPPED_BY = "early_stop"
#: A logprob below this counts as this (a masked token's -inf would poison the sums).
_FLOOR = -100.0

_SPACE = re.compile(r"\s+")


def normalise(text: str) -> str:
    """`text` as an answer: stripped, runs of whitespace made one space, casefolded,
    trailing punctuation (any Unicode punctuation) dropped."""
    out = _SPACE.sub(" ", text).strip().casefold()
    end = len(out)
    while end and (unicodedata.category(out[end - 1]).startswith("P") or out[end - 1] == " "):
        end -= 1
    return out[:end]


def _canonical(value: Any) -> Any:
    """A JSON value where equal values compare equal: integral floats as ints (1.0 is
    1), objects with sorted keys; booleans stay booleans."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _canonical(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def answer_of(text: str, json_reply: bool = False) -> tuple[str, Any]:
    """The answer `text` gives: ("json", value) for a JSON reply (`json_reply`: the
    reply was JSON-constrained, so any JSON value counts; else only an object or an
    array, so that "4" and "4." stay one text answer), else ("text", normalised)."""
    stripped = text.strip()
    if json_reply or stripped[:1] in ("{", "["):
        try:
            return "json", _canonical(json.loads(stripped))
        except ValueError:
            pass
    return "text", normalise(text)


def unique_tokens(spans: Iterable[TokenSpan]) -> list[TokenSpan]:
    """Each token once, in order (a token whose bytes went into two segments is listed
    in both)."""
    seen: set[int] = set()
    out = []
    for span in spans:
        if span.index not in seen:
            seen.add(span.index)
            out.append(span)
    return out


def reply_confidence(conf: Confidence | None) -> float | None:
    """The figure a reply votes with: `conf.calibrated` where set, else the geometric
    mean of its tokens' probabilities (exp of the mean logprob); None without one."""
    if conf is None:
        return None
    if conf.calibrated is not None:
        return conf.calibrated
    mean = conf.mean_logprob
    return None if math.isnan(mean) else math.exp(min(mean, 0.0))


@dataclass(frozen=True, slots=True)
class Ballot:
    """One reply's vote: its `index` among the replies, `text`, `confidence` (the
    `reply_confidence` figure), whether it is a JSON reply, and whether early stop
    ended it (`stopped`: it does not vote)."""

    index: int
    text: str
    confidence: float | None
    json_reply: bool = False
    stopped: bool = False

    @property
    def answer(self) -> tuple[str, Any]:
        return answer_of(self.text, self.json_reply)


def ballot_of(
    index: int,
    text: str,
    tokens: Iterable[TokenSpan],
    *,
    json_reply: bool = False,
    stopped: bool = False,
    calibration: Any = None,
) -> Ballot:
    """The ballot of a reply with `text` made of `tokens` (each once: `unique_tokens`),
    its confidence calibrated by `calibration` (`tokentrail.calibrate.Calibration`)
    where one is given."""
    conf = confidence_of(unique_tokens(tokens))
    if calibration is not None:
        conf = calibration.confidence(conf)
    return Ballot(index, text, reply_confidence(conf), json_reply, stopped)


@dataclass(slots=True)
class VoteGroup:
    """The replies that gave one answer: `answer` (normalised text, or the JSON value),
    `choices` (their indices, ascending), `count`, `confidence` (their summed
    confidences; a reply without one adds 0)."""

    kind: str
    answer: Any
    choices: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.choices)

    @property
    def confidence(self) -> float:
        return math.fsum(self.confidences)

    def to_dict(self) -> dict[str, Any]:
        return {
            "answer": self.answer,
            "choices": list(self.choices),
            "count": self.count,
            "confidence": self.confidence,
        }


@dataclass(frozen=True, slots=True)
class Vote:
    """The result: `groups` ranked by `rule` (the winner first), `winner` (that group,
    None when no reply voted), `choice` (the winning group's most confident reply, the
    first on a tie: the text to show), `stopped` (replies early stop ended)."""

    rule: str
    groups: tuple[VoteGroup, ...]
    stopped: tuple[int, ...] = ()

    @property
    def winner(self) -> VoteGroup | None:
        return self.groups[0] if self.groups else None

    @property
    def choice(self) -> int | None:
        win = self.winner
        if win is None:
            return None
        best = max(win.confidences)
        return win.choices[win.confidences.index(best)]

    def to_dict(self) -> dict[str, Any]:
        win = self.winner
        return {
            "rule": self.rule,
            "groups": [g.to_dict() for g in self.groups],
            "winner": None if win is None else {"answer": win.answer, "choice": self.choice},
            "stopped": list(self.stopped),
        }


def tally(ballots: Iterable[Ballot], rule: str = "confidence") -> Vote:
    """Group `ballots` by answer and rank the groups by `rule` (see the module)."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {', '.join(RULES)}, got {rule!r}")
    groups: dict[str, VoteGroup] = {}
    stopped = []
    for b in sorted(ballots, key=lambda b: b.index):
        if b.stopped:
            stopped.append(b.index)
            continue
        kind, value = b.answer
        key = json.dumps([kind, value], sort_keys=True, ensure_ascii=False)
        group = groups.setdefault(key, VoteGroup(kind, value))
        group.choices.append(b.index)
        group.confidences.append(0.0 if b.confidence is None else b.confidence)

    def rank(g: VoteGroup) -> tuple[float, float, int]:
        first = (g.confidence, g.count) if rule == "confidence" else (g.count, g.confidence)
        return (-first[0], -first[1], g.choices[0])

    return Vote(rule, tuple(sorted(groups.values(), key=rank)), tuple(stopped))


def _library_ballot(index: int, reply: Any, json_reply: bool) -> Ballot:
    if isinstance(reply, Ballot):
        return reply
    if isinstance(reply, str):
        return Ballot(index, reply, None, json_reply)
    segments = getattr(reply, "segments", None)
    if segments is not None:  # batch_generate's Completion
        text = reply.content if getattr(reply, "content", None) is not None else reply.text
        tokens = [t for s in segments for t in s.tokens]
        stopped = getattr(reply, "stopped_by", None) == STOPPED_BY
        return ballot_of(index, text, tokens, json_reply=json_reply, stopped=stopped)
    steps = list(reply)  # stream_generate's responses
    text = "".join(r.text for r in steps)
    last = steps[-1].output if steps else None
    stopped = last is not None and last.stopped_by == STOPPED_BY
    return ballot_of(index, text, [t for r in steps for t in r.last_segment_tokens],
                     json_reply=json_reply, stopped=stopped)  # fmt: skip


def vote(replies: Sequence[Any], rule: str = "confidence", *, json_reply: bool = False) -> Vote:
    """Vote over `replies` to one prompt: each a `batch_generate` completion, the list of
    `stream_generate` responses of one reply, a `Ballot`, or a bare string (no
    confidence). A reply early stop ended (`batch_generate(..., early_stop=True)`) does
    not vote. `json_reply`: the replies were JSON-constrained (compare any JSON
    value, not only objects and arrays). ValueError for an unknown `rule`."""
    return tally((_library_ballot(i, r, json_reply) for i, r in enumerate(replies)), rule)


class EarlyStop:
    """DeepConf's early stop over the `n` replies of one request, in probabilities.

    `observe(choice, logprob)` before a token of `choice` is taken says whether that
    token should be its last (its window fell below `threshold`); `finished(choice)`
    records a reply that ended by itself, `stopped(choice, room)` one ended here, with
    `room` tokens its limit still allowed (the most this saved)."""

    def __init__(self, n: int, window: int = WINDOW) -> None:
        self.n = n
        self.window = window
        self._recent: list[deque[float]] = [deque(maxlen=window) for _ in range(n)]
        self._sums = [0.0] * n
        self._lowest: list[float] = [math.inf] * n
        #: The lowest window of each reply that finished by itself.
        self.finished_lowest: dict[int, float] = {}
        #: choice -> the tokens its limit still allowed when it was stopped.
        self.saved_at_most: dict[int, int] = {}

    def running(self, choice: int) -> float | None:
        """The geometric mean probability of `choice`'s last `window` tokens (None
        before it has any)."""
        recent = self._recent[choice]
        return math.exp(self._sums[choice] / len(recent)) if recent else None

    @property
    def threshold(self) -> float | None:
        """The median of the finished replies' lowest windows (None before one finished)."""
        if not self.finished_lowest:
            return None
        return statistics.median(self.finished_lowest.values())

    def observe(self, choice: int, logprob: float) -> bool:
        """Take `choice`'s next token's logprob; True when the reply should stop after it."""
        lp = logprob if logprob > _FLOOR else _FLOOR  # NaN and -inf count as the floor
        recent = self._recent[choice]
        if len(recent) == recent.maxlen:
            self._sums[choice] -= recent[0]
        recent.append(lp)
        self._sums[choice] += lp
        if len(recent) < self.window:
            return False
        now = math.exp(self._sums[choice] / len(recent))
        self._lowest[choice] = min(self._lowest[choice], now)
        limit = self.threshold
        return limit is not None and now < limit

    def finished(self, choice: int) -> None:
        """`choice` ended by itself: its lowest window (its whole reply when shorter
        than one) joins the threshold."""
        lowest = self._lowest[choice]
        if math.isinf(lowest):
            lowest = self.running(choice) or 0.0
        self.finished_lowest[choice] = lowest

    def stopped(self, choice: int, room: int) -> None:
        """`choice` was stopped with `room` tokens of its limit left."""
        self.saved_at_most[choice] = max(room, 0)

    def usage(self) -> dict[str, Any]:
        """The usage extension: replies stopped, and the most tokens that saved."""
        return {
            "early_stopped": len(self.saved_at_most),
            "saved_tokens_at_most": sum(self.saved_at_most.values()),
        }


def feed_early(
    early: EarlyStop, choice: int, out: OutputProcessor, step: Step, cached: int = 0
) -> TokenOutput:
    """`out.feed(step, cached)`, ending the reply with this token when `early` says so:
    its limit is lowered to it, so the output stage lets out what it holds back and
    closes the reply's structure as at any limit, and the record says ``"stop"`` with
    `stopped_by` set. The caller removes the sequence, as for any finished one."""
    state = out.state
    limit = state.limit
    stopping = early.observe(choice, step.logprob) and (limit is None or state.n + 1 < limit)
    if stopping:
        state.limit = state.n + 1
    record = out.feed(step, cached)
    if stopping and record.finish_reason == "length":
        early.stopped(choice, 0 if limit is None else limit - state.n)
        return replace(record, finish_reason="stop", stopped_by=STOPPED_BY)
    if record.finish_reason == "stop":
        early.finished(choice)
    return record
