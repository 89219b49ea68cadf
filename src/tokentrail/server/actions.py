"""The request options that act on confidence while the reply streams (issue #31):
the ``tokentrail`` object's ``alarm``, ``retry``, ``branch``, ``vote`` and ``early_stop``.

They are declared here once, as pydantic models, so chat and completions, streamed and
whole, read them the same way; a value out of range or of the wrong type is a 400 whose
``param`` names the key (for example ``alarm.below`` inside the ``tokentrail``
object). What each one does lives with the stage that does it (alarms in the output
stage, retry and branch in the engines and the scheduler, votes in the response); this
module only says what may be asked.

- ``alarm``: ``{"below": P, "on": "segment" | "field" | "both", "action": "flag" | "stop"}``:
  flag each segment / JSON field whose confidence is below P; ``stop`` ends the reply
  right after the first such unit.
- ``retry``: ``{"below": P, "max": K, "temperature": T}`` on a JSON-constrained reply: a
  leaf value whose confidence is below P is sampled again (up to K more times), keeping
  the most confident attempt.
- ``branch``: ``{"ids": [...], "at": N, "token": ID}``: continue the same prompt with the
  reply's first N tokens kept and token ID forced at position N (``token`` left out:
  sampled afresh there).
- ``vote``: ``"confidence"`` or ``"majority"`` with ``n`` > 1: the choices' answers grouped,
  with counts, summed confidence and the winner.
- ``early_stop``: with ``vote``, stop a choice whose running confidence falls below the
  others' running threshold.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["MAX_BRANCH_IDS", "MAX_RETRIES", "AlarmOptions", "BranchOptions", "RetryOptions"]

#: The most extra attempts one field may take (each is a fresh sampling of the leaf).
MAX_RETRIES = 8
#: The longest reply prefix a branch may carry.
MAX_BRANCH_IDS = 1 << 17

_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)
Probability = Annotated[float, Field(ge=0.0, le=1.0)]


class AlarmOptions(BaseModel):
    """The ``alarm`` key: flag (or stop at) units whose confidence is below `below`."""

    model_config = _STRICT

    below: Probability
    on: Literal["segment", "field", "both"] = "segment"
    action: Literal["flag", "stop"] = "flag"


class RetryOptions(BaseModel):
    """The ``retry`` key: resample a JSON leaf whose confidence is below `below`."""

    model_config = _STRICT

    below: Probability
    max: Annotated[int, Field(ge=1, le=MAX_RETRIES)] = 2
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0


class BranchOptions(BaseModel):
    """The ``branch`` key: keep the reply's first `at` ids, force `token` at `at`."""

    model_config = _STRICT

    ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_BRANCH_IDS)]
    at: Annotated[int, Field(ge=0)]
    token: Annotated[int, Field(ge=0)] | None = None
