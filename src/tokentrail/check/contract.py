"""The contract checks: pure functions of recorded chunks and responses.

A server's standard fields must agree with its own content (vLLM #57052): the streamed
logprob tokens' bytes join to the streamed content, except that the token straddling a
stop string keeps its real bytes; a token wholly inside a stop string, or a special
token the content leaves out, is not listed with text it did not produce;
``usage.completion_tokens`` equals the tokens listed plus those a stop string cut; a
streamed and a whole response agree for a seed; errors are OpenAI-shaped.

Nothing here does I/O: `read_stream` / `read_whole` turn recorded JSON into a `Stream`,
and each ``check_*`` returns `Finding`s, so every rule is testable on hand-made frames.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..realign.dialects.openai import chat_choice, completion_choice
from ..realign.result import RealignError
from ..realign.wire import Frame, WireToken, token_string_bytes

#: Every contract check, by name, with what it asks of the server.
CHECKS = {
    "join": "the streamed logprob tokens' bytes join to the streamed content",
    "stop_tokens": "a token wholly inside a stop string is not listed",
    "special_tokens": "a special token the content leaves out is not listed with its text",
    "usage": "usage.completion_tokens = tokens listed + tokens cut by a stop string",
    "stream_whole": "streamed and non-streamed responses agree for a seed",
    "errors": "errors are OpenAI-shaped ({'error': {'message', 'type', ...}}, status 4xx)",
}

PASS, FAIL, WARN, SKIP = "pass", "fail", "warn", "skip"


@dataclass
class Answer:
    """One HTTP answer: status, the parsed SSE events or JSON body, the raw text."""

    status: int
    chunks: list[Any] = field(default_factory=list)
    text: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


@dataclass(frozen=True, slots=True)
class Finding:
    """One check on one probe: `status` pass, fail, warn (allowed, but worth saying) or
    skip (the stream gave nothing to check), and a line saying what was seen."""

    check: str
    probe: str
    status: str
    detail: str

    def to_dict(self) -> dict[str, str]:
        return {"check": self.check, "probe": self.probe, "status": self.status,
                "detail": self.detail}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Entry:
    """One standard logprobs entry as the server listed it."""

    token: str | None
    raw: bytes | None
    logprob: float | None
    top: int
    id: int | None = None
    #: The entry's bytes are more than its own token's (llama.cpp folds the bytes of
    #: tokens it sent no entry for into the next one): seen from its own alternative.
    folded: bool = False
    #: The bytes its own alternative (same id) claims, when the server lists one.
    own: bytes | None = None

    @property
    def data(self) -> bytes:
        """The bytes the entry claims: `bytes`, else its token string's."""
        if self.raw is not None:
            return self.raw
        return token_string_bytes(self.token) if self.token is not None else b""


@dataclass
class Stream:
    """One choice of a response, streamed or whole, as the standard fields describe it."""

    content: str = ""
    entries: list[Entry] = field(default_factory=list)
    logprobs_seen: bool = False
    finish_reason: str | None = None
    usage: Mapping[str, Any] | None = None
    token_ids: list[int] | None = None
    extension: bool = False
    reasoning: str = ""
    tool_calls: int = 0
    chunks: int = 0
    error: str | None = None

    @property
    def joined(self) -> bytes:
        return b"".join(e.data for e in self.entries)

    @property
    def completion_tokens(self) -> int | None:
        n = (self.usage or {}).get("completion_tokens")
        return n if isinstance(n, int) and not isinstance(n, bool) else None


def _entry(w: WireToken) -> Entry:
    own = [t for t in w.top or () if t.id is not None and t.id == w.id]
    folded = bool(own) and own[0].raw is not None and w.raw is not None and own[0].raw != w.raw
    mine = own[0].raw if own else None
    return Entry(w.token, w.raw, w.logprob, len(w.top or ()), w.id, folded, mine)


def _add_choice(s: Stream, ch: Mapping[str, Any], where: str) -> None:
    frame = Frame()
    body = ch.get("delta", ch.get("message"))
    if isinstance(body, Mapping):
        s.reasoning += str(body.get("reasoning_content") or body.get("reasoning") or "")
        s.tool_calls += len(body.get("tool_calls") or ())
    if "delta" in ch or "message" in ch:
        entries = chat_choice(ch, where, frame)
    else:
        entries = completion_choice(ch, where, frame)
    s.content += frame.content
    s.logprobs_seen = s.logprobs_seen or ch.get("logprobs") is not None
    s.entries.extend(_entry(w) for w in entries)
    if ch.get("finish_reason"):
        s.finish_reason = str(ch["finish_reason"])
    ids = ch.get("token_ids")
    if isinstance(ids, list):
        s.token_ids = (s.token_ids or []) + [i for i in ids if isinstance(i, int)]


def read_stream(chunks: Iterable[Any], choice: int = 0) -> Stream:
    """The `Stream` of choice `choice` in streamed chunks (parsed JSON objects)."""
    s = Stream()
    for k, chunk in enumerate(chunks):
        if not isinstance(chunk, Mapping):
            continue
        s.chunks += 1
        if "error" in chunk:
            s.error = _message(chunk["error"])
            continue
        s.extension = s.extension or "tokentrail" in chunk
        if chunk.get("usage"):
            s.usage = chunk["usage"]
        for n, ch in enumerate(chunk.get("choices") or ()):
            if isinstance(ch, Mapping) and ch.get("index", n) == choice:
                try:
                    _add_choice(s, ch, f"chunk {k + 1}.choices[{n}]")
                except RealignError as e:
                    s.error = f"unreadable chunk: {e}"
    return s


def read_whole(body: Any, choice: int = 0) -> Stream:
    """The `Stream` of choice `choice` in a whole (non-streamed) response."""
    return read_stream([body], choice)


def choices_in(chunks: Iterable[Any]) -> set[int]:
    """The choice indices the chunks carry."""
    out: set[int] = set()
    for chunk in chunks:
        if isinstance(chunk, Mapping):
            for n, ch in enumerate(chunk.get("choices") or ()):
                if isinstance(ch, Mapping) and isinstance(ch.get("index", n), int):
                    out.add(ch.get("index", n))
    return out


def _message(err: Any) -> str:
    if isinstance(err, Mapping):
        return str(err.get("message", err))
    return str(err)


# -- the checks --------------------------------------------------------------------------------

def _trailing(s: Stream, size: int) -> int | None:
    """How many entries at the end lie wholly past the first `size` bytes (None when
    the entries before them do not end exactly there)."""
    pos = 0
    for k, e in enumerate(s.entries):
        if pos == size:
            return len(s.entries) - k
        pos += len(e.data)
    return 0 if pos == size else None


def check_join(probe: str, s: Stream) -> list[Finding]:
    """The entries' bytes join to the content; trailing entries the content lacks are a
    `special_tokens` failure instead (e.g. ``<|im_end|>`` listed with its text)."""
    if not s.entries:
        why = "the stream listed no logprobs" if not s.logprobs_seen else "no entries"
        return [Finding("join", probe, SKIP, why)]
    content = s.content.encode("utf-8")
    joined = s.joined
    if joined == content:
        found = [Finding("join", probe, PASS, f"{len(s.entries)} entries join to the content")]
        found.append(_silent_specials(probe, s))
        return found
    extra = _trailing(s, len(content)) if joined.startswith(content) else None
    if extra:
        tail = [e.token or e.data.decode("utf-8", "replace") for e in s.entries[-extra:]]
        return [
            Finding("join", probe, PASS, "the entries join to the content, but for the last "
                    f"{extra} (see special_tokens)"),
            Finding("special_tokens", probe, FAIL,
                    f"listed {tail!r} with text the content leaves out"),
        ]  # fmt: skip
    at = _first_diff(joined, content)
    return [
        Finding("join", probe, FAIL, f"the entries' bytes differ from the content at byte {at}: "
                f"{joined[at:at + 12]!r} vs {content[at:at + 12]!r}")
    ]  # fmt: skip


def _silent_specials(probe: str, s: Stream) -> Finding:
    named = [e.token for e in s.entries if not e.data and e.token]
    if named:
        return Finding("special_tokens", probe, FAIL, f"entries with no bytes but text {named!r}")
    return Finding("special_tokens", probe, PASS, "no token is listed with text it did not produce")


def _first_diff(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


def check_usage(probe: str, streams: Sequence[Stream], cut: int = 0) -> Finding:
    """``usage.completion_tokens`` (of all `streams`, the choices of one response) equals
    the entries listed plus `cut` tokens a stop string cut off."""
    usage = next((s.completion_tokens for s in streams if s.completion_tokens is not None), None)
    if usage is None:
        return Finding("usage", probe, SKIP, "no usage was sent")
    if not any(s.entries for s in streams):
        return Finding("usage", probe, SKIP, "no logprobs entries to count")
    listed = sum(len(s.entries) for s in streams)
    folded = sum(e.folded for s in streams for e in s.entries)
    said = f"usage.completion_tokens {usage}, {listed} listed" + (f" + {cut} cut" if cut else "")
    if usage == listed + cut:
        return Finding("usage", probe, PASS, said)
    ended = all(s.finish_reason == "stop" for s in streams)
    if usage == listed + cut + len(streams) and ended and not cut and not folded:
        return Finding("usage", probe, WARN, f"{said}: usage counts the end token, which the "
                       "logprobs leave out")  # fmt: skip
    if folded:
        said += f"; {folded} entries carry the bytes of tokens that have no entry of their own"
    return Finding("usage", probe, FAIL, said)


@dataclass(frozen=True, slots=True)
class StopPlan:
    """A stop string chosen from a greedy baseline so that it starts inside one token
    (which straddles it) and ends inside the next; what a faithful server then sends."""

    stop: str
    #: The baseline's content before the stop string.
    content: str
    #: Entries before the stop string (the straddling one last).
    listed: int
    #: Tokens generated up to the one that completes the stop string.
    generated: int
    #: The bytes of the listed entries (the straddling token's real bytes included).
    joined: bytes
    #: The straddling token's bytes.
    straddler: bytes = b""


def plan_stop(base: Stream) -> StopPlan | None:
    """A stop string that ends mid-token, from a greedy baseline whose entries join to
    its content (None when no pair of tokens suits)."""
    if not base.entries or base.joined != base.content.encode("utf-8"):
        return None
    data = [e.data for e in base.entries]
    offsets = [0]
    for d in data:
        offsets.append(offsets[-1] + len(d))
    content = base.content.encode("utf-8")
    for k in range(max(2, len(data) // 3), len(data) - 1):
        before, tok = data[k - 1], data[k]
        if len(before) < 2 or len(tok) < 2 or not (before + tok).isascii():
            continue
        stop_b = before[-1:] + tok[:-1]
        stop = stop_b.decode("ascii")
        start = offsets[k] - 1
        if not stop.strip() or content.find(stop_b) != start:
            continue
        return StopPlan(stop, content[:start].decode("utf-8"), k, k + 1,
                        b"".join(data[:k]), before)  # fmt: skip
    return None


def check_stop(probe: str, plan: StopPlan, s: Stream) -> list[Finding]:
    """The stopped stream: content cut at the stop string, the straddling token listed
    with its real bytes, the tokens inside the stop string not listed, usage counting
    them."""
    if s.content != plan.content:
        why = (
            "the server did not stop at the stop string"
            if len(s.content) > len(plan.content) and s.content.startswith(plan.content)
            else "the output differs from the greedy baseline (not deterministic?)"
        )
        return [Finding(c, probe, SKIP, why) for c in ("join", "stop_tokens", "usage")]
    if not s.entries:
        return [Finding(c, probe, SKIP, "no logprobs entries") for c in ("join", "stop_tokens")]
    joined = s.joined
    out: list[Finding] = []
    listed = len(s.entries)
    if joined == plan.joined:
        out.append(Finding("join", probe, PASS, "the entries join to the content; the token "
                           "straddling the stop string keeps its real bytes"))  # fmt: skip
        out.append(Finding("stop_tokens", probe, PASS, f"nothing of {plan.stop!r} is listed "
                           "beyond the straddling token"))  # fmt: skip
    elif joined.startswith(plan.joined) and listed > plan.listed:
        out.append(Finding("join", probe, PASS, "the entries before the stop string join to "
                           "the content (see stop_tokens)"))  # fmt: skip
        inside = [e.token for e in s.entries[plan.listed :]]
        out.append(Finding("stop_tokens", probe, FAIL, f"listed {inside!r}, inside the stop "
                           f"string {plan.stop!r}, which the content does not have"))  # fmt: skip
    elif listed == plan.listed and joined == s.content.encode("utf-8"):
        last = s.entries[-1]
        out.append(Finding("join", probe, FAIL, f"the token straddling the stop string "
                           f"{plan.stop!r} is not listed with its real bytes "
                           f"{plan.straddler!r}: the last entry has {last.data!r}"))  # fmt: skip
        if last.folded:
            out.append(Finding("stop_tokens", probe, FAIL, f"the last entry names token "
                               f"{last.id} (bytes {last.own!r}, inside the stop string) with "
                               f"text it did not produce ({last.data!r})"))  # fmt: skip
        else:
            out.append(Finding("stop_tokens", probe, PASS, f"nothing of {plan.stop!r} is "
                               "listed beyond the straddling token"))  # fmt: skip
    else:
        at = _first_diff(joined, plan.joined)
        out.append(Finding("join", probe, FAIL, f"with stop {plan.stop!r}, the entries' bytes "
                           f"differ from the content and the straddling token's at byte {at}: "
                           f"{joined[at:at + 12]!r} vs {plan.joined[at:at + 12]!r}"))  # fmt: skip
    cut = max(0, plan.generated - listed)
    out.append(check_usage(probe, [s], cut))
    return out


def check_agree(probe: str, streamed: Stream, whole: Stream) -> Finding:
    """A streamed and a whole response to the same seeded request agree."""
    if streamed.content != whole.content:
        at = _first_diff(streamed.content.encode(), whole.content.encode())
        return Finding("stream_whole", probe, FAIL,
                       f"the streamed content differs from the whole response's at byte {at}")
    a = [e.data for e in streamed.entries]
    b = [e.data for e in whole.entries]
    if a and b and a != b:
        return Finding("stream_whole", probe, FAIL,
                       "same content, but the streamed logprobs list other tokens")
    return Finding("stream_whole", probe, PASS, f"{len(streamed.content)} characters agree")


def check_error(probe: str, status: int, body: str) -> Finding:
    """An error answer: a 4xx status and ``{"error": {"message": ..., "type": ...}}``."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    err = data.get("error") if isinstance(data, Mapping) else None
    shaped = isinstance(err, Mapping) and isinstance(err.get("message"), str)
    if 400 <= status < 500 and shaped:
        return Finding("errors", probe, PASS, f"{status}: {err['message'][:60]!r}")
    if not 400 <= status < 500:
        return Finding("errors", probe, FAIL, f"answered {status} to a bad request")
    return Finding("errors", probe, FAIL, f"{status} with a body that is not OpenAI's error "
                   f"shape: {body[:80]!r}")  # fmt: skip

