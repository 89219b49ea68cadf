"""`tokentrail serve`: the parser, the engine choice and startup.

Startup order: check the flags (exit 2 with one line), bind the socket (a port in use
is exit 2, nothing logged as served), load the model, start uvicorn on that socket, and
only then log the real URL (the real port too, with ``--port 0``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from typing import Any

from ..errors import UsageError
from ..sampling import OPENAI_LIMITS, SamplingError, check_value
from ..usage import fail
from .config import (
    DEFAULT_CLIENT_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PROXY_MAX_QUEUE,
    Loader,
    ServerConfig,
)

logger = logging.getLogger("tokentrail.server")

#: Seconds a client has to send a whole request (headers and body) once it starts one.
DEFAULT_READ_TIMEOUT = 10.0
#: Seconds an idle keep-alive connection stays open.
DEFAULT_KEEP_ALIVE = 5.0
DEFAULT_MAX_CONNECTIONS = 256
#: Kernel send buffer per connection (Linux doubles it): the output a client that stops
#: reading can hold before the server notices and its --client-timeout clock runs.
SEND_BUFFER_BYTES = 128 * 1024

#: Engine name -> the loader keywords (flag names with "_") it takes.
ENGINE_OPTIONS: dict[str, tuple[str, ...]] = {
    "mlx": (),
    "torch": ("device", "dtype"),
    "vllm": (
        "dtype",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "gpu_memory_utilization",
        "max_model_len",
    ),
    "llamacpp": ("n_ctx", "n_threads", "n_gpu_layers"),
}
_ALL_OPTIONS = tuple(dict.fromkeys(k for keys in ENGINE_OPTIONS.values() for k in keys))

#: The numeric limit flags: (flag, type, default, metavar, help, least value, whether the
#: least value itself is refused). `_add_arguments` adds them and `_check` enforces them.
LIMIT_FLAGS: tuple[tuple[str, type, Any, str, str, float, bool], ...] = (
    ("--max-batch", int, None, "N",
     "sequences decoded together (default: the engine's capacity, e.g. mlx-lm's "
     "BatchGenerator's 32; 1 for an engine without batched decoding)", 1, False),
    ("--max-queue", int, None, "N",
     f"sequences that may wait for room in the batch; more get 429 (default "
     f"{DEFAULT_MAX_QUEUE}; {DEFAULT_PROXY_MAX_QUEUE} with --upstream, whose own queue holds "
     "what its slots cannot run yet)", 0, False),
    ("--client-timeout", float, DEFAULT_CLIENT_TIMEOUT, "S",
     "drop a streaming client that leaves output unread this long", 0, True),
    ("--max-body-bytes", int, DEFAULT_MAX_BODY_BYTES, "N", "largest accepted request body", 1,
     False),
    ("--max-connections", int, DEFAULT_MAX_CONNECTIONS, "N",
     "concurrent connections and requests; more get 503", 1, False),
    ("--read-timeout", float, DEFAULT_READ_TIMEOUT, "S",
     "seconds a client has to send a whole request, headers and body", 0, True),
    ("--keep-alive-timeout", float, DEFAULT_KEEP_ALIVE, "S",
     "seconds an idle connection stays open", 0, True),
)


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0..65535 (0: any free port), got {port}")
    return port


def _add_structure_arguments(parser: argparse.ArgumentParser) -> None:
    from ..structure.reasoning import REASONING_PARSERS
    from ..structure.tools import TOOL_PARSERS

    add = parser.add_argument
    add("--calibration", default=None, metavar="FILE",
        help="a map from `tokentrail calibrate --fit`: adds confidence.calibrated and makes "
        "level follow it (refused for another model)")
    add("--tool-call-parser", default=None, metavar="NAME", choices=sorted(TOOL_PARSERS),
        help="parse tool calls in this format (default: detected from the chat template; "
        f"{', '.join(sorted(TOOL_PARSERS))})")
    add("--reasoning-parser", default=None, metavar="NAME", choices=sorted(REASONING_PARSERS),
        help="split chat replies into reasoning and content with a named format "
        f"({', '.join(sorted(REASONING_PARSERS))})")
    add("--reasoning-markers", nargs=2, default=None, metavar=("START", "END"),
        help="split chat replies at these markers (START may be '': the reasoning then "
        "starts with the reply)")


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default=None, metavar="PATH",
        help="model folder in Hugging Face layout (default: the built-in demo model)")
    add("--host", default="127.0.0.1", help="address to listen on")
    add("--port", type=_port, default=8080, help="port to listen on (0: any free port)")
    for flag, kind, default, metavar, text, _, _ in LIMIT_FLAGS:
        shown = "" if default is None else f" (default {default:g})"
        add(flag, type=kind, default=default, metavar=metavar, help=text + shown)
    add("--prompt-cache-bytes", type=int, default=None, metavar="N",
        help="memory bound of the prompt cache shared across requests, for engines that "
        "have one (default: the engine's)")
    add("--temp", type=float, default=0.0, metavar="T",
        help="temperature for requests that do not set one (default 0.0, as mlx_lm.server)")
    add("--api-key", default=os.environ.get("TOKENTRAIL_API_KEY") or None, metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/* and /metrics "
        "(default: $TOKENTRAIL_API_KEY; none)")
    add("--allowed-host", action="append", default=[], metavar="NAME",
        help="a Host name to serve besides the address, localhost and IP literals "
        "(repeatable; '*' allows any)")
    add("--model-name", default=None,
        help="id the model is served under (default: the folder name, or tokentrail-demo)")
    add("--engine", default="mlx", choices=list(ENGINE_OPTIONS),
        help="model runtime (default mlx; torch runs transformers, vllm a vLLM deployment, "
        "llamacpp a .gguf file on llama.cpp)")
    add("--device", help="torch engine: cuda, mps or cpu (default: best)")
    add("--dtype", help="torch/vllm engines: float32, bfloat16, float16, auto")
    add("--tensor-parallel-size", type=int, metavar="N", help="vllm engine")
    add("--pipeline-parallel-size", type=int, metavar="N", help="vllm engine")
    add("--gpu-memory-utilization", type=float, metavar="F", help="vllm engine")
    add("--max-model-len", type=int, metavar="N", help="vllm engine")
    add("--n-ctx", type=int, metavar="N", help="llamacpp engine: context length")
    add("--n-threads", type=int, metavar="N", help="llamacpp engine: CPU threads")
    add("--n-gpu-layers", type=int, metavar="N", help="llamacpp engine: layers to offload")
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    _add_structure_arguments(parser)
    from .proxy import add_arguments as add_upstream_arguments

    add_upstream_arguments(parser)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to a `tokentrail` argparse subparsers object."""
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API with segment confidence",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics) with per-segment token "
        "attribution, and a live confidence page at /.",
    )
    _add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def model_loader(args: argparse.Namespace) -> Loader:
    """What loads the model for these flags: a function returning (model, tokenizer).

    Raises UsageError for a flag the chosen engine does not take. A new kind of engine
    adds its loader keywords to `ENGINE_OPTIONS` and, if it is not loaded through
    `tokentrail.load`, a branch here.
    """
    from .. import generate

    options = engine_options(args)
    return lambda: generate.load(args.model, engine=args.engine, **options)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The chosen engine's loader keywords from the flags; UsageError for a flag that
    engine does not take."""
    allowed = ENGINE_OPTIONS[args.engine]
    options: dict[str, Any] = {}
    for key in _ALL_OPTIONS:
        value = getattr(args, key, None)
        if value is None:
            continue
        if key not in allowed:
            flag = "--" + key.replace("_", "-")
            raise UsageError(f"{flag} does not apply to --engine {args.engine}")
        options[key] = value
    return options


def _check(args: argparse.Namespace) -> None:
    for flag, _, _, _, _, least, strict in LIMIT_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None:  # left to the engine
            continue
        if value < least or (strict and value == least):
            raise UsageError(f"{flag} must be {'>' if strict else '>='} {least:g}, got {value}")
    if args.prompt_cache_bytes is not None and args.prompt_cache_bytes < 0:
        raise UsageError(f"--prompt-cache-bytes must be >= 0, got {args.prompt_cache_bytes}")
    try:  # the same range a request's temperature has (sampling.OPENAI_LIMITS)
        check_value("temp", args.temp, OPENAI_LIMITS, label="--temp")
    except SamplingError as e:
        raise UsageError(str(e)) from None
    if args.reasoning_parser is not None and args.reasoning_markers is not None:
        raise UsageError("give --reasoning-parser or --reasoning-markers, not both")


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not listening yet), or UsageError saying why not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"cannot listen on {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _QuietAbandon(logging.Filter):
    """uvicorn reports a response the app gave up on (a client that stopped reading)
    as an error; the app has already logged it at info."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "ASGI callable returned without completing response."


def _protocol_class(read_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol, closing a connection that does not send a whole request
    within `read_timeout` seconds (uvicorn itself only times out idle keep-alives)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class ReadTimeoutProtocol(H11Protocol):
        _read_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None:  # bound what the kernel holds for a client that does not read
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            self._arm()

        def _arm(self) -> None:
            self._read_timer = self.loop.call_later(read_timeout, self._expired)

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            if self._read_timer is None and (cycle is None or cycle.response_complete):
                self._arm()  # a new request begins
            super().data_received(data)

        def _expired(self) -> None:
            self._read_timer = None
            cycle = self.cycle
            if cycle is not None and not cycle.more_body and not cycle.response_complete:
                return  # the whole request arrived and is being answered
            if not self.transport.is_closing():
                logger.debug("closing a connection that sent no whole request in time")
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None
            super().connection_lost(exc)

    return ReadTimeoutProtocol


def _missing_extra() -> str | None:
    """The server extra's first missing module, or None when it is installed."""
    try:
        import prometheus_client  # noqa: F401
        import pydantic  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ModuleNotFoundError as e:
        return e.name or "uvicorn"
    return None


def _log_at(level_name: str) -> None:
    level = level_name.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("tokentrail").setLevel(level)  # also under `tokentrail -v serve`


def run(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted; return the exit status."""
    missing = _missing_extra()
    if missing is not None:
        return fail(f"needs {missing}: pip install 'tokentrail[server]'", "tokentrail serve")
    from .app import create_app

    _log_at(args.log_level)
    try:
        _check(args)
        loader = None if args.upstream else model_loader(args)
        if args.upstream:
            from .proxy import check_arguments as check_upstream_arguments

            check_upstream_arguments(args)
        elif getattr(args, "upstream_chat", False):
            raise UsageError("--upstream-chat needs --upstream URL (the upstream it forwards to)")
        sock = _bind(args.host, args.port)
        config = ServerConfig.from_args(args, None if args.upstream else engine_options(args))
    except UsageError as e:
        sys.stderr.write(f"tokentrail serve: error: {e}\n")
        return 2
    # model_name also travels on its own: the proxy's create_upstream_app reads it.
    options: dict[str, Any] = {"config": config, "model_name": config.model_name}
    if args.upstream:
        from ..errors import UpstreamError
        from .proxy import create_upstream_app

        try:
            app = create_upstream_app(
                args.upstream,
                args.tokenizer,
                upstream_api_key=args.upstream_api_key,
                upstream_model=args.upstream_model,
                dialect=args.upstream_dialect,
                timeout=args.upstream_timeout,
                upstream_chat=getattr(args, "upstream_chat", False),
                **options,
            )
        except UpstreamError as e:
            sock.close()
            sys.stderr.write(f"tokentrail serve: error: {' '.join(str(e).split())}\n")
            return 2
        except (OSError, ValueError, ImportError) as e:
            sock.close()
            sys.stderr.write(
                f"tokentrail serve: error: cannot load the tokenizer: {' '.join(str(e).split())}\n"
            )
            return 2
    else:
        app = create_app(model_path=args.model, loader=loader, **options)
    return _serve(app, sock, args)


def _serve(app: Any, sock: socket.socket, args: argparse.Namespace) -> int:
    """Load the model, then run uvicorn on `sock` until interrupted."""
    import uvicorn

    engine = app.state.engine
    try:
        engine.start()
    except (OSError, ValueError, ImportError, TypeError) as e:
        sock.close()
        return fail(f"cannot load the model: {e}", "tokentrail serve")
    url = _url(sock)

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                logger.info("serving %s on %s", engine.model_name, url)

    logging.getLogger("uvicorn.error").addFilter(_QuietAbandon())
    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        access_log=False,  # the app logs one line per request itself
        http=_protocol_class(args.read_timeout),
        limit_concurrency=args.max_connections,
        timeout_keep_alive=args.keep_alive_timeout,  # type: ignore[arg-type]
        h11_max_incomplete_event_size=64 * 1024,
        timeout_graceful_shutdown=5,
    )
    try:
        Server(config).run(sockets=[sock])
    finally:
        engine.stop()
        sock.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m tokentrail.server ...`: the same options as `tokentrail serve`."""
    from ..usage import Parser

    parser = Parser(prog="python -m tokentrail.server")
    _add_arguments(parser)
    return run(parser.parse_args(argv))
