"""Getting each question answered and scored: in process (a model from `tokentrail.load`)
or from an OpenAI-compatible server over HTTP. Greedy decoding, top-k alternatives per
token; with choices, a constrained choice and each choice's own logprob.

A choice is scored by decoding it alone under a one-choice constraint: its canonical
tokens (the tokenizer's own spelling of it) are then forced, and their raw logprobs
(the model's distribution before the mask, which is what tokentrail reports by default,
here and over HTTP) sum to the model's logprob of writing it. The chosen one is decoded
alone too: the constrained answer's own tokens can spell it off that path (greedy
decoding among choices takes the likeliest first token that starts any of them, and
the rest of the choice follows from there), which scores one choice on another path
than the rest ("Laos" in three tokens at -18.3 where its two canonical ones are -3.5).

A server may report its logprobs after the constraint's mask instead: vLLM's OpenAI
server applies the grammar's bitmask to the logits before it computes logprobs (its
``raw_logprobs`` included), so a token the constraint forbids is listed at minus
infinity (-9999 on the wire) and a forced one at probability 1. A choice decoded alone
then says little (it comes back near probability 1, its only doubt between spellings),
and the constrained answer's own tokens say it all: their masked probabilities multiply
to the probability that the constrained decoding writes the chosen choice, which is
what `Reply.field_prob` gives there. Such a server is recognised by what it sends (an
alternative at minus infinity in a constrained reply, which the model's own top-k never
holds: a softmax gives no token probability 0), and the single-choice decodes stop at
the first that shows it.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from ..errors import CalibrationError
from ..segment import WIRE_NEG_INF
from .data import Item
from .measures import TokenRecord, choice_probability

__all__ = [
    "CHOICE_STYLES", "CONCURRENT", "Answerer", "HttpAnswerer", "LocalAnswerer", "Reply",
    "choice_fields", "masked",
]

#: Requests a server is sent at once.
CONCURRENT = 8


@dataclass
class Reply:
    """A model's reply to one item: its text, its answer tokens (the end-of-sequence
    token left out), and with choices each choice's summed logprob, or `masked` where
    the server reported the constrained answer's logprobs after the mask (see the
    module)."""

    output: str
    tokens: list[TokenRecord]
    choice_logprobs: dict[str, float] = field(default_factory=dict)
    masked: bool = False

    def field_prob(self) -> float | None:
        """The chosen choice's probability among the choices: a softmax over the choices'
        summed logprobs, or, from a server that masks, the product of the constrained
        answer's token probabilities; None without choices."""
        if self.masked:
            return math.exp(math.fsum(t.logprob for t in self.tokens)) if self.tokens else None
        return choice_probability(self.choice_logprobs, self.output)


def masked(tokens: Sequence[TokenRecord]) -> bool:
    """Whether a constrained reply's logprobs were taken after the constraint's mask: an
    alternative listed at minus infinity (see the module)."""
    return any(a <= WIRE_NEG_INF for t in tokens for a in t.top)


def _without_end(tokens: list[TokenRecord], ended_by_eos: bool) -> list[TokenRecord]:
    """The answer span: the end token dropped, unless it is all there is."""
    return tokens[:-1] if ended_by_eos and len(tokens) > 1 else tokens


class Answerer:
    """What answers items: `ask(item, choice)` gives the reply text and its answer
    tokens (under a choice constraint when `choice` is given)."""

    def ask(self, item: Item, choice: Sequence[str] | None) -> tuple[str, list[TokenRecord]]:
        raise NotImplementedError

    def answer(self, item: Item) -> Reply:
        """The reply to `item`; with choices, each choice's summed logprob too (or, from
        a server that masks, the constrained answer's alone: see the module)."""
        output, tokens = self.ask(item, item.choices)
        scores: dict[str, float] = {}
        if item.choices:
            if masked(tokens):
                return Reply(output, tokens, masked=True)
            for c in item.choices:
                got = self.ask(item, [c])[1]
                if masked(got):
                    return Reply(output, tokens, masked=True)
                scores[c] = math.fsum(t.logprob for t in got)
        return Reply(output, tokens, scores)

    def answer_many(self, items: Sequence[Item]) -> Iterator[tuple[Item, Reply]]:
        """Each item with its reply, as replies finish (here: one after another)."""
        for item in items:
            yield item, self.answer(item)

    def close(self) -> None:
        """Release what the answerer holds (nothing, unless it says otherwise)."""


class LocalAnswerer(Answerer):
    """Answers with `stream_generate` on a loaded model."""

    def __init__(self, model: Any, tokenizer: Any, max_tokens: int, top_logprobs: int) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.max_tokens, self.top_logprobs = max_tokens, top_logprobs

    def answer_many(self, items: Sequence[Item]) -> Iterator[tuple[Item, Reply]]:
        """Free-text items decoded together (`stream_batch_generate`: one batch, each
        reply yielded as its sequence ends), then the items with choices one by one
        (a constraint per request)."""
        from ..batch import stream_batch_generate

        free = [it for it in items if not it.choices]
        if free:
            prompts = [it.prompt if isinstance(it.prompt, str) else list(it.prompt)
                       for it in free]
            got: dict[int, list[Any]] = {i: [] for i in range(len(free))}
            for i, r in stream_batch_generate(
                self.model, self.tokenizer, prompts, self.max_tokens,
                top_logprobs=self.top_logprobs,
            ):
                got[i].append(r)
                if r.finish_reason is not None:
                    output, tokens = _records(got.pop(i))
                    yield free[i], Reply(output, tokens)
        for item in items:
            if item.choices:
                yield item, self.answer(item)

    def ask(self, item: Item, choice: Sequence[str] | None) -> tuple[str, list[TokenRecord]]:
        from ..generate import stream_generate

        prompt = item.prompt if isinstance(item.prompt, str) else list(item.prompt)
        responses = list(stream_generate(
            self.model, self.tokenizer, prompt, max_tokens=self.max_tokens,
            top_logprobs=self.top_logprobs, choice=choice,
        ))
        return _records(responses)


def _records(responses: list[Any]) -> tuple[str, list[TokenRecord]]:
    """The text and answer tokens of one sequence's `GenerationResponse`s."""
    tokens = [TokenRecord(r.token_logprob, tuple(a.logprob for a in r.top_logprobs))
              for r in responses]
    last = responses[-1] if responses else None
    eos = last is not None and last.finish_reason == "stop" and last.stop_string is None
    return "".join(r.text for r in responses), _without_end(tokens, eos)



#: How a server is asked to answer with one of the choices, tried in this order: vLLM's
#: ``structured_outputs`` (tokentrail's server takes it too), then llama-server's GBNF
#: ``grammar`` (the choices as literal alternatives). Each is the body's extra fields.
CHOICE_STYLES = ("structured_outputs", "grammar")
#: What the probe asks a server to write under a one-choice constraint: nothing a model
#: writes unasked, so an answer equal to it shows the constraint was applied.
PROBE = "Zq7 vortex"


def choice_fields(style: str, choices: Sequence[str]) -> dict[str, Any]:
    """The request fields that constrain a reply to `choices` in `style`."""
    from ..engines.upstream.constraints import llamacpp_fields, vllm_structured_outputs

    source = json.dumps(list(choices))
    if style == "structured_outputs":
        return {"structured_outputs": vllm_structured_outputs("choice", source)}
    return llamacpp_fields("choice", source, "choices")


class HttpAnswerer(Answerer):
    """Answers through an OpenAI-compatible server: chat completions for messages,
    completions for a prompt, `logprobs` with `top_logprobs`.

    Choices are constrained the way the server takes them (`CHOICE_STYLES`): before the
    first, a probe asks for `PROBE` under each style in turn and keeps the first the
    server obeys; a server that obeys none is a CalibrationError (a field it does not
    know is ignored by most servers, and its free answer would be scored as a choice).
    Every constrained answer is checked to be one of its choices too."""

    def __init__(
        self, url: str, model: str | None, max_tokens: int, top_logprobs: int,
        api_key: str | None = None, timeout: float = 300.0,
    ) -> None:
        import httpx

        self.base = url.rstrip("/")
        if not self.base.endswith("/v1"):
            self.base += "/v1"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(headers=headers, timeout=timeout)
        self.max_tokens, self.top_logprobs = max_tokens, top_logprobs
        self.model = model or self._first_model()
        self._style: str | None = None  # how this server takes choices, once probed
        self._probing = threading.Lock()
        self._token_literals = True  # until the server shows it has none (llama-server's)
        self._canonical: dict[str, list[int] | None] = {}  # each choice's canonical ids

    def _first_model(self) -> str:
        try:
            r = self.client.get(self.base + "/models")
            r.raise_for_status()
            return str(r.json()["data"][0]["id"])
        except Exception as e:
            raise CalibrationError(f"cannot list the models of {self.base}: {e}") from None

    def answer_many(self, items: Sequence[Item]) -> Iterator[tuple[Item, Reply]]:
        """Up to `CONCURRENT` requests in flight (the server batches them), each reply
        yielded as it comes back."""
        from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

        todo = iter(items)
        with ThreadPoolExecutor(CONCURRENT) as pool:
            running = {pool.submit(self.answer, it): it for it in islice(todo, CONCURRENT)}
            while running:
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    item = running.pop(future)
                    yield item, future.result()
                    for nxt in islice(todo, 1):
                        running[pool.submit(self.answer, nxt)] = nxt

    def ask(self, item: Item, choice: Sequence[str] | None) -> tuple[str, list[TokenRecord]]:
        if not choice:
            return self._post(item.prompt, {})[:2]
        style = self._choice_style(item.prompt)
        fields = choice_fields(style, choice)
        canonical = self._canonical_grammar(choice[0]) if (
            style == "grammar" and len(choice) == 1) else None
        try:
            text, tokens, finish = self._post(item.prompt, canonical or fields)
        except CalibrationError:
            if canonical is None:
                raise
            self._token_literals = False  # a llama-server older than GBNF's token literals
            text, tokens, finish = self._post(item.prompt, fields)
        cut = finish == "length" and any(c.startswith(text) for c in choice)
        if text not in choice and not cut:
            raise CalibrationError(
                f"{self.base} answered {item.id!r} with {text[:80]!r}, not one of its "
                f"choices, though asked with {style}"
            )
        return text, tokens

    def _canonical_grammar(self, choice: str) -> dict[str, Any] | None:
        """llama-server's fields that force `choice`'s canonical tokens: GBNF token
        literals (``<[id]>``, llama.cpp's grammars/README.md) of the ids its ``/tokenize``
        gives for the choice alone, the spelling tokentrail's own one-choice constraint
        forces. A grammar of the choice's characters lets greedy decoding spell it in
        any tokens ("Chopin" as C+hop+i+n at -30 where Ch+opin is -3.9), which scores
        one choice on another path than the rest. None where the server has no such
        endpoints or its ids do not read back as the choice (a tokenizer that adds a
        space before the first word): the characters' grammar is used then."""
        from ..engines.upstream.constraints import gbnf_tokens

        if not self._token_literals:
            return None
        with self._probing:
            if choice not in self._canonical:
                self._canonical[choice] = self._tokenize(choice)
            ids = self._canonical[choice]
        return {"grammar": gbnf_tokens(ids)} if ids else None

    def _tokenize(self, text: str) -> list[int] | None:
        """`text`'s token ids from llama-server's ``/tokenize`` (no special tokens added
        or parsed), if ``/detokenize`` reads them back as `text`; else None."""
        root = self.base.removesuffix("/v1")
        try:
            r = self.client.post(root + "/tokenize", json={
                "content": text, "add_special": False, "parse_special": False})
            r.raise_for_status()
            ids = [int(t) for t in r.json()["tokens"]]
            back = self.client.post(root + "/detokenize", json={"tokens": ids})
            back.raise_for_status()
        except Exception:  # not llama-server: no token literals to send either
            self._token_literals = False
            return None
        return ids if ids and back.json().get("content") == text else None

    def _choice_style(self, prompt: str | Sequence[Any]) -> str:
        """The first of `CHOICE_STYLES` the server obeys (probed once, on `prompt`)."""
        with self._probing:
            if self._style is None:
                for style in CHOICE_STYLES:
                    try:
                        text, _, _ = self._post(prompt, choice_fields(style, [PROBE]))
                    except CalibrationError:  # a server may refuse a field it does not know
                        continue
                    if text == PROBE:
                        self._style = style
                        break
                else:
                    raise CalibrationError(
                        f"{self.base} does not constrain an answer to given choices (asked "
                        f"with {' and '.join(CHOICE_STYLES)}): score choice questions "
                        "through tokentrail's server, vLLM or llama-server, or remove "
                        "their 'choices'"
                    )
            return self._style

    def _post(
        self, prompt: str | Sequence[Any], extra: dict[str, Any]
    ) -> tuple[str, list[TokenRecord], str | None]:
        """(text, answer tokens, finish reason) of one greedy request with `extra`."""
        chat = not isinstance(prompt, str)
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens,
                                "temperature": 0.0, **extra}
        if chat:
            body.update(messages=list(prompt), logprobs=True, top_logprobs=self.top_logprobs)
        else:
            body.update(prompt=prompt, logprobs=self.top_logprobs)
        path = "/chat/completions" if chat else "/completions"
        r = self.client.post(self.base + path, json=body)
        if r.status_code != 200:
            raise CalibrationError(f"{self.base}{path} answered {r.status_code}: {r.text[:300]}")
        c = r.json()["choices"][0]
        text, tokens = chat_reply(c) if chat else completion_reply(c)
        return text, tokens, c.get("finish_reason")

    def close(self) -> None:
        self.client.close()


def _is_end(entry_token: str, entry_bytes: Any, text: str) -> bool:
    """Whether a final logprobs entry is the end-of-sequence token: no bytes, or a
    special token's name that the text does not hold."""
    if entry_bytes == [] or entry_token == "":
        return True
    special = entry_token.startswith("<") and entry_token.endswith(">")
    return special and not text.endswith(entry_token)


def _wire_records(logprobs: Sequence[Any], tops: Sequence[Sequence[Any]]) -> list[TokenRecord]:
    """The answer tokens' records; a token sent without a logprob is a CalibrationError
    (an end token a server only stands in for may have none: it is left out first)."""
    if any(v is None for v in logprobs):
        raise CalibrationError("the server sent an answer token without its logprob")
    return [TokenRecord(float(v), tuple(float(a) for a in t if a is not None))
            for v, t in zip(logprobs, tops, strict=True)]


def chat_reply(c: dict[str, Any]) -> tuple[str, list[TokenRecord]]:
    text = (c.get("message") or {}).get("content") or ""
    content = (c.get("logprobs") or {}).get("content") or []
    eos = bool(content) and c.get("finish_reason") == "stop" and _is_end(
        content[-1].get("token", ""), content[-1].get("bytes"), text)
    kept = _without_end(list(content), eos)
    tops = [[a.get("logprob") for a in e.get("top_logprobs") or []] for e in kept]
    return text, _wire_records([e.get("logprob") for e in kept], tops)


def completion_reply(c: dict[str, Any]) -> tuple[str, list[TokenRecord]]:
    text = c.get("text") or ""
    lp = c.get("logprobs") or {}
    names = lp.get("tokens") or []
    values = lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or [None] * len(values)
    eos = bool(names) and c.get("finish_reason") == "stop" and _is_end(names[-1], None, text)
    rows = list(zip(values, tops, strict=False))
    kept = _without_end(rows, eos) if len(rows) == len(names) else rows
    return text, _wire_records([v for v, _ in kept], [list((t or {}).values()) for _, t in kept])
