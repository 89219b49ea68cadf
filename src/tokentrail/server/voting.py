"""Votes and early stop over HTTP (issue #31): ``"tokentrail": {"vote": ..., "early_stop": ...}``.

The rules are `tokentrail.output.vote`'s; this module checks the request (a vote needs
`n` > 1, early stop needs a vote) and collects each choice's records into its ballot
(`VoteBox`): the text of its answer (the content channel where there is a reasoning
format) and the tokens behind it, its confidence calibrated with the server's
calibration where it has one. The app writes each choice's ``ballot`` on
its whole choice (or its last chunk), and ``tokentrail.vote`` on the response (or a
final chunk with no choices, after every choice has ended).
"""

from __future__ import annotations

from typing import Any

from ..errors import APIError
from ..output.record import TokenOutput
from ..output.vote import STOPPED_BY, Ballot, ballot_of, tally
from ..segment import TokenSpan

__all__ = ["VoteBox", "check_vote"]


def check_vote(vote: str | None, early_stop: bool | None, n: int) -> None:
    """A 400 naming the key for a vote without several choices to count, or early stop
    without a vote (it needs the other choices to compare with)."""
    if vote is not None and n < 2:
        raise APIError(400, f"'tokentrail.vote' needs 'n' > 1 (several choices to count), "
                       f"got n = {n}", param="tokentrail.vote", code="invalid_value")  # fmt: skip
    if early_stop and vote is None:
        raise APIError(400, "'tokentrail.early_stop' needs 'tokentrail.vote' (it stops a "
                       "choice by comparing it with the others)", param="tokentrail.early_stop",
                       code="invalid_value")  # fmt: skip


class VoteBox:
    """The `n` choices of one request as ballots: `add` each choice's records in order;
    `ballot(choice)` once that choice has ended; `result()` once all have."""

    def __init__(self, n: int, rule: str, json_reply: bool, calibration: Any = None) -> None:
        self.rule = rule
        self.json_reply = json_reply
        self.calibration = calibration
        self._text: list[list[str]] = [[] for _ in range(n)]
        self._tokens: list[list[TokenSpan]] = [[] for _ in range(n)]
        self._ballots: dict[int, Ballot] = {}

    def add(self, choice: int, step: TokenOutput) -> None:
        """Take one record of `choice`: its answer's text and tokens (the content
        channel's with a reasoning format)."""
        if step.parts is None:
            self._text[choice].append(step.text)
            self._tokens[choice].extend(step.tokens)
        else:
            for part in step.parts:
                if part.channel == "content":
                    self._text[choice].append(part.text)
                    self._tokens[choice].extend(part.tokens)
        if step.finish_reason is not None:
            self._ballots[choice] = ballot_of(
                choice, "".join(self._text[choice]), self._tokens[choice],
                json_reply=self.json_reply, stopped=step.stopped_by == STOPPED_BY,
                calibration=self.calibration,
            )  # fmt: skip

    def ballot(self, choice: int) -> dict[str, Any]:
        """The ``ballot`` (in the choice's ``tokentrail`` extension) of an ended choice:
        its answer (normalised text or JSON value; null when early stop ended it) and the
        confidence it votes with."""
        b = self._ballots[choice]
        return {"answer": None if b.stopped else b.answer[1], "confidence": b.confidence}

    def result(self) -> dict[str, Any]:
        """`tokentrail.vote`: the groups ranked, the winner, the stopped choices."""
        return tally(self._ballots.values(), self.rule).to_dict()
