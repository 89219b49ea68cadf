"""`load` and `stream_generate`: mlx-lm's streaming API, with every piece of text
carrying the exact tokens behind it, their logprobs, alternatives and a confidence.

The loop is engine-agnostic: an engine (see `tokentrail.engines`) yields one `Step`
per token; each step goes through the `Aligner` (text and token attribution), then the
`StopMatcher` (stop strings), and becomes one `GenerationResponse`.
"""

from __future__ import annotations

import logging
import math
import os
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .align import Aligner
from .engines import Engine, engine_for, load_model
from .loaders import load_vocab
from .sampling import SamplingParams, check_max_tokens, make_params
from .segment import Alternative, Confidence, Segment, TokenSpan, confidence_of
from .stops import StopMatcher, merge_spans
from .vocab import Vocab

log = logging.getLogger(__name__)

#: The built-in demo model shipped as package data.
DEMO_MODEL = Path(__file__).resolve().parent / "demo_model"

__all__ = ["DEMO_MODEL", "GenerationResponse", "load", "stream_generate"]


@dataclass(slots=True)
class GenerationResponse:
    """One generated token and the text that became final with it.

    The first ten fields mean what they mean in mlx-lm's `GenerationResponse`. The rest
    say where `text` came from: `last_segment_tokens` are the tokens (with the byte
    range of each that went into `text`) behind it, `confidence` aggregates their
    logprobs, `token_logprob` and `top_logprobs` describe this step's token, and, when a
    stop string ended generation, `stop_string` names it and `stop_tokens` are the
    tokens from its first byte to the end of what was generated.
    """

    text: str
    token: int
    logprobs: Any
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None
    last_segment_tokens: list[TokenSpan] = field(default_factory=list)
    confidence: Confidence | None = None
    token_logprob: float = 0.0
    top_logprobs: list[Alternative] = field(default_factory=list)
    stop_string: str | None = None
    stop_tokens: list[TokenSpan] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (no device arrays) for logs, scripts and HTTP."""
        return {
            "text": self.text,
            "token": self.token,
            "token_logprob": self.token_logprob,
            "top_logprobs": [a.to_dict() for a in self.top_logprobs],
            "last_segment_tokens": [t.to_dict() for t in self.last_segment_tokens],
            "confidence": None if self.confidence is None else self.confidence.to_dict(),
            "finish_reason": self.finish_reason,
            "stop_string": self.stop_string,
            "stop_tokens": [t.to_dict() for t in self.stop_tokens],
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "generation_tps": self.generation_tps,
        }


def load(
    path: str | os.PathLike[str] | None = None, *, engine: str = "mlx", **options: Any
) -> tuple[Any, Any]:
    """Load a model folder (Hugging Face layout) and its tokenizer with `engine`.

    `path=None` loads the built-in demo model. `engine` is "mlx" (default), "torch" or
    "vllm"; `options` go to that engine's loader (e.g. `device`, `dtype` for torch).
    Returns (model, tokenizer), ready for `stream_generate`.
    """
    if path is None:
        if not (DEMO_MODEL / "config.json").is_file():
            raise FileNotFoundError(
                f"the built-in demo model is missing from {DEMO_MODEL}; pass a model folder"
            )
        path = DEMO_MODEL
    model, tokenizer = load_model(path, engine=engine, **options)
    _vocab(tokenizer)  # compile the tokenizer now, not on the first generation
    return model, tokenizer


# -- tokenizer helpers (work with mlx-lm's TokenizerWrapper and transformers tokenizers) --

_VOCABS: weakref.WeakKeyDictionary[Any, Vocab] = weakref.WeakKeyDictionary()


def _vocab(tokenizer: Any) -> Vocab:
    """The tokenizer compiled for the aligner, cached per tokenizer object."""
    try:
        hit = _VOCABS.get(tokenizer)
    except TypeError:  # not weak-referenceable or not hashable
        return load_vocab(tokenizer)
    if hit is None:
        hit = load_vocab(tokenizer)
        _VOCABS[tokenizer] = hit
    return hit


def _eos_ids(tokenizer: Any) -> frozenset[int]:
    """End-of-sequence ids: mlx-lm's `eos_token_ids` (which merges the model config's),
    else a transformers tokenizer's own `eos_token_id`."""
    for name in ("eos_token_ids", "eos_token_id"):
        ids = getattr(tokenizer, name, None)
        if ids is None:
            continue
        if isinstance(ids, int):
            return frozenset((ids,))
        return frozenset(int(i) for i in ids)
    return frozenset()


def _check_ids(ids: Sequence[Any], vocab_size: int | None, what: str) -> list[int]:
    out = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            try:
                j = int(i)
            except (TypeError, ValueError):
                raise TypeError(f"{what} must be token ids (ints), got {i!r}") from None
            if j != i:
                raise TypeError(f"{what} must be token ids (ints), got {i!r}")
            i = j
        if i < 0 or (vocab_size is not None and i >= vocab_size):
            limit = "" if vocab_size is None else f" (valid ids are 0..{vocab_size - 1})"
            raise ValueError(f"{what} contains token id {i}, outside the vocabulary{limit}")
        out.append(i)
    return out


def _prompt_ids(tokenizer: Any, prompt: Any, vocab_size: int | None) -> list[int]:
    """Token ids for a str, a list of ids, an array of ids or a list of chat messages."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        ids = tokenizer.encode(prompt, add_special_tokens=add_special)
        return _check_ids(list(ids), vocab_size, "encoded prompt")
    if hasattr(prompt, "tolist") and not isinstance(prompt, list):
        prompt = prompt.tolist()  # mx.array / numpy array of ids
    if not isinstance(prompt, Sequence) or isinstance(prompt, bytes | bytearray):
        raise TypeError(
            "prompt must be a str, a list of token ids or a list of chat messages, "
            f"got {type(prompt).__name__}"
        )
    if len(prompt) == 0:
        raise ValueError("prompt is empty")
    if all(isinstance(m, Mapping) for m in prompt):
        return _chat_ids(tokenizer, prompt, vocab_size)
    return _check_ids(prompt, vocab_size, "prompt")


def _chat_ids(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], vocab_size: int | None
) -> list[int]:
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(
                f"prompt message {i} must have a 'role' (str) and 'content', got {dict(m)!r}"
            )
    has_template = getattr(tokenizer, "has_chat_template", None)
    if has_template is None:
        has_template = getattr(tokenizer, "chat_template", None) is not None
    if not has_template:
        raise ValueError(
            "prompt is a list of chat messages but the tokenizer has no chat template; "
            "pass the prompt as a str or token ids"
        )
    kwargs: dict[str, Any] = {"add_generation_prompt": True, "tokenize": True}
    if not type(tokenizer).__module__.startswith("mlx_lm"):
        kwargs["return_dict"] = False  # transformers 5 returns a BatchEncoding otherwise
    ids = tokenizer.apply_chat_template([dict(m) for m in messages], **kwargs)
    if isinstance(ids, Mapping):  # some tokenizers return a BatchEncoding regardless
        ids = ids["input_ids"]
    return _check_ids(list(ids), vocab_size, "chat template output")


def _confidence(spans: list[TokenSpan]) -> Confidence | None:
    """`confidence_of(spans)`, with a shortcut for the common one-token segment."""
    if len(spans) == 1:
        t = spans[0]
        lp = t.logprob
        if lp is not None and not t.top_logprobs:
            return Confidence(lp, lp, math.exp(-lp), math.exp(lp), None, 1)
    return confidence_of(spans) if spans else None


def _stops(stop: Any) -> StopMatcher | None:
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, Sequence):
        raise TypeError(f"stop must be a str or a list of str, got {type(stop).__name__}")
    if not stop:
        return None
    return StopMatcher(stop)


def stream_generate(
    model: Any,
    tokenizer: Any,
    prompt: str | Sequence[int] | Sequence[Mapping[str, Any]] | Any,
    *,
    max_tokens: int | None = 256,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float | None = None,
    seed: int | None = None,
    logit_bias: Mapping[int, float] | None = None,
    top_logprobs: int = 0,
    stop: str | Sequence[str] | None = None,
    skip_special_tokens: bool = True,
) -> Iterator[GenerationResponse]:
    """Generate from `prompt`, one `GenerationResponse` per token; the last has
    `finish_reason` "stop" (EOS or a stop string) or "length".

    `prompt` is text, token ids, or chat messages (rendered with the tokenizer's chat
    template and a generation prompt). `max_tokens=None` (or -1) generates until EOS or
    the model's context is full. `top_logprobs` (0..20) alternatives are reported per
    token. Every argument is checked here, before any model work, so a bad value
    raises at the call; generation itself starts on the first `next()`. Closing the
    iterator (or breaking out of the loop) stops generation.
    """
    engine = engine_for(model)
    limit = check_max_tokens(max_tokens)
    params = make_params(
        temp=temp, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty, logit_bias=logit_bias, seed=seed,
        top_logprobs=top_logprobs, vocab_size=engine.vocab_size,
    )
    ids = _prompt_ids(tokenizer, prompt, engine.vocab_size)
    ctx = engine.context_length
    if ctx is not None:
        room = ctx - len(ids)
        if room < 1:
            raise ValueError(
                f"prompt is {len(ids)} tokens, which leaves no room in the model's context of "
                f"{ctx} tokens (max_position_embeddings)"
            )
        if limit is None or limit > room:
            limit = room
    matcher = _stops(stop)
    aligner = Aligner(_vocab(tokenizer), skip_special_tokens=skip_special_tokens)
    return _generate(engine, aligner, matcher, _eos_ids(tokenizer), ids, params, limit)


def _generate(
    engine: Engine,
    aligner: Aligner,
    matcher: StopMatcher | None,
    eos: frozenset[int],
    prompt_ids: list[int],
    params: SamplingParams,
    limit: int | None,
) -> Iterator[GenerationResponse]:
    n_prompt = len(prompt_ids)
    vocab = aligner.vocab

    # Models often pad their embeddings past the tokenizer's last id; such ids have no
    # text, so they are left out of the alternatives (a sampled one is an error).
    padded = engine.vocab_size is not None and engine.vocab_size > vocab.size
    pieces = vocab.pieces

    steps = engine.generate(prompt_ids, params, limit)
    tic = time.perf_counter()
    prompt_tps = 0.0
    try:
        for n, step in enumerate(steps):
            if n == 0:
                now = time.perf_counter()
                prompt_tps = n_prompt / max(now - tic, 1e-9)
                tic = now
            token = step.token
            pairs = step.top_logprobs
            if padded and pairs:
                pairs = [p for p in pairs if p[0] < vocab.size and pieces[p[0]] is not None]
            is_eos = token in eos
            last = is_eos or (limit is not None and n + 1 >= limit)
            eos_span = None
            if is_eos:
                # EOS ends the text: it adds no characters but is still reported.
                segs = aligner.finish()
                top = aligner.alternatives(pairs) if pairs else None
                eos_span = TokenSpan(n, token, 0, 0, step.logprob, top)
            else:
                segs = aligner.push(token, step.logprob, pairs or None)
                if last:
                    segs += aligner.finish()

            stop_string = None
            stop_tokens: list[TokenSpan] = []
            if matcher is not None:
                segs, match = matcher.feed(segs)
                if match is not None:
                    stop_string = match.stop
                    rest = [] if last else aligner.finish()
                    stop_tokens = merge_spans([Segment("", match.tokens), *rest])
                    if eos_span is not None:
                        stop_tokens.append(eos_span)
                        eos_span = None
                    last = True
                elif last:
                    segs += matcher.flush()

            if len(segs) == 1:
                text = segs[0].text
                spans = list(segs[0].tokens)
            else:
                text = "".join(s.text for s in segs)
                spans = merge_spans(segs)
            if eos_span is not None:
                spans.append(eos_span)

            if not pairs:
                top_list: list[Alternative] = []
            elif spans and spans[-1].index == n and spans[-1].top_logprobs is not None:
                top_list = list(spans[-1].top_logprobs)
            else:
                top_list = list(aligner.alternatives(pairs))

            finish = None
            if last:
                finish = "stop" if (is_eos or stop_string is not None) else "length"
            yield GenerationResponse(
                text=text,
                token=token,
                logprobs=step.logprobs,
                from_draft=False,
                prompt_tokens=n_prompt,
                prompt_tps=prompt_tps,
                generation_tokens=n + 1,
                generation_tps=(n + 1) / max(time.perf_counter() - tic, 1e-9),
                peak_memory=engine.peak_memory(),
                finish_reason=finish,
                last_segment_tokens=spans,
                confidence=_confidence(spans),
                token_logprob=step.logprob,
                top_logprobs=top_list,
                stop_string=stop_string,
                stop_tokens=stop_tokens,
            )
            if last:
                return
        raise RuntimeError(
            f"the {engine.name} engine stopped before EOS or the token limit; engines must "
            "yield a step for every token up to max_tokens"
        )
    finally:
        close = getattr(steps, "close", None)
        if close is not None:
            close()
