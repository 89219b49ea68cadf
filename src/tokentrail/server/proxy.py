"""`tokentrail serve --upstream URL`: tokentrail's whole API in front of another server.

The proxy is tokentrail's own server (`tokentrail.server.app`: completions and chat,
streamed or not, the ``tokentrail`` extension, the page, its hardening) with an
`UpstreamEngine` (`tokentrail.engines.upstream.engine`) as the model: chat requests are
templated here with the upstream model's tokenizer, the prompt ids go upstream, and the
tokens that come back are aligned here. Tokens the upstream did not identify are listed
under ``refused`` in the extension's segments (never guessed); upstream errors, timeouts
and disconnects are answered as OpenAI-shaped errors (502/504, or the upstream's 4xx).

At startup the proxy runs a quick `tokentrail check` of the upstream (on a thread of its
own, so startup does not wait): it logs what the upstream cannot give or where it breaks
its own contract, and serves the report at ``GET /tokentrail/upstream``.

Its `serve` flags are defined (`add_arguments`) and checked (`check_arguments`) here;
`tokentrail.server.cli` adds them to its parser.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..engines.config import attach_eos_ids, config_eos_ids
from ..engines.upstream.engine import DIALECT_CHOICES, UpstreamEngine
from ..errors import UsageError
from ..prompting import eos_ids
from .app import create_app

log = logging.getLogger("tokentrail.proxy")


def load_tokenizer(path: str | Path) -> Any:
    """The upstream model's tokenizer: a model folder, a tokenizer.json (with its
    tokenizer_config.json beside it, if any) or a GGUF file (transformers' tokenizer
    for it, or where transformers cannot build one, llama.cpp's own: `_llama_cpp_tokenizer`)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"--tokenizer {p}: no such file or folder")
    if p.suffix == ".gguf":
        from ..vocab.gguf_file import gguf_eog_ids, gguf_transformers_tokenizer

        tok = gguf_transformers_tokenizer(p)
        if tok is None:
            tok = _llama_cpp_tokenizer(p)
        # Every id llama.cpp ends generation on, not only the file's EOS: llama-server
        # stops on each and streams it as its last token (SmolLM2's <|endoftext|> under
        # a grammar), which the proxy must take as the end, not as text.
        return attach_eos_ids(tok, gguf_eog_ids(p))
    if p.is_dir():
        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        return attach_eos_ids(tok, _folder_eos_ids(p))
    if (p.parent / "tokenizer_config.json").is_file():
        tok = AutoTokenizer.from_pretrained(str(p.parent), local_files_only=True)
        return attach_eos_ids(tok, _folder_eos_ids(p.parent))
    return PreTrainedTokenizerFast(tokenizer_file=str(p))


def _llama_cpp_tokenizer(p: Path) -> Any:
    """llama.cpp's own tokenizer for GGUF file `p` (its vocabulary alone, loaded by
    llama-cpp-python; `tokentrail.engines.llamacpp.engine.LlamaCppTokenizer`): what
    llama-server itself tokenizes with, chat template from the file's
    ``tokenizer.chat_template``. For the files transformers builds no tokenizer from
    (Gemma 4, Command R, MPT, GPT-NeoX, ... GGUFs)."""
    try:
        import llama_cpp

        from ..engines.llamacpp.engine import LlamaCppTokenizer
    except ImportError:
        raise ValueError(
            f"--tokenizer {p}: transformers cannot build a tokenizer from it, and llama.cpp's "
            "own needs llama-cpp-python (pip install 'tokentrail[llamacpp]'); or pass the "
            "model's Hugging Face tokenizer folder"
        ) from None
    try:
        llama = llama_cpp.Llama(model_path=str(p), vocab_only=True, verbose=False)
    except ValueError as e:
        raise ValueError(f"--tokenizer {p}: llama.cpp cannot read its vocabulary: {e}") from e
    tok = LlamaCppTokenizer(llama)
    # Closed when the tokenizer goes, or at exit while the interpreter still stands:
    # left to llama-cpp-python's own __del__ at shutdown, the close finds its modules
    # torn down and prints "Exception ignored ... TypeError" on every exit.
    weakref.finalize(tok, llama.close)
    return tok


def _ordered_eos(tok: Any) -> list[int]:
    """The tokenizer's end ids, its own ``eos_token_id`` first: the one that stands for
    an end token an upstream ends the text without sending."""
    own = getattr(tok, "eos_token_id", None)
    ids = sorted(eos_ids(tok))
    return [own, *(i for i in ids if i != own)] if own in ids else ids


def _folder_eos_ids(folder: Path) -> list[int]:
    """The ids the model ends on, from the generation config and model config beside the
    tokenizer (where the upstream's engine reads them: a model stops on each, not only on
    the tokenizer's ``eos_token``), so the proxy takes the upstream's end token as the end
    and does not add its own after it."""
    configs = []
    for name in ("generation_config.json", "config.json"):
        try:
            data = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            configs.append(SimpleNamespace(eos_token_id=data.get("eos_token_id")))
    return config_eos_ids(*configs)


def create_upstream_app(
    url: str,
    tokenizer: Any,
    *,
    upstream_api_key: str | None = None,
    upstream_model: str | None = None,
    dialect: str = "auto",
    timeout: float = 60.0,
    model_name: str | None = None,
    check_upstream: bool = True,
    upstream_chat: bool = False,
    **server_options: Any,
) -> Any:
    """The tokentrail ASGI app serving `url`'s model (see the module docstring).

    `tokenizer` is a path (`load_tokenizer`) or a loaded transformers tokenizer;
    `server_options` go to `tokentrail.server.create_app` (max_queue, max_body_bytes).
    `check_upstream` runs the quick startup check (`check_upstream_now`) on a thread.
    `upstream.chat`: chat requests go to the upstream's own chat endpoint, its parsers
    and channels passed through per token (`tokentrail.server.proxy_chat.UpstreamChat`,
    the app's chat runner: same body cap, checks, validation and queue as every request).
    """
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str | Path) else tokenizer
    engine = UpstreamEngine(
        url,
        tok,
        api_key=upstream_api_key,
        model=upstream_model,
        dialect=dialect,
        timeout=timeout,
        eos_ids=_ordered_eos(tok),
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
    )
    name = model_name or engine.model or "upstream"
    runner = None
    if upstream_chat:
        from .proxy_chat import UpstreamChat

        runner = UpstreamChat(engine, name)
    app = create_app(engine, tok, model_name=name, chat_runner=runner, **server_options)
    app.state.upstream = engine
    app.state.upstream_streams = engine.stream_stats
    if runner is not None:
        app.state.upstream_streams = lambda: {**(engine.stream_stats() or {}), **runner.stats()}
    app.state.upstream_check = {"status": "not run"}
    if check_upstream:
        app.state.upstream_check = {"status": "running"}
        threading.Thread(
            target=check_upstream_now, args=(app, engine, upstream_api_key, timeout), daemon=True,
            name="tokentrail-upstream-check",
        ).start()  # fmt: skip
    return app


def check_upstream_now(
    app: Any, engine: UpstreamEngine, api_key: str | None = None, timeout: float = 60.0
) -> None:
    """The quick `tokentrail check` of the upstream: what it cannot give is logged, the
    report is kept at ``app.state.upstream_check`` (served at ``/tokentrail/upstream``)."""
    from ..check import Checker

    try:
        checker = Checker(
            engine.url,
            model=engine.model,
            api_key=api_key,
            tokenizer=engine.vocab,
            timeout=min(timeout, 30.0),
            quick=True,
        )
        report = checker.run()
    except Exception as e:  # the check must never take the proxy down
        log.warning("upstream %s: the startup check failed: %s", engine.url, e)
        app.state.upstream_check = {"status": "failed", "error": str(e)}
        return
    for line in report.missing():
        log.warning("upstream %s: %s", engine.url, line)
    for name, r in report.realign.items():
        if not r.get("exact"):
            log.warning("upstream %s: realigning its %s stream: %s", engine.url, name, r["summary"])
    if report.ok:
        log.info("upstream %s keeps its contract (quick check)", engine.url)
    app.state.upstream_check = {"status": "done", **report.to_dict()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags of the proxy (added to tokentrail.server's parser)."""
    g = parser.add_argument_group("upstream proxy")
    g.add_argument("--upstream", metavar="URL", help="serve this OpenAI-compatible server's model")
    g.add_argument("--upstream-api-key", metavar="KEY", help="API key for the upstream")
    g.add_argument("--upstream-model", metavar="NAME", help="model name sent upstream")
    g.add_argument(
        "--upstream-dialect",
        default="auto",
        choices=DIALECT_CHOICES,
        help="how to ask the upstream for token data (default: ask it what it is)",
    )
    g.add_argument(
        "--upstream-timeout", type=float, default=60.0, metavar="S", help="seconds (default 60)"
    )
    g.add_argument("--tokenizer", metavar="PATH", help="the upstream model's tokenizer")
    g.add_argument(
        "--upstream-chat",
        action="store_true",
        help="send chat requests to the upstream's own chat endpoint (its reasoning and "
        "tool-call parsers, its template) and attribute its channels per token",
    )


def check_arguments(args: argparse.Namespace) -> None:
    """Check the proxy's flags (`serve --upstream URL --tokenizer PATH`); raise
    `tokentrail.errors.UsageError` saying what is wrong."""
    if not args.tokenizer:
        raise UsageError("--upstream needs --tokenizer PATH (the upstream model's tokenizer)")
    if not args.upstream.startswith(("http://", "https://")):
        raise UsageError(f"--upstream must be an http(s) URL, got {args.upstream!r}")
    if args.model is not None:
        raise UsageError("--model does not apply with --upstream (the upstream runs the model)")
    if args.upstream_timeout <= 0:
        raise UsageError(f"--upstream-timeout must be > 0, got {args.upstream_timeout}")
