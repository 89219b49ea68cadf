"""The ASGI app: routes behind the `guard.Guard` middleware (access log, metrics, Host
check, API key, content type). Routes validate the body (`protocol`, constraints
compiled off the event loop by `structured.CompileGate`), queue a `Job` on the
`Scheduler` (through its `Admission`), and stream or collect its records through a
`Formatter` (`answers`); a completions request with several prompts queues a job for
each (`prompts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..errors import APIError, ClientGone, EngineError
from ..vocab import Vocab
from . import messages, responses, tokenize
from .answers import (
    collect,
    empty_response,
    generation_error,
    json_response,
    stream_events,
    watch_disconnect,
)
from .body import read_json
from .config import Loader, ServerConfig
from .echo import fetch_prompt_rows, wants_fetch
from .formatting import Formatter
from .guard import Guard
from .jobs import ChatRunner, Job
from .metrics import Metrics
from .on_loop import drive
from .prompts import answer_several, split_prompts
from .protocol import (
    GenRequest,
    Kind,
    parse_chat,
    parse_completion,
)
from .scheduler import Scheduler
from .sse import EventStream
from .structured import CompileGate
from .voting import VoteBox
from .wire_errors import bad_request, json_type_name

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

logger = logging.getLogger("tokentrail.server")

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"


# -- routes -------------------------------------------------------------------------------------


class _Server:
    """The routes, bound to one Scheduler (`self.scheduler`) and its settings."""

    def __init__(
        self, scheduler: Scheduler, config: ServerConfig, metrics: Metrics,
        runner: ChatRunner | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.max_body_bytes = config.max_body_bytes
        self.temperature = config.temperature
        self.metrics = metrics
        self.chat_runner = runner  # runs admitted chat requests itself (--upstream-chat)
        #: Constraints compile on its pool, within its time budget (issue #29).
        self.compiling = CompileGate(metrics)

    def check_model(self, body: Mapping[str, Any]) -> str:
        """The served model's name, or a 400/404 for a ``model`` field naming another."""
        model = body.get("model")
        if model is None:
            return self.scheduler.model_name
        if not isinstance(model, str):
            raise bad_request(
                "model", f"'model' must be a string, got {json_type_name(model)}", "invalid_type"
            )
        if model != self.scheduler.model_name:
            raise self._no_model(model)
        return model

    def _no_model(self, model: str) -> APIError:
        return APIError(
            404,
            f"the model {model!r} does not exist; this server serves {self.scheduler.model_name!r}",
            param="model",
            code="model_not_found",
        )

    def loaded_vocab(self) -> Vocab:
        """The served model's vocabulary, or a 503 until the model is loaded."""
        if not self.scheduler.ready or self.scheduler.vocab is None:
            raise APIError(
                503,
                "the model is not loaded",
                type="server_error",
                code="model_not_ready",
                headers={"Retry-After": "5"},
            )
        return self.scheduler.vocab

    def _model_card(self) -> dict[str, Any]:
        card = {
            "id": self.scheduler.model_name,
            "object": "model",
            "created": self.scheduler.created,
            "owned_by": "tokentrail",
        }
        if self.scheduler.context_length is not None:
            card["max_model_len"] = self.scheduler.context_length  # as vLLM reports it
        return card

    async def models(self, request: Request) -> Response:
        return json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        model = request.path_params["model"]
        if model != self.scheduler.model_name:
            raise self._no_model(model)
        return json_response(self._model_card())

    async def health(self, request: Request) -> Response:
        """This server's state; under ``serve --workers N`` the answering worker's, with
        its pid (``worker``) and every worker's last state (``workers``)."""
        stats = self.scheduler.stats()
        board = getattr(request.app.state, "workers", None)  # a `workers.WorkerBoard`
        if board is not None:
            stats = board.health(stats)
        return json_response(stats, 200 if stats["status"] == "ok" else 503)

    async def metrics_page(self, request: Request) -> Response:
        from starlette.responses import Response

        body, media_type = self.metrics.exposition()
        return Response(body, headers={"Content-Type": media_type})

    async def upstream(self, request: Request) -> Response:
        """The proxy's startup check of its upstream (`tokentrail.server.proxy`)."""
        report = getattr(request.app.state, "upstream_check", None)
        if report is None:
            raise APIError(404, "this server has no upstream (it is not `serve --upstream`)",
                           type="not_found_error", code="not_found")  # fmt: skip
        streams = getattr(request.app.state, "upstream_streams", None)
        if callable(streams):  # the proxy's reading of its upstream streams
            report = {**report, "streams": streams()}
        return json_response(report)

    async def index(self, request: Request) -> Response:
        return self._static("index.html", "text/html")

    async def favicon(self, request: Request) -> Response:
        return self._static("favicon.ico", "image/x-icon")

    def _static(self, name: str, media_type: str) -> Response:
        path = STATIC_DIR / name
        if not path.is_file():
            raise APIError(404, f"{name} is not installed", code="not_found")
        from starlette.responses import FileResponse

        return FileResponse(path, media_type=media_type)

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "completion")

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API on the chat pipeline (`server.responses`)."""
        return await self._other_api(request, responses)

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API on the chat pipeline (`server.messages`)."""
        return await self._other_api(request, messages)

    async def _other_api(self, request: Request, api: ModuleType) -> Response:
        """Another API's request, run as the chat request it means; `api` is its
        module (`chat_body`, `shape_of`, `stream_answer`, `whole_answer`)."""
        if self.chat_runner is not None:
            raise APIError(404, f"{api.PATH} is not served with --upstream-chat: use "
                           "/v1/chat/completions", code="not_found")  # fmt: skip
        return await self._complete(request, "chat", api)

    async def _complete(
        self, request: Request, kind: Kind, api: ModuleType | None = None
    ) -> Response:
        try:
            body = await read_json(request, self.max_body_bytes)
        except ClientGone as e:
            logger.info("%s %s: %s", request.method, request.url.path, e)
            return empty_response(499)
        model = self.check_model(body)
        wire = body
        if api is not None:
            body = api.chat_body(body)
        vocab = self.loaded_vocab()
        bodies = split_prompts(body) if kind == "completion" else None
        if bodies is not None:
            reqs = [
                await self.compiling(
                    lambda b=b: parse_completion(b, model, vocab.size, self.temperature),
                    b, self.scheduler.tokenizer,
                )
                for b in bodies
            ]  # fmt: skip
            for one in reqs:
                await self._fetch(one)
            return await answer_several(request, reqs, self.scheduler, vocab)
        parse = parse_chat if kind == "chat" else parse_completion
        req = await self.compiling(
            lambda: parse(body, model, vocab.size, self.temperature), body, self.scheduler.tokenizer
        )
        await self._fetch(req)
        runner = self.chat_runner if kind == "chat" else None
        if runner is not None:
            runner.check(req)
        prefix = api.ID_PREFIX if api else "chatcmpl-" if kind == "chat" else "cmpl-"
        job = Job(id=prefix + uuid.uuid4().hex[:24], request=req, loop=asyncio.get_running_loop(),
                  outside=runner is not None)  # fmt: skip
        self.scheduler.submit(job)
        watcher = asyncio.create_task(watch_disconnect(request.receive, job))
        handed_over = False
        try:
            # Wait for the first event before answering, so that a prompt the model
            # rejects still gets a proper HTTP error status.
            event = await job.next_event()
            if event[0] == "error":
                raise generation_error(event[2])
            if event[0] == "cancelled":
                if runner is not None:  # it may have been admitted meanwhile
                    self.scheduler.release(job, "cancelled")
                return empty_response(499)
            if runner is not None:  # admitted; the runner frees its place when it ends
                answer = await runner.run(job, body, self.scheduler.release)
                if answer is None or isinstance(answer, dict):
                    return empty_response(499) if answer is None else json_response(answer)
                handed_over = True
                return EventStream(answer, job, watcher, self.scheduler.client_timeout)  # type: ignore[return-value]
            fmts = [Formatter(job.id, req, vocab, choice) for choice in range(req.n)]
            if api is not None:
                shape = api.shape_of(job.id, wire, req)
                if req.stream:
                    handed_over = True
                    events = api.stream_answer(job, fmts[0], event, shape)
                    return EventStream(events, job, watcher, self.scheduler.client_timeout)  # type: ignore[return-value]
                whole = await api.whole_answer(job, fmts[0], event, shape)
                return empty_response(499) if whole is None else json_response(whole)
            box = self._vote_box(req)
            if req.stream:
                handed_over = True
                stream = stream_events(job, fmts, event, box)
                return EventStream(stream, job, watcher, self.scheduler.client_timeout)  # type: ignore[return-value]
            return await collect(job, fmts, event, box)
        finally:
            if not handed_over:
                watcher.cancel()
                job.cancel("request ended")

    async def _fetch(self, req: GenRequest) -> None:
        """Through the proxy, the prompt's logprobs for ``echo`` asked of the upstream
        in a thread, before the request joins the batch (`server.echo`)."""
        engine = self.scheduler.model
        if wants_fetch(req, engine):
            try:
                await asyncio.to_thread(fetch_prompt_rows, req, engine, self.scheduler.tokenizer)
            except EngineError as e:
                raise generation_error(e) from None

    def _vote_box(self, req: GenRequest) -> VoteBox | None:
        """The request's ballots (`server.voting`), None without ``tokentrail.vote``."""
        if req.vote is None:
            return None
        json_reply = req.structure.json_constrained
        return VoteBox(req.n, req.vote, json_reply, self.scheduler.calibration)

async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    if request.url.path == messages.PATH:  # Anthropic's clients read their own shape
        return messages.anthropic_error(exc)  # type: ignore[no-any-return]
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    from starlette.exceptions import HTTPException

    assert isinstance(exc, HTTPException)
    codes = {404: "not_found", 405: "method_not_allowed"}
    return APIError(
        exc.status_code,
        f"{request.method} {request.url.path}: {exc.detail}",
        code=codes.get(exc.status_code),
        headers=exc.headers,
    ).response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return APIError(
        500,
        f"internal server error: {type(exc).__name__}",
        type="server_error",
        code="internal_error",
    ).response()


def create_app(
    model: Any = None,
    tokenizer: Any = None,
    model_path: str | os.PathLike[str] | None = None,
    *,
    config: ServerConfig | None = None,
    loader: Loader | None = None,
    chat_runner: ChatRunner | None = None,
    **settings: Any,
) -> Starlette:
    """Build the ASGI app serving one model.

    Pass `model` and `tokenizer` (as `tokentrail.load` returns them), or `model_path`
    (None: the built-in demo model) or a `loader` returning (model, tokenizer), which is
    then run on the generation thread when the app starts (or earlier through
    ``app.state.engine.start()``). The settings are a `ServerConfig` (`config`), or its
    fields as keywords, which update `config`: `max_batch`, `max_queue`,
    `max_body_bytes`, `model_name`, `engine`, `load_options`, `prompt_cache_bytes`,
    `client_timeout`, `max_buffered`, `temperature`, `api_key`, `allowed_hosts` (see
    `ServerConfig`). The app's `Scheduler` is ``app.state.engine``, its `Metrics`
    ``app.state.metrics``. A `chat_runner` answers the chat requests the scheduler admits
    (``serve --upstream-chat``); it is opened and closed with the app.
    """
    from starlette.applications import Starlette

    if model_path is not None:
        settings["model_path"] = model_path
    config = (config or ServerConfig()).updated(**settings)
    metrics = Metrics()
    scheduler = Scheduler(model, tokenizer, config=config, loader=loader, metrics=metrics)
    server = _Server(scheduler, config, metrics, chat_runner)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await asyncio.to_thread(scheduler.start)
        driver = None
        if scheduler.loop_batch is not None:  # the proxy: its passes run on this loop
            driver = asyncio.create_task(drive(scheduler, scheduler.loop_batch))
        if chat_runner is not None:
            chat_runner.open()
        try:
            yield
        finally:
            if chat_runner is not None:
                await chat_runner.aclose()
            await asyncio.to_thread(scheduler.stop)
            if driver is not None:
                with contextlib.suppress(Exception):
                    await driver
            server.compiling.close()

    app = Starlette(
        routes=_routes(server),
        lifespan=lifespan,
        exception_handlers=_error_handlers(),
        middleware=[_guard(config, metrics)],
    )
    app.state.engine = scheduler
    app.state.metrics = metrics
    app.state.config = config
    return app


def _routes(server: _Server) -> list[Any]:
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    routes: list[Any] = [
        Route("/", server.index, methods=["GET"]),
        Route("/favicon.ico", server.favicon, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_page, methods=["GET"]),
        Route("/tokentrail/upstream", server.upstream, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model:path}", server.model, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route(responses.PATH, server.responses, methods=["POST"]),
        Route(messages.PATH, server.messages, methods=["POST"]),
        *tokenize.routes(server),  # vLLM's tokenizer endpoints, where lm-eval looks
    ]
    if STATIC_DIR.is_dir():
        routes.append(Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"))
    return routes


def _error_handlers() -> dict[Any, Callable[..., Any]]:
    from starlette.exceptions import HTTPException

    return {APIError: _api_error, HTTPException: _http_error, Exception: _internal_error}


def _guard(config: ServerConfig, metrics: Metrics) -> Any:
    from starlette.middleware import Middleware

    return Middleware(
        Guard, metrics=metrics, api_key=config.api_key, allowed_hosts=config.allowed_hosts
    )


__all__ = ["Guard", "create_app"]
