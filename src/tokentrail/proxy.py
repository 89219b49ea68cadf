"""`tokentrail serve --upstream URL`: tokentrail's whole API in front of another server.

The proxy is tokentrail's own server (`tokentrail.server`: completions and chat,
streamed or not, the ``tokentrail`` extension, the page, its hardening) with an
`UpstreamEngine` (`tokentrail.engines.upstream`) as the model: chat requests are
templated here with the upstream model's tokenizer, the prompt ids go upstream, and the
tokens that come back are aligned here. Tokens the upstream did not identify are listed
under ``refused`` in the extension's segments (never guessed); upstream errors, timeouts
and disconnects are answered as OpenAI-shaped errors (502/504, or the upstream's 4xx).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .engines.base import Step
from .engines.upstream import UpstreamEngine, UpstreamError, UpstreamStep
from .generate import GenerationResponse, stream_generate
from .sampling import SamplingParams

log = logging.getLogger("tokentrail.proxy")


@dataclass(slots=True)
class UpstreamResponse(GenerationResponse):
    """A `GenerationResponse` with `refused`: the tokens behind its text (or its stop
    tokens) that the upstream did not identify, as ``{"index", "id", "reason"}``."""

    refused: list[dict[str, Any]] = field(default_factory=list)


class _Call:
    """One request's view of the engine: remembers which steps were stand-ins."""

    def __init__(self, engine: UpstreamEngine) -> None:
        self.engine = engine
        self.name = engine.name
        self.vocab_size = engine.vocab_size
        self.context_length = engine.context_length
        self.refused: dict[int, str] = {}

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int | None
    ) -> Iterator[Step]:
        steps = self.engine.generate(prompt_ids, params, max_tokens)
        try:
            for n, step in enumerate(steps):
                if isinstance(step, UpstreamStep) and step.refused is not None:
                    self.refused[n] = step.refused
                yield step
        finally:
            steps.close()  # type: ignore[attr-defined]

    def peak_memory(self) -> float:
        return 0.0


def _api_error(e: UpstreamError) -> Exception:
    from .server import APIError

    kind = "invalid_request_error" if 400 <= e.status < 500 else "upstream_error"
    return APIError(e.status, str(e), type=kind, code=e.code)


def upstream_generate(
    model: UpstreamEngine, tokenizer: Any, prompt: Any, **kwargs: Any
) -> Iterator[UpstreamResponse]:
    """`stream_generate` over an `UpstreamEngine`, adding each response's refusals."""
    call = _Call(model)
    names = [f.name for f in fields(GenerationResponse)]
    try:
        for resp in stream_generate(call, tokenizer, prompt, **kwargs):
            spans = [*resp.last_segment_tokens, *resp.stop_tokens]
            refused = [
                {"index": t.index, "id": t.id, "reason": call.refused[t.index]}
                for t in spans
                if t.index in call.refused
            ]
            yield UpstreamResponse(**{k: getattr(resp, k) for k in names}, refused=refused)
    except UpstreamError as e:
        raise _api_error(e) from e


def load_tokenizer(path: str | Path) -> Any:
    """The upstream model's tokenizer (transformers): a model folder, a tokenizer.json
    (with its tokenizer_config.json beside it, if any) or a GGUF file."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"--tokenizer {p}: no such file or folder")
    if p.suffix == ".gguf":
        from .formats import _gguf_transformers

        tok = _gguf_transformers(p)
        if tok is None:
            raise ValueError(f"--tokenizer {p}: transformers cannot build a tokenizer from it")
        return tok
    if p.is_dir():
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    if (p.parent / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(p.parent), local_files_only=True)
    return PreTrainedTokenizerFast(tokenizer_file=str(p))


def _eos_ids(tokenizer: Any) -> list[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if isinstance(ids, int):
        return [ids]
    if ids:
        return sorted(int(i) for i in ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    return [] if eos is None else [int(eos)]


def create_upstream_app(
    url: str,
    tokenizer: Any,
    *,
    api_key: str | None = None,
    upstream_model: str | None = None,
    dialect: str = "auto",
    timeout: float = 60.0,
    model_name: str | None = None,
    **server_options: Any,
) -> Any:
    """The tokentrail ASGI app serving `url`'s model (see the module docstring).

    `tokenizer` is a path (`load_tokenizer`) or a loaded transformers tokenizer;
    `server_options` go to `tokentrail.server.create_app` (max_queue, max_body_bytes).
    """
    from .server import create_app

    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str | Path) else tokenizer
    engine = UpstreamEngine(
        url,
        tok,
        api_key=api_key,
        model=upstream_model,
        dialect=dialect,
        timeout=timeout,
        eos_ids=_eos_ids(tok),
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
    )
    name = model_name or engine.model or "upstream"
    app = create_app(engine, tok, model_name=name, **server_options)
    app.state.engine._generate_fn = upstream_generate
    app.state.upstream = engine
    return app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags of the proxy (added to tokentrail.server's parser)."""
    g = parser.add_argument_group("upstream proxy")
    g.add_argument("--upstream", metavar="URL", help="serve this OpenAI-compatible server's model")
    g.add_argument("--upstream-api-key", metavar="KEY", help="API key for the upstream")
    g.add_argument("--upstream-model", metavar="NAME", help="model name sent upstream")
    g.add_argument(
        "--upstream-dialect",
        default="auto",
        choices=["auto", "vllm", "llamacpp", "openai", "tokentrail", "mlx"],
        help="how to ask the upstream for token data (default: ask it what it is)",
    )
    g.add_argument(
        "--upstream-timeout", type=float, default=60.0, metavar="S", help="seconds (default 60)"
    )
    g.add_argument("--tokenizer", metavar="PATH", help="the upstream model's tokenizer")


def run(args: argparse.Namespace) -> int:
    """`tokentrail serve --upstream URL --tokenizer PATH`; return the exit status."""
    import uvicorn

    def fail(message: str) -> int:
        sys.stderr.write(f"tokentrail serve: error: {' '.join(message.split())}\n")
        return 2

    if not args.tokenizer:
        return fail("--upstream needs --tokenizer PATH (the upstream model's tokenizer)")
    if not args.upstream.startswith(("http://", "https://")):
        return fail(f"--upstream must be an http(s) URL, got {args.upstream!r}")
    try:
        app = create_upstream_app(
            args.upstream,
            args.tokenizer,
            api_key=args.upstream_api_key,
            upstream_model=args.upstream_model,
            dialect=args.upstream_dialect,
            timeout=args.upstream_timeout,
            model_name=args.model_name,
            max_queue=args.max_queue,
            max_body_bytes=args.max_body_bytes,
        )
    except UpstreamError as e:
        return fail(str(e))
    except (OSError, ValueError, ImportError) as e:
        return fail(f"cannot load the tokenizer: {e}")
    upstream = app.state.upstream
    log.info(
        "serving %s (%s, %s dialect) on http://%s:%d",
        app.state.engine.model_name,
        upstream.url,
        upstream.dialect,
        args.host,
        args.port,
    )
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    return 0
