"""`Guard`: the ASGI middleware every request passes first, outermost first: the access
log and request metrics (one info line per request on the logger named
"tokentrail.server.access"), the `Host` check against DNS rebinding (421), the API key
on ``/v1/*``, ``/metrics``, ``/tokentrail/*`` and the tokenizer endpoints (401), and
``application/json`` for POST bodies (415, so a cross-site form cannot start a
generation).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..errors import APIError
from .messages import PATH, anthropic_error
from .metrics import Metrics

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

access_log = logging.getLogger("tokentrail.server.access")

__all__ = ["GUARDED_PATHS", "ROUTES", "Guard"]

#: Paths the API key guards (the page, its files, the icon and /health stay open).
GUARDED_PATHS = ("/v1/", "/metrics", "/tokentrail/", "/tokenize", "/detokenize")


def _host_name(value: str) -> str:
    """The name part of a Host header: without the port, brackets or a trailing dot."""
    if value.startswith("["):
        return value[1:].partition("]")[0].lower()
    name = value.rpartition(":")[0] if value.count(":") == 1 else value
    return name.rstrip(".").lower()


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class Guard:
    """ASGI middleware: access log, metrics, Host check, API key and content type."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: Metrics,
        api_key: str | None,
        allowed_hosts: Iterable[str] | None,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.api_key = api_key.encode() if api_key else None
        self.hosts = None if allowed_hosts is None else {h.lower() for h in allowed_hosts}

    def _refuse(self, scope: Scope) -> APIError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path: str = scope["path"]
        if self.hosts is not None and "*" not in self.hosts:
            name = _host_name(headers.get("host", ""))
            if not (_is_ip(name) or name == "localhost" or name in self.hosts):
                return APIError(
                    421,
                    f"this server does not serve the host {headers.get('host', '')!r}; start "
                    "it with --allowed-host NAME to serve it under that name",
                    code="misdirected_request",
                )
        if self.api_key is not None and path.startswith(GUARDED_PATHS):
            scheme, _, key = headers.get("authorization", "").partition(" ")
            if "x-api-key" in headers:  # Anthropic's clients send the key so
                scheme, key = "bearer", headers["x-api-key"]
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                key.strip().encode(), self.api_key
            ):
                return APIError(
                    401,
                    "a valid API key is needed: send the header 'Authorization: Bearer KEY' "
                    "(or 'x-api-key: KEY')",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        if scope["method"] == "POST":
            ctype = headers.get("content-type", "").partition(";")[0].strip().lower()
            if ctype != "application/json":
                return APIError(
                    415,
                    "the request body must be JSON with 'Content-Type: application/json', "
                    f"got {ctype or 'no content type'!r}",
                    code="unsupported_media_type",
                )
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            error = self._refuse(scope)
            if error is not None:
                answer = anthropic_error(error) if scope["path"] == PATH else error.response()
                await answer(scope, receive, send_status)
            else:
                await self.app(scope, receive, send_status)
        finally:
            route = scope["path"] if scope["path"] in ROUTES else "(other)"
            self.metrics.http(route, status or 499)
            client = scope.get("client") or ("-", 0)
            access_log.info(
                '%s:%s "%s %s HTTP/%s" %s %.1f ms',
                client[0],
                client[1],
                scope["method"],
                scope["path"],
                scope.get("http_version", "1.1"),
                status or "-",
                (time.perf_counter() - started) * 1000,
            )


#: The routes counted by name in the request metrics (others: "(other)").
ROUTES = frozenset(
    {
        "/",
        "/health",
        "/metrics",
        "/favicon.ico",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/tokentrail/upstream",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
    }
)
