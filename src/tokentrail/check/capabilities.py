"""What the server can give, read from the recorded streams and the capability probes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .contract import Answer, Stream, read_stream, read_whole
from .report import NO, NOT_SEEN, PARTIAL, UNCHECKED, YES, Capability, Report


def _share(n: int, total: int, what: str) -> tuple[str, str]:
    if total and n == total:
        return YES, f"every entry ({total}) has {what}"
    if n:
        return PARTIAL, f"{n} of {total} entries have {what}"
    return NO, f"no entry has {what}" if total else "no logprobs entries"


def _entries(streams: Mapping[str, Stream]) -> list[Any]:
    return [e for s in streams.values() for e in s.entries]


def _token_ids(report: Report, streams: Mapping[str, Stream]) -> Capability:
    ways = []
    entries = _entries(streams)
    if entries and all(e.id is not None for e in entries):
        ways.append("an id on each logprobs entry (llama.cpp)")
    if any(s.token_ids for s in streams.values()):
        ways.append("token_ids on each choice (vLLM)")
    else:
        a = report.extra.get("return_token_ids")
        if a is not None and a.ok and read_stream(a.chunks).token_ids:
            ways.append("token_ids with return_token_ids (vLLM)")
    if any(s.extension for s in streams.values()):
        ways.append("tokentrail's extension")
    native = report.extra.get("llamacpp")
    if native is not None and native.ok and native.chunks:
        body = native.chunks[0]
        if isinstance(body, Mapping) and ("tokens" in body or "completion_probabilities" in body):
            ways.append("llama.cpp's /completion with n_probs and tokens")
    if ways:
        return Capability("token_ids", YES, "; ".join(ways))
    if report.quick:
        return Capability("token_ids", NO, "none in the streams (quick check)")
    return Capability("token_ids", NO, "only token strings or bytes")


def _accepted(a: Answer | None, name: str, seen: bool, what: str) -> Capability:
    if a is None:
        return Capability(name, UNCHECKED, "")
    if not a.ok:
        return Capability(name, NO, f"answered {a.status}")
    return Capability(name, YES if seen else PARTIAL, what if seen else "accepted, not seen")


def _prompt_logprobs(report: Report) -> Capability:
    echo, vllm = report.extra.get("echo"), report.extra.get("prompt_logprobs")
    if echo is None and vllm is None:
        return Capability("prompt_logprobs", UNCHECKED, "")
    if vllm is not None and vllm.ok and vllm.chunks:
        body = vllm.chunks[0]
        choices = body.get("choices") or [{}] if isinstance(body, Mapping) else [{}]
        if isinstance(body, Mapping) and (body.get("prompt_logprobs") or (
            isinstance(choices[0], Mapping) and choices[0].get("prompt_logprobs")
        )):
            return Capability("prompt_logprobs", YES, "prompt_logprobs (vLLM)")
    if echo is not None and echo.ok and echo.chunks:
        s = read_whole(echo.chunks[0])
        if len(s.entries) > 1:
            return Capability("prompt_logprobs", YES, "echo with logprobs")
    return Capability("prompt_logprobs", NO, "neither echo nor prompt_logprobs")


def _response_format(report: Report) -> Capability:
    a = report.extra.get("response_format")
    if a is None:
        return Capability("response_format", UNCHECKED, "")
    if not a.ok:
        return Capability("response_format", NO, f"answered {a.status}")
    content = read_whole(a.chunks[0]).content if a.chunks else ""
    try:
        json.loads(content)
    except ValueError:
        return Capability("response_format", PARTIAL, "accepted; the output is not JSON")
    return Capability("response_format", YES, "the output is JSON")


def capabilities(report: Report, streams: Mapping[str, Stream]) -> dict[str, Capability]:
    """Every capability of `tokentrail.check.report.CAPABILITIES`, from what was seen."""
    entries = _entries(streams)
    asked = [s for s in streams.values() if not s.error]
    out: dict[str, Capability] = {}
    lp = sum(1 for s in asked if s.entries)
    out["logprobs"] = Capability(
        "logprobs", YES if asked and lp == len(asked) else PARTIAL if lp else NO,
        f"{lp} of {len(asked)} streams carry logprobs entries",
    )
    out["bytes"] = Capability("bytes", *_share(sum(e.raw is not None for e in entries),
                                               len(entries), "bytes"))  # fmt: skip
    status, detail = _share(sum(e.top >= 3 for e in entries), len(entries), "3 alternatives")
    out["top_k"] = Capability("top_k", status, detail)
    out["token_ids"] = _token_ids(report, streams)
    with_usage = sum(1 for s in asked if s.usage)
    out["usage_in_stream"] = Capability(
        "usage_in_stream", YES if asked and with_usage == len(asked) else PARTIAL if with_usage
        else NO, f"{with_usage} of {len(asked)} streams end with usage",
    )  # fmt: skip
    out["prompt_logprobs"] = _prompt_logprobs(report)
    reasoning = any(s.reasoning for s in streams.values())
    out["reasoning"] = Capability("reasoning", YES if reasoning else NOT_SEEN,
                                  "" if reasoning else "no probe's model reasoned")  # fmt: skip
    tools = report.extra.get("tools")
    calls = tools is not None and read_stream(tools.chunks).tool_calls > 0
    out["tool_calls"] = _accepted(tools, "tool_calls", calls, "tool_calls deltas")
    out["response_format"] = _response_format(report)
    out["n"] = (
        Capability("n", UNCHECKED, "") if report.choices is None
        else Capability("n", YES, "2 choices") if report.choices >= 2
        else Capability("n", NO, "answered an error" if report.choices == 0 else "one choice")
    )  # fmt: skip
    seed = report.seed_reproducible
    out["seed"] = Capability("seed", UNCHECKED if seed is None else YES if seed else NO,
                             "" if seed is None else "two seeded responses "
                             + ("agree" if seed else "differ"))  # fmt: skip
    stop = report.stop_honoured
    out["stop"] = Capability("stop", UNCHECKED if stop is None else YES if stop else NO,
                             f"stop {report.stop!r}" if report.stop else "")  # fmt: skip
    ext = any(s.extension for s in streams.values())
    out["extension"] = Capability("extension", YES if ext else NO,
                                  "exact segments in every chunk" if ext else "")  # fmt: skip
    return out
