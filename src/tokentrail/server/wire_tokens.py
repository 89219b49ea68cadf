"""One token on the wire: the rules every chat writer shares (`Formatter` in
`tokentrail.server.formatting`, and the upstream chat's ChatWriter in
`tokentrail.server.proxy_chat`): how a listed token and its alternatives are spelled,
in the standard `logprobs` and in the extension's segments, and each vocabulary's
spellings worked out once (`Spellings`)."""

from __future__ import annotations

import math
from typing import Any
from weakref import WeakKeyDictionary

from ..segment import WIRE_NEG_INF, Alternative, TokenSpan, json_number
from ..vocab import Vocab

__all__ = ["Spellings", "spellings", "wire_logprob"]


_INF = math.inf


def wire_logprob(value: float | None) -> float | None:
    """A logprob JSON can carry: -inf becomes -9999.0 as in OpenAI's API."""
    if value is None or -_INF < value < _INF:  # (the common case, without a call)
        return value
    return json_number(value, WIRE_NEG_INF)


_lp = wire_logprob


class Spellings:
    """One vocabulary's tokens as the wire spells them, each worked out once: an id's
    text and its bytes as a JSON list, and the ids the content skips. Every chunk lists
    its token and each alternative (twice: the standard `top_logprobs` and the
    extension's), so the per-id work (the id check, the decode, the byte list) was
    done many times per token; the lists are shared, never changed after they are made.
    """

    __slots__ = ("_bytes", "_completion", "_of_id", "_vocab", "skip", "text")

    def __init__(self, vocab: Vocab) -> None:
        self._vocab = vocab
        #: id -> its text ("" for an id the model has but the tokenizer lacks).
        self.text: dict[int, str] = {}
        self._bytes: dict[bytes, list[int]] = {}  # token bytes -> their list
        self._of_id: dict[int, list[int]] = {}  # id -> its bytes' list
        #: The ids that write no text into the content (special or hidden).
        self.skip = vocab.special | vocab.hidden
        self._completion: dict[int, str] = {}  # id -> its completions-API string

    def token_text(self, token_id: int) -> str:
        text = self.text.get(token_id)
        if text is None:
            try:
                text = self._vocab.token_text(token_id)
            except ValueError:
                text = ""
            if type(token_id) is int:
                self.text[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's bytes as a list (shared: do not change it); [] for an id the
        model has but the tokenizer lacks."""
        out = self._of_id.get(token_id)
        if out is None:
            try:
                out = self.byte_list(self._vocab.token_bytes(token_id))
            except ValueError:
                return []
            if type(token_id) is int:
                self._of_id[token_id] = out
        return out

    def completion_token(self, token_id: int) -> str:
        """A completions-API token string: its text, or OpenAI's ``bytes:\\xNN`` form
        when its bytes are not valid UTF-8 on their own (so no information is lost); its
        text for a token without bytes; "" for an id the tokenizer lacks. Each id's is
        made once: every chunk of a completion spells its token and each alternative."""
        out = self._completion.get(token_id)
        if out is None:
            try:
                raw = self._vocab.token_bytes(token_id)
            except ValueError:
                return ""
            try:
                out = raw.decode("utf-8") if raw else self.token_text(token_id)
            except UnicodeDecodeError:
                out = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            if type(token_id) is int:
                self._completion[token_id] = out
        return out

    def byte_list(self, raw: bytes) -> list[int]:
        """`list(raw)`, made once per distinct token bytes (shared: do not change it)."""
        out = self._bytes.get(raw)
        if out is None:
            out = self._bytes[raw] = list(raw)
        return out

    def alternatives(
        self, alts: tuple[Alternative, ...] | list[Alternative], top: int | None
    ) -> list[Any]:
        """The extension's `top_logprobs` of a token: its first `top` alternatives."""
        made, byte_list = self._bytes.get, self.byte_list
        return [
            {"id": a.id, "logprob": _lp(a.logprob), "bytes": made(a.bytes) or byte_list(a.bytes),
             "text": a.text, "display": a.display or a.text}
            for a in alts[:top]
        ]  # fmt: skip

    def span(self, span: TokenSpan) -> dict[str, Any]:
        """A token of an extension segment, without its alternatives (`alternatives`)."""
        tid = span.id
        return {
            "index": span.index,
            "id": tid,
            "start": span.start,
            "end": span.end,
            "logprob": _lp(span.logprob),
            "text": self.token_text(tid),
            "bytes": self.token_bytes(tid),
        }

    def chat_logprob(self, span: TokenSpan, top: int | None) -> dict[str, Any]:
        """One token of a chat choice's `logprobs` (see `Formatter`'s standard-logprobs
        rule: a token the content skips is `""` with no bytes, listed or an
        alternative)."""
        skip, made, byte_list = self.skip, self._bytes.get, self.byte_list
        tid = span.id
        silent = span.start == span.end and tid in skip
        return {
            "token": "" if silent else self.token_text(tid),
            "logprob": _lp(span.logprob),
            "bytes": [] if silent else self.token_bytes(tid),
            "top_logprobs": [
                {"token": "", "logprob": _lp(a.logprob), "bytes": []}
                if a.id in skip
                else {
                    "token": a.text,
                    "logprob": _lp(a.logprob),
                    "bytes": made(a.bytes) or byte_list(a.bytes),
                }
                for a in (span.top_logprobs or ())[:top]
            ],
        }


_SPELLINGS: WeakKeyDictionary[Vocab, Spellings] = WeakKeyDictionary()


def spellings(vocab: Vocab) -> Spellings:
    """The `Spellings` of `vocab`, made on first use and kept as long as it lives."""
    found = _SPELLINGS.get(vocab)
    if found is None:
        found = _SPELLINGS[vocab] = Spellings(vocab)
    return found
