"""CallGuard: what RequestBoundary, AuthMiddleware and the error handler do for HTTP, done for one gRPC call:
tokens, the versions the call holds, request metrics, the access log, our errors as status codes."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Any, TypeAlias, TypeVar

import grpc

from layerserve.errors import LayerserveError, PermissionDeniedError, UnauthenticatedError
from layerserve.transports.http.middleware import log_internal_error
from layerserve.transports.request_record import RequestRecorder

SERVICE_PATH = "/inference.GRPCInferenceService"

Answer = TypeVar("Answer")
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


class Access(StrEnum):
    """Which token a call needs: none (health), the API token, or the admin token (repository RPCs)."""

    PUBLIC = "public"
    API = "api"
    ADMIN = "admin"


def status_of(error: LayerserveError, where: dict[str, str]) -> tuple[grpc.StatusCode, str]:
    """The status code and message of one of our errors; a 500 is logged once, under a new id."""
    if error.status_code == 500:
        return grpc.StatusCode.INTERNAL, log_internal_error(where, error)
    code = _CODES.get(error.status_code)
    if code is None:
        code = grpc.StatusCode.INVALID_ARGUMENT if error.status_code < 500 else grpc.StatusCode.UNAVAILABLE
    return code, error.message


def _bearer(metadata: Any) -> bytes | None:
    for key, value in metadata or ():
        if key == "authorization":
            raw = value if isinstance(value, bytes) else str(value).encode()
            scheme, _, token = raw.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return None


class CallGuard:
    """Runs each RPC of the gRPC door within the same rules as an HTTP request (see the module docstring)."""

    def __init__(self, admin_token: str | None, api_token: str | None, log_requests: bool) -> None:
        self._admin = admin_token.encode() if admin_token else None
        self._api = api_token.encode() if api_token else None
        self._recorder = RequestRecorder(log_requests)
        self._names: dict[str, tuple[str, str]] = {}  # method: (route, path)
        # Whether each kind of call needs a token at all: when none is configured its metadata is never read.
        self._needs_token = {
            Access.PUBLIC: False,
            Access.API: self._api is not None,
            Access.ADMIN: self._admin is not None,
        }

    def check_token(self, access: Access, metadata: Any) -> None:
        """Raises UnauthenticatedError or PermissionDeniedError when the call lacks the token it needs."""
        if access is Access.PUBLIC:
            return
        is_admin = access is Access.ADMIN
        accepted = [t for t in ((self._admin,) if is_admin else (self._admin, self._api)) if t is not None]
        if (self._admin if is_admin else self._api) is None:
            return
        kind = "an admin" if is_admin else "an API"
        token = _bearer(metadata)
        if not token:
            raise UnauthenticatedError(f"this call needs {kind} token: send metadata 'authorization: Bearer <token>'")
        matches = [hmac.compare_digest(token, candidate) for candidate in accepted]  # all compared: constant time
        if not any(matches):
            raise PermissionDeniedError(f"the bearer token is not {kind} token of this server")

    async def authorize(self, access: Access, context: Context) -> None:
        """End the call with UNAUTHENTICATED or PERMISSION_DENIED when it lacks the token it needs."""
        try:
            self.check_token(access, context.invocation_metadata())
        except LayerserveError as error:
            await context.abort(*status_of(error, {}))

    async def run(self, method: str, access: Access, context: Context, call: Callable[[], Awaitable[Answer]]) -> Answer:
        """Answer one call: check its token, then `attempt` it; a failure ends the call with its status."""

        async def checked() -> Answer:
            self.check_token(access, context.invocation_metadata())
            return await call()

        answer, code, message = await self.attempt(method, checked if self._needs_token[access] else call)
        if code is not grpc.StatusCode.OK:
            await context.abort(code, message)
        return answer  # type: ignore[return-value]  # None only with a failure, and abort raises

    async def attempt(
        self, method: str, call: Callable[[], Awaitable[Answer]]
    ) -> tuple[Answer | None, grpc.StatusCode, str]:
        """Run one call (or stream message), counted and logged (the call leases the versions it uses); returns
        its answer, or None with the status code and message of our error (or of a bug)."""
        started, code, message = time.perf_counter(), grpc.StatusCode.OK, ""
        self._recorder.start()
        try:
            return await call(), code, message
        except LayerserveError as error:
            code, message = status_of(error, {"method": "GRPC", "path": f"{SERVICE_PATH}/{method}"})
        except asyncio.CancelledError:  # the client cancelled, or its deadline passed: nobody to answer
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as error:  # the one boundary of unexpected errors of a gRPC call
            where = {"method": "GRPC", "path": f"{SERVICE_PATH}/{method}"}
            code, message = grpc.StatusCode.INTERNAL, log_internal_error(where, error)
        finally:
            self.record(method, code, time.perf_counter() - started)
        return None, code, message

    def record(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        """Count and time one answered call (or stream message) and write its access log line."""
        names = self._names.get(method)
        if names is None:
            names = self._names[method] = f"grpc.{method}", f"{SERVICE_PATH}/{method}"
        route, path = names
        self._recorder.record("GRPC", path, route, code.name, seconds)
