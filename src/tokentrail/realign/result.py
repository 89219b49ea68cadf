"""What realigning found: segments, refused tokens, and how far they can be trusted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import RealignError  # noqa: F401  (its old home)
from ..segment import Segment, TokenSpan


@dataclass(frozen=True, slots=True)
class RefusedToken:
    """A token the stream did not identify, so no text is attributed to it.

    `index` is its position among the generated tokens, or None when the server did not
    say how many tokens a missing frame held. `reported` is what the wire said about it.
    """

    index: int | None
    reason: str
    reported: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index, "reason": self.reason}
        if self.reported is not None:
            out["reported"] = self.reported
        return out


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One token the `Realigner` gave its aligner, in stream order (see `on_token`).

    An identified token has its stream `index` and `refused` None. A stand-in (a token
    that only spells the bytes of tokens the stream did not identify) has `index` None
    and `refused` the tokens it stands for; a refused token that had no bytes at all is
    given to no aligner, and comes with `id` None. `logprob` and `top` (alternatives as
    (id, logprob)) are what the wire said, None when it said nothing.
    """

    id: int | None
    logprob: float | None
    top: tuple[tuple[int, float], ...] | None
    index: int | None = None
    refused: tuple[RefusedToken, ...] | None = None

    @property
    def identified(self) -> bool:
        """Whether the stream identified this token (it is no stand-in)."""
        return self.refused is None

    @property
    def reason(self) -> str | None:
        """Why the token is not identified (the first refused token's reason), or None."""
        if self.refused is None:
            return None
        return self.refused[0].reason if self.refused else "unidentified"


#: A subscriber to `TokenEvent`s (`Realigner(on_token=...)`).
TokenHook = Callable[[TokenEvent], None]


#: Why a realigned token's `index` is None (`RealignedSegment.position_unknown`).
POSITION_UNKNOWN = (
    "the server sent fewer entries than tokens without saying where (folded frames; on "
    "a chat stream, tokens with no text), so this token's position in the stream cannot "
    "be told (its id and bytes are exact)"
)


@dataclass(slots=True)
class RealignedSegment(Segment):
    """A segment rebuilt from a stream; `refused` lists unidentified tokens behind its text.

    A token whose position the stream does not tell has ``index`` None (its id and byte
    range are still exact), and `position_unknown` says why: a wrong index is worse than
    none.
    """

    refused: tuple[RefusedToken, ...] = ()
    position_unknown: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = Segment.to_dict(self)
        if self.refused:
            out["refused"] = [r.to_dict() for r in self.refused]
        if self.position_unknown:
            out["position_unknown"] = self.position_unknown
        return out


@dataclass
class RealignResult:
    """Everything `realign` found: the segments and how far they can be trusted.

    `exact` is True when every token was identified (`lossy` False), the segments' text
    equals the streamed content, and a tokentrail extension, if any, agreed. `trailing`
    are tokens whose text the content does not have (a stop string the server cut off).
    """

    segments: list[Segment]
    source: str
    text: str
    content: str
    tokens: int
    refused: list[RefusedToken] = field(default_factory=list)
    trailing: list[TokenSpan] = field(default_factory=list)
    ambiguous: int = 0
    warnings: list[str] = field(default_factory=list)
    extension_agrees: bool | None = None
    #: Error bodies (``{"error": ...}``) the server sent instead of (or amid) chunks.
    errors: list[str] = field(default_factory=list)

    @property
    def lossy(self) -> bool:
        return bool(self.refused)

    @property
    def content_matches(self) -> bool:
        return self.text == self.content

    @property
    def exact(self) -> bool:
        return (
            not self.lossy
            and self.content_matches
            and self.extension_agrees is not False
            and not self.errors
        )

    def summary(self) -> str:
        """One line saying what is wrong (or that nothing is)."""
        parts = []
        if self.refused:
            shown = [str(r.index) if r.index is not None else "?" for r in self.refused[:8]]
            more = ", ..." if len(self.refused) > 8 else ""
            parts.append(
                f"lossy stream ({self.source}): attribution refused for "
                f"{len(self.refused)} token(s) (indices {', '.join(shown)}{more}): "
                f"{self.refused[0].reason}"
            )
        if not self.content_matches:
            at = first_difference(self.text, self.content)
            parts.append(
                f"the segments' text differs from the streamed content at character {at} "
                f"({self.text[at : at + 12]!r} vs {self.content[at : at + 12]!r})"
            )
        if self.extension_agrees is False:
            parts.append("the tokentrail extension disagrees with the realignment")
        if not parts:
            return f"exact: {self.tokens} tokens from {self.source}"
        return "; ".join(parts)


def first_difference(a: str, b: str) -> int:
    """The first character index where `a` and `b` differ (the shorter length if none)."""
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n
