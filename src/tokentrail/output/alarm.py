"""Alarms: flag (or stop at) the segments and JSON fields whose confidence is below P.

An `Alarm(below, on, action)` is what a caller asks: `stream_generate(alarm=...)` or the
``alarm`` in a server request's ``tokentrail`` object. `AlarmWatch` is its stage in the
one output pipeline (`tokentrail.output.processor.OutputProcessor`, after fields and
calibration): for each record it looks at the units that became final with it and
lists those below P as `AlarmHit`s on the record (`TokenOutput.alarms`).

The units and the figure compared are exactly those the record reports:

- a segment is one entry of the extension's ``segments`` list on the wire: the record's
  text with its tokens, or, with channels (a reasoning format or a tool-call parser),
  each `ChannelSegment` part; its `index` is its position among the reply's segments;
- a field is each `JsonField` completed with this record (the content's, and with a
  tool-call parser the calls' arguments'), named by its `path`;
- the figure is the unit's `confidence.calibrated` where a calibration set it, else its
  `confidence.probability` (the geometric-mean token probability); a unit without
  logprobs (confidence None) is never flagged. "Below" is strict: value < P.

With `action="stop"` the processor ends the sequence right after the record that
completes the first flagged unit (`finish_reason` "stop", `stopped_by` "alarm"), through
the same path a stop string takes, so no further token is computed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..errors import ActionError

if TYPE_CHECKING:
    from ..segment import Confidence
    from .record import TokenOutput

__all__ = [
    "ALARM_ACTIONS",
    "ALARM_UNITS",
    "Alarm",
    "AlarmHit",
    "AlarmWatch",
    "checked_alarm",
    "reported",
]

#: What an alarm looks at.
ALARM_UNITS = ("segment", "field", "both")
#: What an alarm does: flag the unit, or also end the reply right after it.
ALARM_ACTIONS = ("flag", "stop")
_KEYS = ("below", "on", "action")


@dataclass(frozen=True, slots=True)
class Alarm:
    """Flag each unit (`on`: "segment", "field" or "both") whose confidence is below
    `below` (a probability in [0, 1]); `action` "stop" also ends the reply right after
    the first one. A bad value is an `ActionError` (a ValueError) whose `param` names
    the key (``alarm.below``)."""

    below: float
    on: Literal["segment", "field", "both"] = "segment"
    action: Literal["flag", "stop"] = "flag"

    def __post_init__(self) -> None:
        below = self.below
        if isinstance(below, bool) or not isinstance(below, int | float):
            raise ActionError(
                f"alarm.below must be a probability (a number), got {below!r}", "alarm.below"
            )
        if not (math.isfinite(below) and 0.0 <= below <= 1.0):
            raise ActionError(f"alarm.below must be in [0, 1], got {below!r}", "alarm.below")
        object.__setattr__(self, "below", float(below))
        if self.on not in ALARM_UNITS:
            raise ActionError(
                f"alarm.on must be one of {', '.join(ALARM_UNITS)}, got {self.on!r}", "alarm.on"
            )
        if self.action not in ALARM_ACTIONS:
            raise ActionError(
                f"alarm.action must be one of {', '.join(ALARM_ACTIONS)}, got {self.action!r}",
                "alarm.action",
            )

    @classmethod
    def of(cls, value: Alarm | Mapping[str, Any]) -> Alarm:
        """`value` as an `Alarm`: an `Alarm`, or a mapping with its keys (``below``
        required), such as the ``alarm`` of a server request's ``tokentrail`` object."""
        if isinstance(value, Alarm):
            return value
        if not isinstance(value, Mapping):
            raise ActionError(
                f"alarm must be an Alarm or a mapping with 'below', got {type(value).__name__}",
                "alarm",
            )
        unknown = [k for k in value if k not in _KEYS]
        if unknown:
            raise ActionError(
                f"alarm has no key {unknown[0]!r} (it takes {', '.join(_KEYS)})",
                f"alarm.{unknown[0]}",
            )
        if "below" not in value:
            raise ActionError("alarm needs 'below': a probability in [0, 1]", "alarm.below")
        return cls(**value)

    @property
    def segments(self) -> bool:
        return self.on != "field"

    @property
    def fields(self) -> bool:
        return self.on != "segment"

    @property
    def stops(self) -> bool:
        return self.action == "stop"


@dataclass(frozen=True, slots=True)
class AlarmHit:
    """One flagged unit: `on` "segment" (with its `index` among the reply's segments)
    or "field" (with its `path`), the `value` compared and the threshold `below`."""

    on: Literal["segment", "field"]
    value: float
    below: float
    index: int | None = None
    path: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The wire's shape: ``{"on", "index" or "path", "value", "below"}``."""
        out: dict[str, Any] = {"on": self.on}
        if self.on == "segment":
            out["index"] = self.index
        else:
            out["path"] = self.path
        out["value"] = self.value
        out["below"] = self.below
        return out


def reported(conf: Confidence | None) -> float | None:
    """The figure a unit's confidence reports: `calibrated` where set, else
    `probability` (None: no logprobs, or a figure that is not a number)."""
    if conf is None:
        return None
    value = conf.calibrated if conf.calibrated is not None else conf.probability
    return value if math.isfinite(value) else None


class AlarmWatch:
    """One sequence's alarm stage: `check(record)` lists the units final with the
    record that are below the alarm's threshold, counting segments as the wire does."""

    __slots__ = ("alarm", "n_segments")

    def __init__(self, alarm: Alarm) -> None:
        self.alarm = alarm
        #: Segments the reply has listed so far (the next one's `index`).
        self.n_segments = 0

    def check(self, out: TokenOutput) -> list[AlarmHit]:
        """The flagged units of `out`, segments first (in order), then fields."""
        alarm = self.alarm
        below = alarm.below
        hits: list[AlarmHit] = []
        for conf in self._segments(out):
            index = self.n_segments
            self.n_segments += 1
            value = reported(conf)
            if alarm.segments and value is not None and value < below:
                hits.append(AlarmHit("segment", value, below, index=index))
        if alarm.fields:
            for found in self._fields(out):
                value = reported(found.confidence)
                if value is not None and value < below:
                    hits.append(AlarmHit("field", value, below, path=found.path))
        return hits

    @staticmethod
    def _segments(out: TokenOutput) -> Iterable[Confidence | None]:
        """Each segment's confidence, as `server.formatting.Formatter.segments` lists
        them: the record's own, or one per channel part."""
        if out.parts is None:
            if out.text or out.tokens:
                yield out.confidence
            return
        for part in out.parts:
            yield part.confidence

    @staticmethod
    def _fields(out: TokenOutput) -> Iterable[Any]:
        """The JSON fields completed with `out`: the content's, then the tool calls'."""
        yield from out.fields or ()
        if out.tool is not None:
            yield from out.tool.fields


def checked_alarm(alarm: Alarm | Mapping[str, Any] | None, fields: bool) -> Alarm | None:
    """`alarm` checked for a reply with (`fields`) or without JSON fields: an alarm on
    fields alone where the reply has none is an `ActionError` naming ``alarm.on``
    ("both" on a reply without fields watches its segments)."""
    if alarm is None:
        return None
    alarm = Alarm.of(alarm)
    if alarm.on == "field" and not fields:
        raise ActionError(
            "alarm.on 'field' needs JSON fields: a JSON schema constraint, fields=True "
            "(the server's tokentrail.fields) or tool calls",
            "alarm.on",
        )
    return alarm
