"""JSON fields with their tokens: one entry per leaf value of JSON output.

Each `JsonField` has the leaf's RFC 6901 `path`, its parsed `value`, its exact `text` as
it stands in the output (quotes included), and the `tokens` behind that text, each
narrowed to the bytes of it that belong to the leaf (a token `":"` + `"Par` is listed
with `"Par` only), so the tokens' byte ranges join to exactly `text`. `confidence` is a
segment's confidence of those narrowed tokens.

For a leaf whose allowed values are known (a schema's `enum`, `const` or `boolean`,
found through `$ref`, `anyOf`, `allOf` and the rest by `structure.schema`; a `choice`;
any boolean value), `alternatives` holds the model's probability of each
allowed value, computed from its full distribution by a `ContinuationScorer` the engine
supplies (it has the logits). Without one, `alternatives` is None with a `reason`:
top-k logprobs are never used to guess, since an allowed value may lie outside them.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import StructureError
from ..segment import Confidence, Segment, TokenSpan, confidence_of, json_number
from ..stops import splittable
from .jsonscan import JsonLeaf, JsonScanner, json_pointer
from .schema import schema_values

__all__ = [
    "MAX_SCORED_VALUES",
    "NO_SCORER",
    "AllowedValue",
    "ContinuationScorer",
    "FieldAttempt",
    "FieldBuilder",
    "FieldStream",
    "JsonField",
    "TokenPlacement",
    "allowed_values",
    "json_fields",
]

#: Why a leaf with allowed values has no alternatives when no scorer was given.
NO_SCORER = (
    "no scorer: the probability of each allowed value needs the model's full distribution "
    "(an in-process engine supplies it); top-k logprobs are not used to guess"
)


#: The most allowed values a leaf's alternatives are scored over: each costs the model a
#: forward pass, and a schema's enum can list thousands (issue #29: one request's
#: alternatives must not hold the model for everyone else).
MAX_SCORED_VALUES = 64


def too_many_values(n: int) -> str:
    """Why a leaf with `n` allowed values has no alternatives."""
    return (f"{n} allowed values: alternatives are scored for at most {MAX_SCORED_VALUES} "
            "(one forward pass each)")


class ContinuationScorer(Protocol):
    """What an engine supplies so that fields can carry `alternatives`.

    `tokenize(text)` is the tokenizer's encoding of a piece of text alone (no special
    tokens, no added prefix space). `continuation_logprobs(prefix_index, token_ids)` is
    the model's logprob of each of `token_ids` in turn, teacher-forced, right after the
    prompt and the output's first `prefix_index` tokens, taken from the full
    distribution (before any grammar mask). A scorer may also have `output_ids` (the
    ids generated so far, by index): the value written is then scored on its own
    generated tokens rather than on the tokenizer's encoding of its text.
    """

    def tokenize(self, text: str) -> Sequence[int]: ...

    def continuation_logprobs(
        self, prefix_index: int, token_ids: Sequence[int]
    ) -> Sequence[float]: ...


@dataclass(frozen=True, slots=True)
class AllowedValue:
    """One allowed value of a leaf: the model's `probability` of writing it there, and
    that probability `normalized` over the allowed values (what a grammar that allows
    only them leaves the model to choose between)."""

    value: Any
    probability: float
    normalized: float | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "value": self.value,
            "probability": json_number(self.probability),
            "normalized": json_number(self.normalized),
        }


@dataclass(frozen=True, slots=True)
class FieldAttempt:
    """One sampling of a leaf under field retry (issue #31): its `value`, `text` and
    `confidence`, and whether it is the one `kept` in the output."""

    value: Any
    text: str
    confidence: Confidence | None
    kept: bool = False

    def to_dict(self) -> dict[str, Any]:
        conf = self.confidence
        return {
            "value": self.value,
            "text": self.text,
            "confidence": None if conf is None else conf.to_dict(),
            "kept": self.kept,
        }


@dataclass(slots=True)
class JsonField:
    """One leaf value of JSON output with its tokens (see the module docstring).

    `start`/`end` are the leaf's char offsets in the output text.
    """

    path: str
    value: Any
    text: str
    tokens: tuple[TokenSpan, ...]
    start: int
    end: int
    alternatives: tuple[AllowedValue, ...] | None = None
    reason: str | None = None
    #: Under field retry, every sampling of the leaf in order (the kept one marked);
    #: None when the leaf was not retried.
    attempts: tuple[FieldAttempt, ...] | None = None

    @property
    def confidence(self) -> Confidence | None:
        return confidence_of(self.tokens)

    def to_dict(self) -> dict[str, Any]:
        conf = self.confidence
        out: dict[str, Any] = {
            "path": self.path,
            "value": self.value,
            "text": self.text,
            "tokens": [
                {"index": t.index, "id": t.id, "start": t.start, "end": t.end} for t in self.tokens
            ],
            "confidence": None if conf is None else conf.to_dict(),
            "alternatives": None
            if self.alternatives is None
            else [a.to_dict() for a in self.alternatives],
        }
        if self.reason is not None:
            out["reason"] = self.reason
        if self.attempts is not None:
            out["attempts"] = [a.to_dict() for a in self.attempts]
        return out


class TokenPlacement:
    """Where each token's bytes stand in the output: the global byte range of every span.

    Built from segments (`add`, one after another), or from tokens placed by hand
    (`from_tokens`). `narrow(a, b)` gives the
    tokens of output bytes [a, b), each cut to its share.
    """

    def __init__(self) -> None:
        self.data = bytearray()  # the output's bytes so far
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._spans: list[TokenSpan] = []
        self._exact: list[bool] = []

    def add(self, segment: Segment) -> None:
        """Place the next segment of the output."""
        raw = segment.text.encode("utf-8", "surrogatepass")
        base = len(self.data)
        self.data += raw
        if splittable(segment):
            pos = base
            for t in segment.tokens:
                self._place(pos, t, True)
                pos += t.end - t.start
        else:  # its chars do not map onto its bytes: each token covers the whole segment
            for t in segment.tokens:
                self._place(base, t, False, base + len(raw))

    @classmethod
    def of(cls, segments: Iterable[Segment] | TokenPlacement) -> TokenPlacement:
        """The placement of a whole output's segments (a placement is returned as is)."""
        if isinstance(segments, TokenPlacement):
            return segments
        placement = cls()
        for seg in segments:
            placement.add(seg)
        return placement

    @classmethod
    def from_tokens(cls, text: str, tokens: Iterable[tuple[int, TokenSpan]]) -> TokenPlacement:
        """The placement of output `text` from (byte offset in the output, span) pairs:
        each span's `end - start` bytes begin at that offset, in order."""
        placement = cls()
        placement.data += text.encode("utf-8", "surrogatepass")
        for offset, span in tokens:
            placement._place(offset, span, True)
        return placement

    def _place(self, at: int, t: TokenSpan, exact: bool, end: int | None = None) -> None:
        self._starts.append(at)
        self._ends.append(at + (t.end - t.start) if end is None else end)
        self._spans.append(t)
        self._exact.append(exact)

    def overlapping(self, a: int, b: int) -> list[int]:
        """Indexes of the placed spans that hold bytes of [a, b) (zero-byte ones inside)."""
        i = max(0, bisect_right(self._starts, a) - 1)
        while i > 0 and self._ends[i - 1] > a:
            i -= 1
        out = []
        while i < len(self._starts) and self._starts[i] <= b:
            g0, g1 = self._starts[i], self._ends[i]
            if (g0 < b and g1 > a) if g1 > g0 else a < g0 < b:
                out.append(i)
            i += 1
        return out

    def empty_at(self, pos: int) -> list[TokenSpan]:
        """The zero-byte tokens (a skipped special, an EOS) placed at byte `pos`."""
        i = bisect_right(self._starts, pos) - 1
        out: list[TokenSpan] = []
        while i >= 0 and self._starts[i] == pos:
            if self._ends[i] == pos:
                out.append(self._spans[i])
            i -= 1
        return out[::-1]

    def narrow(self, a: int, b: int) -> tuple[TokenSpan, ...]:
        """The tokens of bytes [a, b), each cut to its bytes there; pieces of one token
        placed side by side (a token cut between segments) joined back."""
        out: list[TokenSpan] = []
        for i in self.overlapping(a, b):
            t, g0 = self._spans[i], self._starts[i]
            if self._exact[i]:
                lo = t.start + max(a - g0, 0)
                hi = t.start + min(b, self._ends[i]) - g0
                t = TokenSpan(t.index, t.id, lo, hi, t.logprob, t.top_logprobs)
            prev = out[-1] if out else None
            if prev is not None and prev.index == t.index and prev.end == t.start:
                out[-1] = prev._replace(end=t.end)
            elif prev is None or prev != t:
                out.append(t)
        return tuple(out)

    def bounds(self, a: int, b: int) -> tuple[int, int, TokenSpan, TokenSpan] | None:
        """(the first byte of the first token of [a, b), the byte after its last token,
        the first token, the last token), or None when a token there is not exactly
        placed."""
        idx = [i for i in self.overlapping(a, b) if self._ends[i] > self._starts[i]]
        if not idx or not all(self._exact[i] for i in idx):
            return None
        return self._starts[idx[0]], self._ends[idx[-1]], self._spans[idx[0]], self._spans[idx[-1]]


def allowed_values(schema: Mapping[str, Any] | None, path: Sequence[str | int]) -> list | None:
    """The scalar values a JSON schema allows at `path` (object keys and array indexes),
    or None when it does not pin them down. `$ref`/`$defs`, `anyOf`/`oneOf`/`allOf`
    and the rest are resolved as `structure.schema.SchemaValues` says."""
    if schema is None:
        return None
    return schema_values(schema).allowed(path)


def _score(
    placement: TokenPlacement,
    a: int,
    b: int,
    candidates: Sequence[tuple[Any, str, bool]],
    scorer: ContinuationScorer,
) -> tuple[tuple[AllowedValue, ...] | None, str | None]:
    """Each candidate's probability where the leaf [a, b) stands, scored from the leaf's
    first token on (where the values can first part): the product of the model's raw
    probabilities of its tokens. The chosen value's tokens are the ones generated (from
    the leaf's first token to its last, so its probability is that of what the model
    wrote, whatever tokenization the sampler or grammar took); another value's are its
    text, with the bytes the leaf's first token had before it and its last token after
    it, as the tokenizer encodes it."""
    bounds = placement.bounds(a, b)
    if bounds is None:
        return None, "the leaf's tokens are not exactly placed (text that is not its bytes)"
    g0, g1, first, last = bounds
    generated = getattr(scorer, "output_ids", None)
    if first.index < 0:
        return None, "the leaf starts inside the prompt's last token"
    data = placement.data
    try:
        lead = data[g0:a].decode("utf-8")
        tail = data[b:g1].decode("utf-8")
    except UnicodeDecodeError:
        return None, "the leaf's first or last token is cut inside a character"
    logps = []
    for _value, text, chosen in candidates:
        if chosen and generated is not None and len(generated) > last.index:
            ids = list(generated[first.index : last.index + 1])
        else:
            ids = list(scorer.tokenize(lead + text + tail))
        lps = list(scorer.continuation_logprobs(first.index, ids))
        if len(lps) != len(ids):
            raise StructureError(
                f"continuation_logprobs returned {len(lps)} logprobs for {len(ids)} tokens"
            )
        logps.append(math.fsum(lps))
    top = max(logps)
    z = math.fsum(math.exp(lp - top) for lp in logps) if math.isfinite(top) else 0.0
    return tuple(
        AllowedValue(v, math.exp(lp), math.exp(lp - top) / z if z > 0 else None)
        for (v, _t, _c), lp in zip(candidates, logps, strict=True)
    ), None


class FieldBuilder:
    """Turns scanned leaves into fields: value, text, narrowed tokens, alternatives.

    `path_of` names a leaf from its path (None: not a field); the tool-call parsers use
    it to put arguments under `/tool_calls/N/arguments`."""

    def __init__(
        self,
        placement: TokenPlacement,
        schema: Mapping[str, Any] | None,
        choices: Mapping[str, Sequence[Any]] | None,
        scorer: ContinuationScorer | None,
        path_of: Callable[[tuple[str | int, ...]], str | None] = json_pointer,
    ) -> None:
        self.placement = placement
        self.schema = schema
        self.values = None if schema is None else schema_values(schema)
        self.choices = choices or {}
        self.scorer = scorer
        self.path_of = path_of

    def field(self, text: str, leaf: JsonLeaf, char0: int = 0, byte0: int = 0) -> JsonField | None:
        """The field of `leaf`, scanned from char `char0` / byte `byte0` of the output."""
        path = self.path_of(leaf.path)
        if path is None:
            return None
        raw = text[leaf.start + char0 : leaf.end + char0]
        try:
            value = json.loads(raw)
        except ValueError as e:
            raise StructureError(f"not a JSON value at {path or '/'}: {raw!r} ({e})") from None
        a, b = leaf.byte_start + byte0, leaf.byte_end + byte0
        field = JsonField(
            path, value, raw, self.placement.narrow(a, b), leaf.start + char0, leaf.end + char0
        )
        allowed = self.allowed(leaf.path, path, value)
        if allowed is not None:
            if self.scorer is None:
                field.reason = NO_SCORER
            elif len(allowed) > MAX_SCORED_VALUES:
                field.reason = too_many_values(len(allowed))
            else:
                cands = [(v, raw, True) if v == value and type(v) is type(value)
                         else (v, _dump(v), False) for v in allowed]  # fmt: skip
                field.alternatives, field.reason = _score(self.placement, a, b, cands, self.scorer)
        return field

    def allowed(self, parts: tuple[str | int, ...], path: str, value: Any) -> list | None:
        if path in self.choices:
            return list(self.choices[path])
        found = None if self.values is None else self.values.allowed(parts)
        if found is None and isinstance(value, bool):
            return [True, False]
        return found


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def json_fields(
    text: str,
    segments: Iterable[Segment] | TokenPlacement,
    *,
    schema: Mapping[str, Any] | None = None,
    choices: Mapping[str, Sequence[Any]] | None = None,
    scorer: ContinuationScorer | None = None,
) -> list[JsonField]:
    """The fields of JSON output `text`, whose tokens are `segments` (the aligner's
    segments of that text) or a `TokenPlacement` built by hand.

    `choices` maps a JSON Pointer to its allowed values (beside those a `schema` gives).
    Raises `StructureError` when `text` is not one JSON value.
    """
    placement = TokenPlacement.of(segments)
    if bytes(placement.data) != text.encode("utf-8", "surrogatepass"):
        raise StructureError("the segments' text is not the output text given")
    scanner = JsonScanner()
    leaves = scanner.feed(text) + scanner.finish()
    if scanner.error is not None:
        raise StructureError(scanner.error)
    if scanner.end is not None and text[scanner.end :].strip():
        raise StructureError(f"not JSON at char {scanner.end}: text after the JSON value")
    builder = FieldBuilder(placement, schema, choices, scorer)
    return [f for leaf in leaves if (f := builder.field(text, leaf)) is not None]


class FieldStream:
    """Fields as segments stream in: each leaf is returned by the `feed` that brings its
    last character (a number: the character after it, or `finish`).

    Output that stops being JSON sets `error` and yields no more fields (no exception:
    a stream is not broken by a reply that is not JSON).
    """

    def __init__(
        self,
        *,
        schema: Mapping[str, Any] | None = None,
        choices: Mapping[str, Sequence[Any]] | None = None,
        scorer: ContinuationScorer | None = None,
    ) -> None:
        self.placement = TokenPlacement()
        self._scanner = JsonScanner()
        self._builder = FieldBuilder(self.placement, schema, choices, scorer)
        self.fields: list[JsonField] = []

    @property
    def error(self) -> str | None:
        return self._scanner.error

    @property
    def open_leaf(self) -> bool:
        """Whether a leaf value has begun in the text fed so far and is not complete."""
        return self._scanner.error is None and self._scanner.in_leaf

    def trailing_error(self) -> str | None:
        """Why the whole output is not one JSON value: `error`, or text after the value
        (a stream yields the value's fields and ignores what follows it)."""
        scanner = self._scanner
        end = scanner.end
        if scanner.error is None and end is not None and scanner.text[end:].strip():
            return f"not JSON at char {scanner.end}: text after the JSON value"
        return scanner.error

    def feed(self, segments: Segment | Iterable[Segment]) -> list[JsonField]:
        """Add one segment (or several); return the fields they completed."""
        new = [segments] if isinstance(segments, Segment) else list(segments)
        leaves: list[JsonLeaf] = []
        for seg in new:
            self.placement.add(seg)
            leaves += self._scanner.feed(seg.text)
        return self._build(leaves)

    def finish(self) -> list[JsonField]:
        """End of output: a number still open is complete."""
        return self._build(self._scanner.finish())

    def _build(self, leaves: list[JsonLeaf]) -> list[JsonField]:
        out = []
        for leaf in leaves:
            try:
                field = self._builder.field(self._scanner.text, leaf)
            except StructureError as e:
                self._scanner.error = str(e)
                break
            if field is not None:
                out.append(field)
        self.fields += out
        return out
