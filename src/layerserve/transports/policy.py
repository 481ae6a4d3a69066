"""RequestPolicy: what every door (HTTP through ASGI, the HTTP fast path, gRPC, the Ray direct port and ingress)
decides the same way, in one place: which token a request needs and whether it has it, the size limit, a
request's deadline, a request cancelled when its client goes, request metrics and the access log line, and the
boundary of unexpected errors (one logged error with an id, answered 500 / INTERNAL, the connection kept).

A door runs each request as `await policy.run(exchange, handler)`: the policy checks the token, runs the handler,
turns our errors into a Refusal (a status and a message, which the door answers in its own terms: a JSON body, or a
gRPC status), and records the request once, whatever happened.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

import grpc

from layerserve.errors import LayerserveError, PayloadTooLargeError
from layerserve.metrics import SERVED_BY
from layerserve.settings import Settings
from layerserve.tracing import CURRENT, RequestTrace, Tracing, end_request
from layerserve.transports.request_record import RequestRecorder

log = logging.getLogger("layerserve.transports")

Answer = TypeVar("Answer")

CLIENT_CLOSED = 499  # nginx's "client closed request": what the metrics and access log record for one cancelled

# What a gRPC status is for each HTTP status of ours (our errors carry HTTP statuses), and back.
GRPC_CODES = {
    200: "OK", 400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
    409: "FAILED_PRECONDITION", 413: "RESOURCE_EXHAUSTED", 415: "INVALID_ARGUMENT", 422: "INVALID_ARGUMENT",
    CLIENT_CLOSED: "CANCELLED", 500: "INTERNAL", 501: "UNIMPLEMENTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
}  # fmt: skip


GRPC_NUMBERS = {code.name: code.value[0] for code in grpc.StatusCode}  # a span's rpc.grpc.status_code


def grpc_code_name(status: int) -> str:
    """The gRPC status code's name for an HTTP status (another 4xx: INVALID_ARGUMENT; another 5xx: UNAVAILABLE)."""
    name = GRPC_CODES.get(status)
    if name is None:
        name = "INVALID_ARGUMENT" if status < 500 else "UNAVAILABLE"
    return name


class Access(StrEnum):
    """Which token a request needs: none (health, the console's files), the API token, or the admin token."""

    PUBLIC = "public"
    API = "api"
    ADMIN = "admin"


_MANAGEMENT = re.compile(
    r"^/v2/repository/|^/v2/models/[^/]+(/versions/[^/]+|/labels/[^/]+)?/(apply|train)$|^/v2/jobs(/|$)|^/v2/logging$"
)  # repository load/unload/index, apply (by version or label), train, the jobs routes and the log settings
_PUBLIC = re.compile(r"^/v2/health/|^/console(/|$)|^/$")  # the console's page and files hold no data
_GRPC_ACCESS = {
    "ServerLive": Access.PUBLIC, "ServerReady": Access.PUBLIC, "RepositoryIndex": Access.ADMIN,
    "RepositoryModelLoad": Access.ADMIN, "RepositoryModelUnload": Access.ADMIN,
}  # fmt: skip  # every other RPC of GRPCInferenceService: the API token


def http_access(path: str) -> Access:
    """The token an HTTP path needs."""
    if _PUBLIC.match(path):
        return Access.PUBLIC
    return Access.ADMIN if _MANAGEMENT.match(path) else Access.API


def grpc_access(method: str) -> Access:
    """The token a GRPCInferenceService RPC needs."""
    return _GRPC_ACCESS.get(method, Access.API)


@dataclass(frozen=True, slots=True)
class Refusal:
    """How a request ends when it is not answered by its handler: a status (HTTP's; see `grpc_code_name`) and the
    message the client gets."""

    status: int
    message: str


class Exchange:
    """One request or RPC under the policy: what it is called in the metrics and the access log, the token it
    presents, its status once known, and its task (which `cancel` ends when the client goes or its deadline passes)."""

    __slots__ = ("access", "authorization", "is_grpc", "method", "path", "route", "status", "task", "traceparent")

    def __init__(
        self, method: str, path: str, route: str, access: Access, authorization: bytes | None, is_grpc: bool = False,
        traceparent: bytes | str | None = None,
    ) -> None:  # fmt: skip
        self.method, self.path, self.route = method, path, route
        self.access, self.authorization, self.is_grpc = access, authorization, is_grpc
        self.traceparent = traceparent  # the caller's W3C trace context (read only when traces are on)
        self.status = 500  # what is recorded when nothing was answered
        self.task: asyncio.Task[Any] | None = None

    def cancel(self, status: int = CLIENT_CLOSED) -> None:
        """End the request's handler now, recorded as `status` (the client left: 499; its deadline passed: 504): a
        request still waiting in a queue leaves it, never computed."""
        task = self.task
        if task is not None and not task.done():
            self.status = status
            task.cancel()


class RequestPolicy:
    """Tokens, the size limit, deadlines, cancellation, metrics and the access log, and the error boundary, for every
    door (see the module)."""

    def __init__(self, settings: Settings, tracing: Tracing | None = None) -> None:
        self.max_body_bytes = settings.max_body_bytes
        self.tracing = tracing
        self._admin = settings.admin_token.encode() if settings.admin_token else None
        self._api = settings.api_token.encode() if settings.api_token else None
        self._recorder = RequestRecorder(settings.access_log)

    @property
    def needs_tokens(self) -> bool:
        """Whether any request needs a token (when none does, a door need not read the Authorization header)."""
        return self._admin is not None or self._api is not None

    def authorize(self, access: Access, authorization: bytes | None, is_grpc: bool = False) -> Refusal | None:
        """None when a request with this Authorization value (gRPC: `authorization` metadata) may pass; else 401 (no
        token) or 403 (a wrong one).

        `admin_token` guards the management routes and RPCs; `api_token` (if set) every other one but health and the
        console's files. The admin token opens every route. Tokens are compared in constant time.
        """
        if access is Access.PUBLIC:
            return None
        is_admin = access is Access.ADMIN
        if (self._admin if is_admin else self._api) is None:
            return None
        kind = "an admin" if is_admin else "an API"
        token = _bearer(authorization)
        if not token:
            how = "metadata 'authorization: Bearer <token>'" if is_grpc else "'Authorization: Bearer <token>'"
            return Refusal(401, f"this {'call' if is_grpc else 'route'} needs {kind} token: send {how}")
        accepted = [t for t in ((self._admin,) if is_admin else (self._admin, self._api)) if t is not None]
        # Every candidate is compared, so the time taken does not tell which one came close.
        if not any([hmac.compare_digest(token, candidate) for candidate in accepted]):
            return Refusal(403, f"the bearer token is not {kind} token of this server")
        return None

    def check_size(self, size: int, what: str = "body") -> None:
        """Raises PayloadTooLargeError when `size` bytes are over `max_body_bytes`."""
        if size > self.max_body_bytes:
            raise PayloadTooLargeError(f"{what} of {size} bytes is over the limit of {self.max_body_bytes} bytes")

    @staticmethod
    def deadline_ms(requested_ms: int | None, remaining_s: float | None) -> int | None:
        """A request's timeout: the one it asks for (`timeout_ms`), cut short by its call's deadline, if any."""
        if remaining_s is None:
            return requested_ms
        deadline_ms = max(1, int(remaining_s * 1000))
        return deadline_ms if requested_ms is None else min(requested_ms, deadline_ms)

    def failure(self, error: BaseException, exchange: Exchange) -> Refusal:
        """The refusal of an error: ours answer with their status and message; anything else (or one of ours of the
        500 class) is a bug, logged once with its traceback under a new id, which the client gets."""
        if isinstance(error, LayerserveError) and error.status_code != 500:
            return Refusal(error.status_code, error.message)
        return Refusal(500, log_internal_error(exchange.method, exchange.path, error))

    async def run(self, exchange: Exchange, handler: Callable[..., Awaitable[Answer]], *args: Any) -> Answer | Refusal:
        """Check the exchange's token, then run `handler(*args)`: its answer, or the refusal of its error. The
        exchange is recorded once (the door sets its status on an answer); a cancelled handler is recorded with the
        status `cancel` gave (499 by default: the client went) and the cancellation goes on."""
        recorder = self._recorder
        recorder.start()
        started = time.perf_counter()
        request = None if self.tracing is None else _begin_trace(self.tracing, exchange)
        try:
            if exchange.access is not Access.PUBLIC and self.needs_tokens:
                refused = self.authorize(exchange.access, exchange.authorization, exchange.is_grpc)
                if refused is not None:
                    exchange.status = refused.status
                    return refused
            exchange.task = asyncio.current_task()
            answer = await handler(*args)
            if exchange.is_grpc:
                exchange.status = 200  # OK (an HTTP door sets the status of the answer it wrote)
            return answer
        except asyncio.CancelledError:
            if exchange.status == 500:
                exchange.status = CLIENT_CLOSED  # cancelled by the host (the client went, or shutdown)
            raise
        except Exception as error:  # the one boundary of unexpected errors, for every door
            refused = self.failure(error, exchange)
            exchange.status = refused.status
            return refused
        finally:
            exchange.task = None
            status = grpc_code_name(exchange.status) if exchange.is_grpc else exchange.status
            trace_id = None if request is None else _end_trace(request, exchange, status)
            recorder.record(
                exchange.method, exchange.path, exchange.route, status, time.perf_counter() - started, trace_id
            )


def _begin_trace(tracing: Tracing, exchange: Exchange) -> RequestTrace:
    """The exchange's server span, continuing its caller's traceparent; the current trace while its handler runs
    (when it is sampled)."""
    if exchange.is_grpc:
        service, _, method = exchange.path[1:].partition("/")
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
    else:
        attributes = {"http.request.method": exchange.method, "url.path": exchange.path}
    request = tracing.begin(_span_name(exchange), exchange.traceparent, attributes)
    if request.is_recording:
        CURRENT.set(request)  # the handler's task is this one (policy.run is awaited in it): reset at the end
    return request


def _span_name(exchange: Exchange) -> str:
    """The server span's name: the gRPC method's path, or the HTTP method and route (known once routed)."""
    return exchange.path[1:] if exchange.is_grpc else f"{exchange.method} {exchange.route}"


def _end_trace(request: RequestTrace, exchange: Exchange, status: int | str) -> str:
    """End the exchange's server span with its outcome; its trace id."""
    if request.is_recording:
        CURRENT.set(None)
        served = SERVED_BY.get()
        outcome: dict[str, Any] = {"layerserve.route": exchange.route}
        if served:
            outcome["layerserve.model"], outcome["layerserve.version"] = served[0], str(served[1])
        if exchange.is_grpc:
            outcome["rpc.grpc.status_code"] = GRPC_NUMBERS.get(str(status), 2)
        else:
            outcome["http.response.status_code"] = status
        end_request(request, _span_name(exchange), outcome, exchange.status >= 500)
    else:
        request.server.end()
    return request.trace_id


def log_internal_error(method: str | None, path: str | None, error: BaseException) -> str:
    """Log an unexpected error once, with its traceback, under a new id; returns the client's message."""
    error_id = secrets.token_hex(6)
    log.error("internal error %s on %s %s", error_id, method, path, exc_info=error)
    return f"internal error {error_id}"


def _bearer(authorization: bytes | None) -> bytes | None:
    """The token of `Bearer <token>` (b"" for another scheme), or None without the header."""
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""
