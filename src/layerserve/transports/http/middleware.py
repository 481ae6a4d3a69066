"""ASGI middleware: the boundary of unexpected errors, bearer-token auth, request metrics with the access log,
and compressed answers."""

from __future__ import annotations

import hmac
import logging
import re
import secrets
import time
import zlib
from typing import Any

import orjson
from starlette.middleware.gzip import GZipMiddleware, GZipResponder
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from layerserve.metrics import IN_FLIGHT, REQUEST_SECONDS, REQUESTS, SERVED_BY

access_log = logging.getLogger("layerserve.access")
log = logging.getLogger(__name__)

_MANAGEMENT = re.compile(
    r"^/v2/repository/|^/v2/models/[^/]+(/versions/[^/]+|/labels/[^/]+)?/(apply|train)$|^/v2/jobs(/|$)|^/v2/logging$"
)  # repository load/unload/index, apply (by version or label), train, the jobs routes and the log settings
_PUBLIC = re.compile(r"^/v2/health/|^/console(/|$)|^/$")  # the console's page and files hold no data


async def _refuse(send: Send, status: int, message: str) -> None:
    body = orjson.dumps({"error": message})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="layerserve"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def log_internal_error(scope: Scope, error: BaseException) -> str:
    """Log an unexpected error once, with its traceback, under a new id; returns the client's message."""
    error_id = secrets.token_hex(6)
    log.error("internal error %s on %s %s", error_id, scope.get("method"), scope.get("path"), exc_info=error)
    return f"internal error {error_id}"


class InternalErrorMiddleware:
    """The one boundary of unexpected exceptions: a 500 `{"error": "internal error <id>"}`, logged once.

    Nothing is re-raised, so the server keeps the kept-alive connection open (Starlette's own last handler
    re-raises after answering, which makes uvicorn log the error again and drop the connection). An error
    after the answer began cannot be answered: it is logged and the connection is closed by the server.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on; answer 500 for whatever escapes it."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_and_see(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_and_see)
        except Exception as error:
            message = log_internal_error(scope, error)
            if not started:
                await _refuse(send, 500, message)


def _header(scope: Scope, wanted: bytes) -> bytes:
    """The first value of a header (ASGI names are lower-case), or b"" (cheaper than building Headers)."""
    for name, value in scope["headers"]:
        if name == wanted:
            return bytes(value)
    return b""


def _bearer(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return None


class AuthMiddleware:
    """`admin_token` guards the management routes; `api_token` (if set) every route but health and the console's
    page (which asks for the token and sends it with every API call).

    No token: 401; a wrong one: 403. The admin token also opens every other route. Tokens are compared
    in constant time.
    """

    def __init__(self, app: ASGIApp, admin_token: str | None, api_token: str | None) -> None:
        self.app = app
        self._admin = admin_token.encode() if admin_token else None
        self._api = api_token.encode() if api_token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the token the route needs, then pass the request on."""
        if scope["type"] != "http" or _PUBLIC.match(scope["path"]):
            await self.app(scope, receive, send)
            return
        is_management = bool(_MANAGEMENT.match(scope["path"]))
        accepted = [t for t in ((self._admin,) if is_management else (self._admin, self._api)) if t is not None]
        needed = (is_management and self._admin is not None) or (not is_management and self._api is not None)
        if needed:
            token = _bearer(scope)
            kind = "an admin" if is_management else "an API"
            if not token:
                await _refuse(send, 401, f"this route needs {kind} token: send 'Authorization: Bearer <token>'")
                return
            # Every candidate is compared, so the time taken does not tell which one came close.
            matches = [hmac.compare_digest(token, candidate) for candidate in accepted]
            if not any(matches):
                await _refuse(send, 403, f"the bearer token is not {kind} token of this server")
                return
        await self.app(scope, receive, send)


class ObserveMiddleware:
    """Counts and times every request by model, version, route and status; writes the access log."""

    def __init__(self, app: ASGIApp, log_requests: bool) -> None:
        self.app = app
        self._log_requests = log_requests
        # Metric children by labels: `.labels()` costs microseconds on every request otherwise.
        self._children: dict[tuple[str, str, str, int], tuple[Any, Any]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer the request, then record it."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_and_see(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        SERVED_BY.set(None)
        IN_FLIGHT.inc()
        try:
            await self.app(scope, receive, send_and_see)
        finally:
            IN_FLIGHT.dec()
            self._record(scope, status, time.perf_counter() - started)

    def _record(self, scope: Scope, status: int, seconds: float) -> None:
        served = SERVED_BY.get()
        model, version = (served[0], str(served[1])) if served else ("", "")
        route = _route_name(scope.get("endpoint"))
        key = (model, version, route, status)
        children = self._children.get(key)
        if children is None:
            children = REQUESTS.labels(model, version, route, str(status)), REQUEST_SECONDS.labels(model, route)
            self._children[key] = children
        children[0].inc()
        children[1].observe(seconds)
        if self._log_requests:
            access_log.info(
                "%s %s route=%s model=%s version=%s status=%d %.2fms",
                scope["method"], scope["path"], route, model or "-", version or "-", status, seconds * 1000,
                extra={"route": route, "model": model, "version": version, "status": status,
                       "method": scope["method"], "path": scope["path"], "latency_ms": round(seconds * 1000, 3)},
            )  # fmt: skip


def _route_name(endpoint: Any) -> str:
    """`v2.infer`, `tfserving.predict`, ...: the module and function that answered; `none` if no route did."""
    if endpoint is None:
        return "none"
    module = getattr(endpoint, "__module__", "").rsplit(".", 1)[-1].removesuffix("_routes")
    return f"{module}.{getattr(endpoint, '__name__', 'endpoint')}"


class _DeflateResponder(GZipResponder):
    """Starlette's gzip responder writing the zlib format of `Content-Encoding: deflate` instead."""

    content_encoding = "deflate"

    @property
    def compressor(self) -> zlib._Compress:
        """The zlib compressor of this answer (made on first use)."""
        if self._compressor is None:
            self._compressor = zlib.compressobj(self.compresslevel, zlib.DEFLATED, zlib.MAX_WBITS)
        return self._compressor


class CompressMiddleware(GZipMiddleware):
    """Answers of at least `minimum_size` bytes are compressed when the client's Accept-Encoding asks:
    gzip first, else deflate (Starlette's GZipMiddleware, which adds deflate here)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pick the encoding the client accepts, then answer."""
        accepted = _header(scope, b"accept-encoding").decode("latin-1") if scope["type"] == "http" else ""
        if "gzip" not in accepted and "deflate" not in accepted:  # nothing to do: no responder wraps the answer
            await self.app(scope, receive, send)
            return
        if "gzip" in accepted:
            await super().__call__(scope, receive, send)
            return
        responder = _DeflateResponder(
            self.app, self.minimum_size, self.compresslevel, thread_minimum_size=self.thread_minimum_size,
            exclude_content_types=self.exclude_content_types,
        )  # fmt: skip
        await responder(scope, receive, send)
