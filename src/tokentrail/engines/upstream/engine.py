"""An engine that is another server: any OpenAI-compatible upstream, realigned exactly.

`UpstreamEngine` implements the `Engine` protocol on top of a running server (vLLM,
SGLang, llama.cpp's llama-server, mlx_lm.server, another tokentrail): `generate` sends
the prompt *ids* to the upstream's completions endpoint, asking in that server's own
dialect for what exact attribution needs, and turns each streamed token into a `Step`
with the realign parsers (`tokentrail.realign`). Everything above (alignment, stop
strings, the OpenAI API, the extension, the page) is tokentrail's own, so
``tokentrail serve --upstream URL`` serves the whole API in front of the upstream.

What each dialect is asked for:

- ``vllm``: ``/v1/completions`` with ``return_token_ids`` and
  ``return_tokens_as_token_ids`` (exact ids, alternatives as ``token_id:N``);
- ``llamacpp``: llama.cpp's ``/completion`` with ``return_tokens`` and ``n_probs``
  (``tokens`` and ``tokens_predicted`` in every frame: exact ids and counts);

For both, a request that wants no logprob (`SamplingParams.logprobs` False, no
``top_logprobs``) asks for the ids alone (no ``n_probs``; no ``logprobs``): the segments
stay exact, their logprobs and confidence are null.
- ``tokentrail``: ``/v1/completions``; the ``tokentrail`` extension carries the ids;
- ``mlx``: mlx_lm.server streams no logprobs and takes no token-id prompts, so the
  request is sent whole (``stream: false``, the prompt as text, which it re-tokenizes)
  and its tokens are streamed on once the response is complete;
- ``openai``: ``/v1/completions`` with ``logprobs`` (token strings, ``bytes:`` forms).

Lossy upstreams are never guessed: a token the wire did not identify (U+FFFD stand-in,
a frame llama.cpp folded) is still given a `Step` so the text stays exact, but with an
id that only spells its bytes, and `UpstreamStep.refused` says why; the server reports
it in the extension as refused. Errors, timeouts and disconnects raise `UpstreamError`
(with an HTTP status for the proxy to answer); closing the generator closes the
upstream stream, which cancels the upstream's generation.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ...errors import EngineError, UpstreamError  # noqa: F401  (EngineError: old home)
from ...sampling import SamplingParams
from ...vocab import Vocab
from ..base import Step
from ..batch import UPSTREAM_CAPACITY
from .stream import AsyncUpstreamBatch
from .wire import StepReader, UpstreamStep, status_error  # noqa: F401

log = logging.getLogger("tokentrail.upstream")

DIALECTS = ("auto", "vllm", "llamacpp", "openai", "tokentrail", "mlx")
#: Requests kept in flight to a vLLM upstream, which does not say its ``max_num_seqs``:
#: the default of vLLM's OpenAI server on GPUs (arg_utils; 128 on CPU, 1024 on H100-class
#: GPUs). Requests beyond its own figure wait in vLLM's queue, as they would sent directly.
VLLM_CAPACITY = 256


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class UpstreamEngine:
    """The `Engine` protocol over an OpenAI-compatible server at `url`.

    `tokenizer` is the upstream model's tokenizer (anything `load_vocab` reads: a
    tokenizer.json, a model folder, a GGUF, a tokenizer object). `dialect` "auto"
    asks the server what it is (`detect`). `eos_ids` are the end-of-sequence ids, used
    when an upstream ends the text without sending its end token.
    """

    name = "upstream"

    def __init__(
        self,
        url: str,
        tokenizer: Any,
        *,
        api_key: str | None = None,
        model: str | None = None,
        dialect: str = "auto",
        timeout: float = 60.0,
        eos_ids: Sequence[int] = (),
        decode: Any = None,
    ) -> None:
        import httpx

        from ...vocab import load_vocab

        if dialect not in DIALECTS:
            raise ValueError(f"unknown upstream dialect {dialect!r}; use one of {DIALECTS}")
        self.url = _base_url(url)
        self.tokenizer = tokenizer
        self.vocab: Vocab = load_vocab(tokenizer)
        self.vocab_size: int | None = self.vocab.size
        self.context_length: int | None = None
        self.eos_ids = tuple(eos_ids)
        self._decode = decode
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        # Connections are kept alive: a response read to its end leaves its connection
        # clean, and one cut short (a closed generator) is closed by httpx, never reused.
        self.client = httpx.Client(**self.client_options())
        self.model = model
        #: Streams the upstream runs at once (llama-server's slots, from /props), or
        #: None where it does not say; `capacity` is what the batch opens with.
        self.slots: int | None = None
        #: The batch the server opened (`open_batch`), for its `stream_stats`.
        self.batch: AsyncUpstreamBatch | None = None
        self.dialect = self.detect() if dialect == "auto" else dialect
        if self.dialect in ("llamacpp", "tokentrail"):
            self.slots = self._own_slots()
        if self.model is None:
            self.model = self._first_model()
        if self.dialect == "mlx":
            log.warning(
                "upstream %s is mlx_lm.server: its streams carry no logprobs and it takes no "
                "token-id prompts, so each request is sent whole with the prompt as text "
                "(re-tokenized upstream) and streamed on once complete",
                self.url,
            )
        log.info("upstream %s speaks the %s dialect", self.url, self.dialect)

    # -- discovery --

    def _get(self, path: str) -> Any:
        import httpx

        try:
            r = self.client.get(path)
        except httpx.HTTPError as e:
            raise UpstreamError(f"cannot reach the upstream {self.url}{path}: {e}") from e
        return r

    def detect(self) -> str:
        """Which dialect the upstream speaks, from what it says about itself."""
        r = self._get("/v1/models")
        owners: set[str] = set()
        if r.status_code == 200:
            try:
                data = r.json()
            except ValueError:
                data = {}
            for m in data.get("data") or []:
                if isinstance(m, Mapping):
                    owners.add(str(m.get("owned_by", "")))
                    meta = m.get("meta") or {}
                    if isinstance(meta, Mapping) and isinstance(meta.get("n_ctx"), int):
                        self.context_length = meta["n_ctx"]
                    if isinstance(m.get("max_model_len"), int):
                        self.context_length = m["max_model_len"]
        if "llamacpp" in owners:
            return "llamacpp"
        if "vllm" in owners:
            return "vllm"
        if "tokentrail" in owners:
            return "tokentrail"
        if r.headers.get("server", "").startswith("BaseHTTP"):
            return "mlx"  # mlx_lm.server runs on Python's http.server
        return "openai"

    def _first_model(self) -> str | None:
        r = self._get("/v1/models")
        try:
            data = r.json().get("data") or []
        except (ValueError, AttributeError):
            return None
        return str(data[0]["id"]) if data and isinstance(data[0], Mapping) else None

    def _own_slots(self) -> int | None:
        """The sequences the upstream says it runs at once: llama-server's
        ``total_slots`` (its /props), tokentrail's ``max_batch`` (its /health)."""
        path, key = (
            ("/props", "total_slots") if self.dialect == "llamacpp" else ("/health", "max_batch")
        )
        r = self._get(path)
        try:
            slots = r.json().get(key) if r.status_code == 200 else None
        except (ValueError, AttributeError):
            return None
        ok = isinstance(slots, int) and not isinstance(slots, bool) and slots >= 1
        return slots if ok else None

    @property
    def capacity(self) -> int:
        """Requests the proxy keeps in flight upstream: the upstream's own figure where it
        says (`slots`); for vLLM, which does not, `VLLM_CAPACITY` (its own queue holds what
        it cannot run yet); else `UPSTREAM_CAPACITY`."""
        if self.slots is not None:
            return self.slots
        return VLLM_CAPACITY if self.dialect == "vllm" else UPSTREAM_CAPACITY

    def client_options(self) -> dict[str, Any]:
        """What an httpx client talking to the upstream is opened with."""
        import httpx

        return {
            "base_url": self.url,
            "headers": self._headers,
            "timeout": httpx.Timeout(self.timeout, connect=10.0),
        }

    def peak_memory(self) -> float:
        return 0.0

    def open_batch(self, max_batch: int | None, **options: Any) -> AsyncUpstreamBatch:
        """Concurrent requests go upstream at once, read on one event loop
        (`AsyncUpstreamBatch`; the upstream batches them), so a slow stream holds up no
        other. `max_batch` None: the upstream's `capacity`."""
        self.batch = AsyncUpstreamBatch(self, max_batch)
        return self.batch

    def stream_stats(self) -> dict[str, Any] | None:
        """The open batch's `AsyncUpstreamBatch.stats` (None before one is open)."""
        return None if self.batch is None else self.batch.stats()

    def filler(self) -> int:
        """A token with no text (a special one, not EOS) to stand for a token the
        upstream counted but sent nothing of."""
        for i in sorted(self.vocab.hidden | self.vocab.special):
            if i not in self.eos_ids:
                return i
        raise UpstreamError("the upstream dropped a token and the vocabulary has no filler")

    def close(self) -> None:
        self.client.close()

    # -- requests --

    def request(
        self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None
    ) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) asking the upstream for `max_tokens` tokens after the prompt."""
        if params.constraint is not None or params.logprobs_mode != "raw":
            # Never silently unconstrained: the upstream's own fields ask for the same
            # (`upstream.constraints`), or a ConstraintError names the request field.
            from dataclasses import replace

            from .constraints import request_fields

            extra = request_fields(params.constraint, params.logprobs_mode, self.dialect)
            plain = replace(params, constraint=None, logprobs_mode="raw")
            path, body = self.request(prompt_ids, plain, max_tokens)
            return path, {**body, **extra}
        k = max(1, params.top_logprobs)
        # Token ids only where no logprob is wanted (`SamplingParams.logprobs`) and the
        # dialect sends ids without logprobs: top-k costs the upstream a sort of its
        # vocabulary per token, and both sides a larger frame.
        ids_only = not params.logprobs and params.top_logprobs == 0
        d = self.dialect
        if d == "llamacpp":
            body: dict[str, Any] = {
                "prompt": list(prompt_ids),
                "n_predict": -1 if max_tokens is None else max_tokens,
                "stream": True,
                "return_tokens": True,
                "cache_prompt": True,
                "temperature": params.temp,
                "top_p": params.top_p,
                "top_k": params.top_k,
                "min_p": params.min_p,
                "repeat_penalty": params.repetition_penalty or 1.0,
            }
            if not ids_only:
                body["n_probs"] = k
            if params.seed is not None:
                body["seed"] = params.seed
            if params.logit_bias:
                body["logit_bias"] = [[int(i), float(b)] for i, b in params.logit_bias.items()]
            return "/completion", body
        body = {
            "prompt": list(prompt_ids),
            "stream": True,
            "temperature": params.temp,
            "top_p": params.top_p,
        }
        if self.model is not None:
            body["model"] = self.model
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if params.seed is not None:
            body["seed"] = params.seed
        if params.logit_bias:
            body["logit_bias"] = {str(i): b for i, b in params.logit_bias.items()}
        if d == "mlx":
            body["prompt"] = self._prompt_text(prompt_ids)
            body["stream"] = False
            body["logprobs"] = True
            body["top_logprobs"] = k
            if params.top_k:
                body["top_k"] = params.top_k
            if params.min_p:
                body["min_p"] = params.min_p
            if params.repetition_penalty:
                body["repetition_penalty"] = params.repetition_penalty
            return "/v1/completions", body
        if not (ids_only and d == "vllm"):  # vLLM's token_ids need no logprobs
            body["logprobs"] = k
        body["stream_options"] = {"include_usage": True}
        if d in ("vllm", "tokentrail"):
            body["top_k"] = params.top_k if d == "tokentrail" else (params.top_k or -1)
            body["min_p"] = params.min_p
            if params.repetition_penalty:
                body["repetition_penalty"] = params.repetition_penalty
        if d == "vllm":
            body["return_token_ids"] = True
            body["return_tokens_as_token_ids"] = True
            body["skip_special_tokens"] = False
        return "/v1/completions", body

    def _prompt_text(self, prompt_ids: Sequence[int]) -> str:
        if self._decode is not None:
            return str(self._decode(list(prompt_ids)))
        return b"".join(self.vocab.pieces[i] or b"" for i in prompt_ids).decode("utf-8", "replace")

    # -- generation --

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None
    ) -> Iterator[Step]:
        """Yield one `UpstreamStep` per token the upstream generated (see the module)."""
        path, body = self.request(prompt_ids, params, max_tokens)
        return self._steps(path, body, StepReader(self, body, list(prompt_ids), max_tokens))

    def _steps(self, path: str, body: dict[str, Any], reader: StepReader) -> Iterator[Step]:
        import httpx

        try:
            with self.client.stream("POST", path, json=body) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise status_error(resp.status_code, resp.text, self.url + path)
                for data in resp.iter_bytes():
                    yield from reader.feed(data)
        except httpx.HTTPError as e:
            raise self.transport_error(e) from e
        yield from reader.finish()

    def transport_error(self, e: Exception) -> UpstreamError:
        """The `UpstreamError` for an httpx error talking to the upstream (504: timeout)."""
        import httpx

        if isinstance(e, httpx.TimeoutException):
            return UpstreamError(
                f"the upstream {self.url} did not answer within {self.timeout} s",
                504,
                "upstream_timeout",
            )
        return UpstreamError(f"the upstream {self.url} failed: {type(e).__name__}: {e}")
