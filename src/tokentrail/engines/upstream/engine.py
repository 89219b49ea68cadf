"""An engine that is another server: any OpenAI-compatible upstream, realigned exactly.

`UpstreamEngine` implements the `Engine` protocol on top of a running server (vLLM,
SGLang, llama.cpp's llama-server, mlx_lm.server, another tokentrail): `generate` sends
the prompt *ids* to the upstream's completions endpoint, asking in that server's own
dialect for what exact attribution needs, and turns each streamed token into a `Step`
with the realign parsers (`tokentrail.realign`). Everything above (alignment, stop
strings, the OpenAI API, the extension, the page) is tokentrail's own, so
``tokentrail serve --upstream URL`` serves the whole API in front of the upstream.

What each dialect is asked for (one class per dialect in
`tokentrail.engines.upstream.dialects`, shared with ``tokentrail check``):

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
from .dialects import DIALECTS, CompletionAsk, UpstreamDialect, dialect_named, pick_dialect
from .stream import AsyncUpstreamBatch
from .wire import StepReader, UpstreamStep, status_error  # noqa: F401

log = logging.getLogger("tokentrail.upstream")

#: The ``--upstream-dialect`` choices: "auto" (`UpstreamEngine.detect`), then every
#: dialect's name (`tokentrail.engines.upstream.dialects.DIALECTS`).
DIALECT_CHOICES = ("auto", *DIALECTS)


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class UpstreamEngine:
    """The `Engine` protocol over an OpenAI-compatible server at `url`.

    `tokenizer` is the upstream model's tokenizer (anything `load_vocab` reads: a
    tokenizer.json, a model folder, a GGUF, a tokenizer object). `dialect` is one of
    `DIALECT_CHOICES` or an `UpstreamDialect`; "auto" asks the server what it is
    (`detect`). `dialect_spec` is then the dialect object, `dialect` its name.
    `eos_ids` are the end-of-sequence ids, used when an upstream ends the text without
    sending its end token.
    """

    name = "upstream"
    #: Its batch's sequences are HTTP streams, not compute: the server runs them, and
    #: its scheduler's passes, on its own event loop (`tokentrail.server.on_loop`).
    batch_on_loop = True

    def __init__(
        self,
        url: str,
        tokenizer: Any,
        *,
        api_key: str | None = None,
        model: str | None = None,
        dialect: str | UpstreamDialect = "auto",
        timeout: float = 60.0,
        eos_ids: Sequence[int] = (),
        decode: Any = None,
    ) -> None:
        import httpx

        from ...vocab import load_vocab

        if not isinstance(dialect, UpstreamDialect) and dialect not in DIALECT_CHOICES:
            raise ValueError(f"unknown upstream dialect {dialect!r}; use one of {DIALECT_CHOICES}")
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
        #: The upstream's dialect (`tokentrail.engines.upstream.dialects`).
        self.dialect_spec: UpstreamDialect = (
            dialect_named(self.detect()) if dialect == "auto" else dialect_named(dialect)
        )
        #: Its name (``--upstream-dialect``).
        self.dialect: str = self.dialect_spec.name
        if self.dialect_spec.slots_probe is not None:
            self.slots = self._own_slots()
        if self.model is None:
            self.model = self._first_model()
        if self.dialect_spec.startup_warning:
            log.warning("upstream %s %s", self.url, self.dialect_spec.startup_warning)
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
        """The name of the dialect the upstream speaks, from what it says about itself
        (`pick_dialect`: its /v1/models and Server header, as ``tokentrail check``
        reads them); notes its context length where /v1/models says it."""
        r = self._get("/v1/models")
        models: Any = None
        if r.status_code == 200:
            try:
                models = r.json()
            except ValueError:
                models = None
        data = models.get("data") if isinstance(models, Mapping) else None
        for m in data if isinstance(data, list) else ():
            if isinstance(m, Mapping):
                meta = m.get("meta") or {}
                if isinstance(meta, Mapping) and isinstance(meta.get("n_ctx"), int):
                    self.context_length = meta["n_ctx"]
                if isinstance(m.get("max_model_len"), int):
                    self.context_length = m["max_model_len"]
        return pick_dialect(models, r.headers.get("server", "")).name

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
        probe = self.dialect_spec.slots_probe
        if probe is None:
            return None
        path, key = probe
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
        says (`slots`); else its dialect's ``default_capacity`` (for vLLM, which does not
        say, ``VLLM_CAPACITY``: its own queue holds what it cannot run yet)."""
        if self.slots is not None:
            return self.slots
        return self.dialect_spec.default_capacity

    @property
    def request_headers(self) -> dict[str, str]:
        """The headers every request to the upstream carries (its API key, if any)."""
        return dict(self._headers)

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
        """(path, JSON body) asking the upstream for `max_tokens` tokens after the prompt,
        in its dialect (`UpstreamDialect.completion_request`); a `ConstraintError` names
        the request field the upstream cannot be asked for."""
        ask = CompletionAsk(prompt_ids, params, max_tokens, self.model, self._prompt_text,
                            self.canonical_ids)  # fmt: skip
        return self.dialect_spec.completion_request(ask)

    def distribution(self, params: SamplingParams) -> str | None:
        """What the upstream's logprobs for a request of `params` come from: its
        dialect's `constrained_distribution` under a constraint ("masked" for vLLM),
        else "raw"; None where the upstream's frames say it (another tokentrail)."""
        spec = self.dialect_spec
        if spec.says_distribution:
            return None
        return spec.constrained_distribution if params.constraint is not None else "raw"

    def canonical_ids(self, text: str) -> list[int] | None:
        """`text` in the tokenizer's own tokens (encoded alone, no special tokens
        added), where they spell exactly its bytes and none is a special token; else
        None (a tokenizer that adds a space before the first word, a tokenizer given
        as a path)."""
        encode = getattr(self.tokenizer, "encode", None)
        if not callable(encode) or not text:
            return None
        try:
            ids = [int(i) for i in encode(text, add_special_tokens=False)]
        except Exception:  # a tokenizer that takes no such keyword: no canonical ids
            return None
        pieces, special = self.vocab.pieces, self.vocab.special
        if not ids or any(not 0 <= i < len(pieces) or i in special for i in ids):
            return None
        spelled = b"".join(pieces[i] or b"" for i in ids)
        return ids if spelled == text.encode("utf-8") else None

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
        reader = StepReader(self, body, list(prompt_ids), max_tokens, self.distribution(params))
        return self._steps(path, body, reader)

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
        """The `UpstreamError` for a transport error talking to the upstream (httpx's or
        aiohttp's; 504: a timeout)."""
        import httpx

        if isinstance(e, httpx.TimeoutException | TimeoutError):
            return UpstreamError(
                f"the upstream {self.url} did not answer within {self.timeout} s",
                504,
                "upstream_timeout",
            )
        return UpstreamError(f"the upstream {self.url} failed: {type(e).__name__}: {e}")
