"""`tokentrail serve`: the parser, the engine choice and startup.

The flags come from the settings' declarations (`config.py`). Startup order: check the
flags (exit 2 with one line), bind the socket (a port in use is exit 2, nothing logged
as served), load the model, start uvicorn on that socket, and only then log the real URL
(the real port too, with ``--port 0``).
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
from ..usage import fail
from .config import (
    ENGINE_OPTIONS,
    ENGINE_SETTINGS,
    ListenConfig,
    Loader,
    ServerConfig,
    engine_options,
)
from .settings import add_flags, settings_of
from .workers import Heartbeat, Seat, WorkerBoard, shared_address

__all__ = ["ENGINE_OPTIONS", "engine_options", "main", "model_loader", "register", "run"]

logger = logging.getLogger("tokentrail.server")

#: Kernel send buffer per connection (Linux doubles it): the output a client that stops
#: reading can hold before the server notices and its --client-timeout clock runs.
SEND_BUFFER_BYTES = 128 * 1024


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    """`serve`'s flags, each from its one declaration (`config.py`), then the proxy's."""
    add_flags(parser, settings_of(ServerConfig))
    add_flags(parser.add_argument_group("listening"), settings_of(ListenConfig))
    add_flags(parser.add_argument_group("engine options"), ENGINE_SETTINGS)
    from .proxy import add_arguments as add_upstream_arguments

    add_upstream_arguments(parser)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to a `tokentrail` argparse subparsers object."""
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API with segment confidence",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/responses, /v1/messages, /v1/models, /health, /metrics) "
        "with per-segment token attribution, and a live confidence page at /.",
    )
    _add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def model_loader(args: argparse.Namespace) -> Loader:
    """What loads the model for these flags: a function returning (model, tokenizer).

    Raises UsageError for a flag the chosen engine does not take. A new kind of engine
    adds its name to `config.ENGINES`, its loader's flags to `config.ENGINE_FLAGS` and,
    if it is not loaded through `tokentrail.load`, a branch here.
    """
    from .. import generate

    options = engine_options(args)
    return lambda: generate.load(args.model, engine=args.engine, **options)


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
    """uvicorn's HTTP protocol (httptools' where installed, as uvicorn's own "auto" picks
    it: a C parser, about half h11's CPU per streamed chunk; else h11), closing a
    connection that does not send a whole request within `read_timeout` seconds
    (uvicorn itself only times out idle keep-alives)."""
    base: type[asyncio.Protocol]
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

    class ReadTimeoutProtocol(base):  # type: ignore[valid-type,misc]
        """The clock runs from the connection, or from the first bytes of a request after
        the last one was wholly received, until a request is wholly received; then it
        stops, so that an idle keep-alive is left to `--keep-alive-timeout` alone."""

        _read_timer: asyncio.TimerHandle | None = None
        #: The request cycle current when the clock started (None: none yet): a cycle
        #: other than it is the request being timed, once its headers are in.
        _timed_after: Any = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None:  # bound what the kernel holds for a client that does not read
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            self._arm()

        def _arm(self) -> None:
            self._timed_after = self.cycle
            self._read_timer = self.loop.call_later(read_timeout, self._expired)

        def _received_whole(self) -> bool:
            """Whether the request being timed has arrived whole (headers and body)."""
            cycle = self.cycle
            return cycle is not None and cycle is not self._timed_after and not cycle.more_body

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            if self._read_timer is None and (cycle is None or not cycle.more_body):
                self._arm()  # a new request begins (after a whole one, or pipelined)
            super().data_received(data)
            if self._read_timer is not None and self._received_whole():
                self._read_timer.cancel()
                self._read_timer = None

        def _expired(self) -> None:
            self._read_timer = None
            if self._received_whole():
                return
            if not self.transport.is_closing():
                logger.info(
                    "closed a connection that sent no whole request in %g s (--read-timeout)",
                    read_timeout,
                )
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


def _log_at(level_name: str, who: str = "") -> None:
    level = level_name.upper()
    logging.basicConfig(
        level=level, format=f"%(asctime)s %(levelname)s {who}%(name)s: %(message)s"
    )
    logging.getLogger("tokentrail").setLevel(level)  # also under `tokentrail -v serve`


def run(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted; return the exit status."""
    missing = _missing_extra()
    if missing is not None:
        return fail(f"needs {missing}: pip install 'tokentrail[server]'", "tokentrail serve")
    _log_at(args.log_level)
    try:
        listen = ListenConfig.from_args(args)
        config = ServerConfig.from_args(args, None if args.upstream else engine_options(args))
        loader = None if args.upstream else model_loader(args)
        if args.upstream:
            from .proxy import check_arguments as check_upstream_arguments

            check_upstream_arguments(args)
        elif getattr(args, "upstream_chat", False):
            raise UsageError("--upstream-chat needs --upstream URL (the upstream it forwards to)")
        if listen.workers > 1 and not args.upstream:
            raise UsageError(
                f"--workers {listen.workers} needs --upstream: the {args.engine} engine's model "
                "lives in one process (run it with --workers 1)"
            )
        sock = _bind(listen.host, listen.port)  # a port in use is refused here
        if listen.workers > 1:
            sock = shared_address(sock)
    except UsageError as e:
        sys.stderr.write(f"tokentrail serve: error: {e}\n")
        return 2
    if listen.workers > 1:
        from .workers import supervise

        return supervise(_worker, args, sock, listen.workers, _url(sock))
    app = _build_app(args, config, loader)
    if isinstance(app, int):
        sock.close()
        return app
    return _serve(app, sock, listen)


def _worker(args: argparse.Namespace, sock: socket.socket, seat: Seat) -> None:
    """One worker process of ``serve --workers N`` (`workers.supervise`): build the app
    from the flags as `run` does and serve it on the shared `sock`; exit with the status."""
    _log_at(args.log_level, f"worker {seat.index} ")
    listen = ListenConfig.from_args(args)  # checked by the supervisor already
    config = ServerConfig.from_args(args, None if args.upstream else engine_options(args))
    app = _build_app(args, config, None if args.upstream else model_loader(args))
    if isinstance(app, int):
        sock.close()
        raise SystemExit(app)
    raise SystemExit(_serve(app, sock, listen, seat))


def _build_app(args: argparse.Namespace, config: ServerConfig, loader: Loader | None) -> Any:
    """The app the flags ask for, or the exit status (one line said why) when the
    proxy's tokenizer or upstream check fails."""
    from .app import create_app

    # model_name also travels on its own: the proxy's create_upstream_app reads it.
    options: dict[str, Any] = {"config": config, "model_name": config.model_name}
    if not args.upstream:
        return create_app(model_path=args.model, loader=loader, **options)
    from ..errors import UpstreamError
    from .proxy import create_upstream_app

    try:
        return create_upstream_app(
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
        sys.stderr.write(f"tokentrail serve: error: {' '.join(str(e).split())}\n")
        return 2
    except (OSError, ValueError, ImportError) as e:
        sys.stderr.write(
            f"tokentrail serve: error: cannot load the tokenizer: {' '.join(str(e).split())}\n"
        )
        return 2


#: The collector's thresholds once the server's start-up heap is frozen (`_settle_heap`):
#: the young generation every 2,000 allocations (net of frees; Python's default is 700),
#: the middle one every 100 young collections and the oldest every 100 middle ones
#: (Python's: 10 and 10).
GC_THRESHOLDS = (2_000, 100, 100)


def _settle_heap() -> None:
    """Once the model and tokenizer are loaded: collect, then freeze what is left.

    A loaded tokenizer is hundreds of thousands of objects the collector would traverse
    at every full collection for the life of the server. Measured on the proxy
    (``benchmarks/results/proxy-cpu.md``, "Garbage collection"): without this each full
    collection took about 200 ms, every few seconds under load, a stall of every stream
    and a third of the proxy's CPU; frozen, a few milliseconds. (vLLM's servers freeze
    their start-up heap for the same reason.) Objects made later are collected as
    usual, less often (`GC_THRESHOLDS`): what a token makes is freed by reference
    counting as it leaves, and the collector's passes over the records still in flight
    took 7 µs per token of the proxy's ~60 at Python's thresholds, 4 at these
    (``proxy-cpu.md``, "The collector's thresholds")."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _serve(app: Any, sock: socket.socket, listen: ListenConfig, seat: Seat | None = None) -> int:
    """Load the model, then run uvicorn on `sock` until interrupted; as the worker at
    `seat` of ``--workers N``, say so in `/health` and an ``x-tokentrail-worker`` header
    (its pid), and keep its state file (`workers.Heartbeat`)."""
    import uvicorn

    engine = app.state.engine
    try:
        engine.start()
    except (OSError, ValueError, ImportError, TypeError) as e:
        sock.close()
        return fail(f"cannot load the model: {e}", "tokentrail serve")
    _settle_heap()
    url = _url(sock)

    heartbeat: Heartbeat | None = None

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            nonlocal heartbeat
            await super().startup(sockets)
            if not self.started:
                return
            if seat is None:
                logger.info("serving %s on %s", engine.model_name, url)
                return
            logger.info("worker %d (pid %d) serving on %s", seat.index, os.getpid(), url)
            heartbeat = Heartbeat(seat, engine.stats, self.stop_soon)
            heartbeat.start()

        def stop_soon(self) -> None:
            self.should_exit = True

    logging.getLogger("uvicorn.error").addFilter(_QuietAbandon())
    config = uvicorn.Config(
        app,
        log_level=listen.log_level,
        access_log=False,  # the app logs one line per request itself
        http=_protocol_class(listen.read_timeout),
        limit_concurrency=listen.max_connections,
        timeout_keep_alive=listen.keep_alive_timeout,  # type: ignore[arg-type]
        h11_max_incomplete_event_size=64 * 1024,
        timeout_graceful_shutdown=5,
        headers=[] if seat is None else [("x-tokentrail-worker", str(os.getpid()))],
    )
    if seat is not None:
        app.state.workers = WorkerBoard(seat.folder)
    try:
        Server(config).run(sockets=[sock])
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        engine.stop()
        sock.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m tokentrail.server ...`: the same options as `tokentrail serve`."""
    from ..usage import Parser

    parser = Parser(prog="python -m tokentrail.server")
    _add_arguments(parser)
    return run(parser.parse_args(argv))
