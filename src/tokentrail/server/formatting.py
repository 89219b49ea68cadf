"""OpenAI chunks and responses, with the ``tokentrail`` extension (see `tokentrail.server`)."""

from __future__ import annotations

import time
from typing import Any

from ..fastjson import dumps
from ..output.record import TokenOutput
from ..segment import TokenSpan, json_number
from ..vocab import Vocab
from .echo import prompt_logprobs
from .protocol import GenRequest
from .wire_tokens import spellings
from .wire_tokens import wire_logprob as _lp


def _field(found: Any) -> dict[str, Any]:
    """A `JsonField` on the wire, with `start`/`end`: its character offsets in the
    content (the whole text without a reasoning format)."""
    return {**found.to_dict(), "start": found.start, "end": found.end}


# -- response formatting ----------------------------------------------------------------------


class Formatter:
    """Turns one sequence's steps into OpenAI chunks/responses with the tokentrail
    extension; `choice` is the sequence's index among the request's `n`."""

    def __init__(
        self, request_id: str, req: GenRequest, vocab: Vocab, choice: int = 0,
        *, several: bool = False,
    ) -> None:  # fmt: skip
        self.id = request_id
        self.req = req
        self.choice = choice
        #: Whether the answer has several choices (`n` > 1, or `several`: one of several
        #: prompts): then each chunk's extension names its choice.
        self.several = several or req.n > 1
        self.cached_tokens = 0
        self.vocab = vocab
        self.spell = spellings(vocab)
        self.created = int(time.time())
        self.chars = 0  # completion characters final so far
        self.first = True
        self.finish_reason: str | None = None
        self.n_tokens = 0
        self.n_listed = 0  # tokens listed in the standard logprobs so far (by index)
        self.listed_in: dict[str, int] = {}  # the same per `logprobs` key (channels on)
        self.prompt_tokens = 0
        self.constrained = req.structure.constraint is not None
        self.mass: dict[int, float | None] = {}  # token index -> allowed mass
        #: Whether the reply goes through a tool-call parser (its records have `tool`).
        self.tools = False
        #: Whether the reply ended in tool calls (finish_reason "tool_calls").
        self.called = False
        #: With a tool parser: the content tokens it released with the latest step(s).
        self.released: list[TokenSpan] = []

    # -- pieces --

    def _token_text(self, token_id: int) -> str:
        return self.spell.token_text(token_id)

    def _token_bytes(self, token_id: int) -> list[int]:
        return self.spell.token_bytes(token_id)

    def _span(self, span: TokenSpan) -> dict[str, Any]:
        out = self.spell.span(span)
        if self.constrained:
            out["allowed_mass"] = json_number(self.mass.get(span.index))
        if self.req.top_logprobs and span.top_logprobs:
            out["top_logprobs"] = self.spell.alternatives(span.top_logprobs, self.req.top_logprobs)
        return out

    def segment(self, step: TokenOutput) -> dict[str, Any] | None:
        if not step.text and not step.tokens:
            return None
        conf = step.confidence
        out = {
            "text": step.text,
            "tokens": [self._span(s) for s in step.tokens],
            "confidence": None if conf is None else conf.to_dict(),  # finite or None
        }
        if step.refused:
            out["refused"] = list(step.refused)
        return out

    def segments(self, step: TokenOutput) -> list[dict[str, Any]]:
        """The extension's segments for a step: one, or one per channel part (each with
        its `channel` and the tokens narrowed to the bytes that went into it)."""
        if step.parts is None:
            return [s for s in (self.segment(step),) if s is not None]
        out = []
        for part in step.parts:
            conf = part.confidence
            out.append({
                "text": part.text,
                "channel": part.channel,
                "tokens": [self._span(t) for t in part.tokens],
                "confidence": None if conf is None else conf.to_dict(),
            })
        return out

    def _structure(self, ext: dict[str, Any], step: TokenOutput, whole: bool) -> None:
        """Add the distribution, allowed mass, fields and channel confidence to `ext`."""
        ext["distribution"] = step.distribution
        end = step.end
        if whole:
            if end is not None and end.all_fields is not None:
                ext["fields"] = [_field(f) for f in end.all_fields]
                if end.fields_error is not None:
                    ext["fields_error"] = end.fields_error
        elif step.fields is not None:
            ext["fields"] = [_field(f) for f in step.fields]
            if end is not None and end.fields_error is not None:
                ext["fields_error"] = end.fields_error
        if end is not None and end.channel_confidence is not None:
            ext["channel_confidence"] = {
                c: None if conf is None else conf.to_dict()
                for c, conf in end.channel_confidence.items()
            }

    @staticmethod
    def _channel_text(steps: list[TokenOutput], channel: str) -> str:
        return "".join(p.text for s in steps for p in s.parts or () if p.channel == channel)

    def _delta(self, step: TokenOutput) -> dict[str, Any]:
        """A chat chunk's delta: the content, and the reasoning as both `reasoning`
        (vLLM >= 0.17) and `reasoning_content` (DeepSeek, mlx-vlm, the AI SDK)."""
        if step.parts is None:
            return {"content": step.text}
        delta: dict[str, Any] = {"content": self._channel_text([step], "content")}
        reasoning = self._channel_text([step], "reasoning")
        if reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        return delta

    def _tool_delta(self, step: TokenOutput, delta: dict[str, Any], ext: dict[str, Any]) -> None:
        """The step's content as the tool-call parser let it through, its
        `delta.tool_calls` pieces, and at the end the calls' fields."""
        tool = step.tool
        assert tool is not None
        self.released = list(tool.released)
        delta["content"] = tool.content
        if tool.deltas:
            delta["tool_calls"] = [dict(d) for d in tool.deltas]
        if tool.fields:
            ext["fields"] = [_field(f) for f in tool.fields]
        end = step.end
        if end is not None and end.tool_calls:
            self.called = True

    def _finish(self, reason: str | None) -> str | None:
        """`finish_reason`: "tool_calls" when the reply ended in calls."""
        if reason is not None and self.called:
            return "tool_calls"
        return reason

    def _message(
        self, steps: list[TokenOutput], text: str, ext: dict[str, Any]
    ) -> dict[str, Any]:
        """A whole chat reply's `message`: content, reasoning, tool calls (whose fields
        go in `ext`)."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if steps and steps[-1].parts is not None:
            message["content"] = self._channel_text(steps, "content")
            reasoning = self._channel_text(steps, "reasoning")
            message["reasoning"] = message["reasoning_content"] = reasoning or None
        if self.tools:
            self.released = [t for step in steps if step.tool for t in step.tool.released]
            found = [f for step in steps if step.tool for f in step.tool.fields]
            if found:
                ext["fields"] = [_field(f) for f in found]
            end = steps[-1].end if steps else None
            if end is not None and end.tool_calls:
                self.called = True
                message["content"] = end.tool_content or None
                message["tool_calls"] = [c.to_dict() for c in end.tool_calls]
        return message

    def _stop(self, step: TokenOutput) -> dict[str, Any] | None:
        """The extension's `stop`: the stop string and its tokens; after an alarm's
        "stop", `string` null and the tokens held back then (if any)."""
        if step.stop_string is None and not (step.stopped_by and step.stop_tokens):
            return None
        return {"string": step.stop_string, "tokens": [self._span(s) for s in step.stop_tokens]}

    @staticmethod
    def _alarms(ext: dict[str, Any], steps: list[TokenOutput], whole: bool) -> None:
        """The alarms (`output.alarm`) of `steps` in `ext`: a chunk lists those its
        record completes (none: no key), a whole response all of them; `stopped_by`
        from the last."""
        hits = [a.to_dict() for step in steps for a in step.alarms]
        if hits or whole:
            ext["alarms"] = hits
        if steps and steps[-1].stopped_by is not None:
            ext["stopped_by"] = steps[-1].stopped_by

    # -- standard logprobs: what the content has (vLLM #57052) --
    #
    # A token is listed once its text is final, in the chunk whose content it went into
    # (so held-back tokens are listed late, and several may share a chunk). Tokens the
    # content never has are not listed with text they did not produce: a stop string's
    # own tokens are left out (the extension's `stop` lists them; usage counts them), a
    # special token the content skips is listed with empty text and bytes. The token that
    # straddles a stop string keeps its real bytes.
    #
    # One token, one spelling: a token the content skips (the end-of-turn token, any
    # special or hidden token) is spelled `""` with no bytes wherever the standard fields
    # name it, as the listed token and as an alternative in any `top_logprobs`: that is
    # what choosing it writes into the content, so the listed bytes still join to the
    # content and an alternative compares equal to the same token listed. Its name, id
    # and bytes are in the extension (`tokentrail.segments[].tokens`).

    def _skipped(self, token_id: int) -> bool:
        """A token that writes no text into the content (special or hidden)."""
        return token_id in self.spell.skip

    def _silent(self, span: TokenSpan) -> bool:
        """A special token that added no text to the content."""
        return span.start == span.end and self._skipped(span.id)

    def listed(self, step: TokenOutput, offset: int) -> list[tuple[TokenSpan, int]]:
        """The tokens whose text became final with `step`, not listed before, each with
        the text offset where its text starts."""
        out: list[tuple[TokenSpan, int]] = []
        raw = step.text.encode("utf-8")
        pos = 0
        for span in step.tokens:
            if span.index >= self.n_listed:
                out.append((span, offset + len(raw[:pos].decode("utf-8", "ignore"))))
                self.n_listed = span.index + 1
            pos += span.end - span.start
        return out

    def chat_logprobs(
        self,
        steps: list[TokenOutput],
        listed: list[tuple[TokenSpan, int]],
        whole: bool,
    ) -> dict[str, Any]:
        """A chat choice's `logprobs`: `content` lists the tokens the content has. With a
        reasoning format only the content channel's, as OpenAI (and SGLang's fix of its
        #25055) keep it aligned with `content`; the reasoning's tokens go in
        `reasoning_content` (named as the message field most servers send), the marker
        text's in neither. A token that straddles two channels is in each it wrote to;
        the extension's segments keep every channel's tokens with their byte ranges.
        With a tool parser, `content` lists the tokens it released (`self.released`):
        a token whose text may still open a call is listed once the parser lets that
        text through as content, one that wrote only call text never."""
        tools = self.tools
        if not steps or steps[-1].parts is None:
            if tools:
                return {"content": [self.chat_logprob(s) for s in self.released]}
            return {"content": [self.chat_logprob(s) for s, _ in listed]}
        out: dict[str, list[dict[str, Any]]] = {"content": [], "reasoning_content": []}
        for step in steps:
            for part in step.parts or ():
                key = _LOGPROB_KEYS.get(part.channel)
                if key is None or (tools and key == "content"):
                    continue
                for span in part.tokens:
                    if span.index >= self.listed_in.get(key, 0):
                        out[key].append(self.chat_logprob(span))
                        self.listed_in[key] = span.index + 1
        if tools:
            out["content"] = [self.chat_logprob(s) for s in self.released]
        if not whole and not out["reasoning_content"]:
            del out["reasoning_content"]
        return out

    def chat_logprob(self, span: TokenSpan) -> dict[str, Any]:
        """One listed token in chat's shape, every token spelled by the one rule above
        (a skipped token is `""` with no bytes, listed or among the alternatives)."""
        return self.spell.chat_logprob(span, self.req.top_logprobs)

    def _completion_top(self, span: TokenSpan) -> dict[str, float | None]:
        top: dict[str, float | None] = {}
        spell, skip = self.spell.completion_token, self.spell.skip
        for a in (span.top_logprobs or ())[: self.req.top_logprobs]:
            name = "" if a.id in skip else spell(a.id)
            if name not in top:  # the first (likeliest) of two that spell the same
                top[name] = _lp(a.logprob)
        return top

    def completion_logprobs(self, listed: list[tuple[TokenSpan, int]]) -> dict[str, Any]:
        spell = self.spell.completion_token
        return {
            "tokens": ["" if self._silent(s) else spell(s.id) for s, _ in listed],
            "token_logprobs": [_lp(s.logprob) for s, _ in listed],
            "top_logprobs": [self._completion_top(s) for s, _ in listed],
            "text_offset": [at for _, at in listed],
        }

    def _echo(
        self, text: str, logprobs: dict[str, Any] | None, head: bool
    ) -> tuple[str, dict[str, Any] | None]:
        """A completion's `text` and `logprobs` with the echoed prompt (`server.echo`):
        its text and entries first where `head` (the response, or the first chunk), the
        completion's offsets after its text."""
        echo = self.req.echoed
        shift = len(echo.text)
        if logprobs is not None:
            logprobs["text_offset"] = [at + shift for at in logprobs["text_offset"]]
            if head and echo.rows is not None:
                before = prompt_logprobs(echo, self.spell, self.req.top_logprobs)
                logprobs = {key: before[key] + logprobs[key] for key in before}
        return (echo.text + text if head else text), logprobs

    def _note(self, step: TokenOutput) -> int:
        """Account for a step; return the text offset where its text starts."""
        offset = self.chars
        self.chars += len(step.text)
        self.n_tokens += 1
        self.prompt_tokens = step.prompt_tokens or self.prompt_tokens
        self.cached_tokens = step.cached_tokens or self.cached_tokens
        if step.finish_reason is not None:
            self.finish_reason = step.finish_reason
        return offset

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.n_tokens, self.cached_tokens)

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.req.model,
            "system_fingerprint": None,
        }

    # -- streamed --

    def chunk(self, step: TokenOutput) -> dict[str, Any]:
        offset = self._note(step)
        if step.tool is not None:
            self.tools = True
        self.mass[step.index] = step.allowed_mass
        token = {
            "index": step.index,
            "id": step.token,
            "text": self._token_text(step.token),
            "bytes": self._token_bytes(step.token),
            "logprob": _lp(step.logprob),
        }
        if self.constrained:
            token["allowed_mass"] = json_number(step.allowed_mass)
        ext: dict[str, Any] = {"token": token, "segments": self.segments(step)}
        self._structure(ext, step, whole=False)
        self._alarms(ext, [step], whole=False)
        stop = self._stop(step)
        if stop is not None:
            ext["stop"] = stop
        listed = self.listed(step, offset)
        if self.req.kind == "chat":
            delta = self._delta(step)
            if step.tool is not None:
                self._tool_delta(step, delta, ext)
            if self.first:
                delta = {"role": "assistant", **delta}
            choice: dict[str, Any] = {
                "index": self.choice,
                "delta": delta,
                "logprobs": self.chat_logprobs([step], listed, False)
                if self.req.logprobs
                else None,
                "finish_reason": self._finish(step.finish_reason),
            }
            out = self._envelope("chat.completion.chunk")
        else:
            text, logprobs = step.text, None
            if self.req.logprobs:
                logprobs = self.completion_logprobs(listed)
            if self.req.echoed is not None:
                text, logprobs = self._echo(text, logprobs, self.first)
            choice = {
                "index": self.choice,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": step.finish_reason,
            }
            out = self._envelope("text_completion")
        if self.req.return_token_ids:
            self._token_ids(out, choice, [step.token], self.first)
        self.first = False
        out["choices"] = [choice]
        if self.several:
            ext["choice"] = self.choice
        out["tokentrail"] = ext
        return out

    def prompt_chunk(self) -> dict[str, Any]:
        """The one chunk of a choice that generates nothing (``echo`` with `max_tokens`
        0, `GenRequest.prompt_only`): the prompt, its logprobs where asked, "length"."""
        self._prompt_only()
        text, logprobs = self._echo("", self._no_logprobs(), True)
        out = self._envelope("text_completion")
        out["choices"] = [
            {"index": self.choice, "text": text, "logprobs": logprobs, "finish_reason": "length"}
        ]
        if self.req.return_token_ids:
            self._token_ids(out, out["choices"][0], [], True)
        ext: dict[str, Any] = {"segments": []}
        if self.several:
            ext["choice"] = self.choice
        out["tokentrail"] = ext
        self.first = False
        return out

    def _token_ids(
        self, out: dict[str, Any], choice: dict[str, Any], ids: list[int], head: bool
    ) -> None:
        """vLLM's ``return_token_ids``: the choice's `token_ids` (a chunk's own), and
        with the `head` (the response or the first chunk) the prompt's
        `prompt_token_ids`, at the top for chat and in the choice for completions."""
        choice["token_ids"] = ids
        if head and self.req.prompt_ids is not None:
            (out if self.req.kind == "chat" else choice)["prompt_token_ids"] = list(
                self.req.prompt_ids
            )

    def _prompt_only(self) -> None:
        self.prompt_tokens = len(self.req.echoed.ids)
        self.finish_reason = "length"

    def _no_logprobs(self) -> dict[str, Any] | None:
        return self.completion_logprobs([]) if self.req.logprobs else None

    def usage_chunk(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.req.kind == "chat" else "text_completion"
        out = self._envelope(obj)
        out["choices"] = []
        out["usage"] = self.usage()
        return out

    # -- whole --

    def response(self, steps: list[TokenOutput]) -> dict[str, Any]:
        if self.req.prompt_only:
            self._prompt_only()
        text_parts: list[str] = []
        segments: list[dict[str, Any]] = []
        listed: list[tuple[TokenSpan, int]] = []
        stop = None
        for step in steps:
            if step.tool is not None:
                self.tools = True
            self.mass[step.index] = step.allowed_mass
            listed.extend(self.listed(step, self._note(step)))
            text_parts.append(step.text)
            segments.extend(self.segments(step))
            stop = self._stop(step) or stop
        text = "".join(text_parts)
        ext: dict[str, Any] = {"segments": segments}
        if stop is not None:
            ext["stop"] = stop
        if steps:
            self._structure(ext, steps[-1], whole=True)
            if steps[-1].stopped_by is not None:
                ext["stopped_by"] = steps[-1].stopped_by
        if self.req.structure.alarm is not None:
            self._alarms(ext, steps, whole=True)
        finish = self.finish_reason or "stop"
        if self.req.kind == "chat":
            message = self._message(steps, text, ext)
            finish = self._finish(finish) or finish
            out = self._envelope("chat.completion")
            out["choices"] = [
                {
                    "index": self.choice,
                    "message": message,
                    "logprobs": self.chat_logprobs(steps, listed, True)
                    if self.req.logprobs
                    else None,
                    "finish_reason": finish,
                }
            ]
        else:
            logprobs = self.completion_logprobs(listed) if self.req.logprobs else None
            if self.req.echoed is not None:
                text, logprobs = self._echo(text, logprobs, True)
            out = self._envelope("text_completion")
            out["choices"] = [
                {"index": self.choice, "text": text, "logprobs": logprobs, "finish_reason": finish}
            ]
        if self.req.return_token_ids:
            self._token_ids(out, out["choices"][0], [s.token for s in steps], True)
        out["usage"] = self.usage()
        out["tokentrail"] = ext
        return out


#: The `logprobs` key of each channel's tokens (markup and tool calls: none).
_LOGPROB_KEYS = {"content": "content", "reasoning": "reasoning_content"}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's `usage`, with `prompt_tokens_details.cached_tokens` from the prompt cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def merge_responses(responses: list[dict[str, Any]]) -> dict[str, Any]:
    """One response for a request with `n` > 1: every choice, usage summed over them.

    The top-level `tokentrail` stays choice 0's (as for n = 1) and gains `choices`,
    each choice's own extension in choice order.
    """
    if len(responses) == 1:
        return responses[0]
    out = dict(responses[0])
    out["choices"] = [c for r in responses for c in r["choices"]]
    first = responses[0]["usage"]
    completion = sum(r["usage"]["completion_tokens"] for r in responses)
    out["usage"] = usage(
        first["prompt_tokens"], completion, first["prompt_tokens_details"]["cached_tokens"]
    )
    exts = [r["tokentrail"] for r in responses]
    out["tokentrail"] = {**exts[0], "choices": exts}
    return out


def sse(obj: Any) -> bytes:
    """One server-sent event carrying `obj` as compact JSON (never NaN or Infinity;
    `tokentrail.fastjson`: orjson where installed)."""
    return b"data: " + dumps(obj) + b"\n\n"

