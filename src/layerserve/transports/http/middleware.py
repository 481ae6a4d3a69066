"""ASGI middleware: bearer-token auth and compressed answers; the one logging of an unexpected error (see
boundary.py for the outermost middleware)."""

from __future__ import annotations

import functools
import hmac
import logging
import re
import secrets
import zlib
from collections.abc import Mapping
from types import MappingProxyType
from urllib.parse import parse_qsl

import orjson
from starlette.middleware.gzip import GZipMiddleware, GZipResponder
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger(__name__)

_MANAGEMENT = re.compile(
    r"^/v2/repository/|^/v2/models/[^/]+(/versions/[^/]+|/labels/[^/]+)?/(apply|train)$|^/v2/jobs(/|$)|^/v2/logging$"
)  # repository load/unload/index, apply (by version or label), train, the jobs routes and the log settings
_PUBLIC = re.compile(r"^/v2/health/|^/console(/|$)|^/$")  # the console's page and files hold no data


def refusal(status: int, message: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The headers and body of `{"error": message}` with `status` (and, for 401, the Bearer challenge)."""
    body = orjson.dumps({"error": message})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="layerserve"'))
    return headers, body


async def refuse(send: Send, status: int, message: str) -> None:
    """Answer `{"error": message}` with `status` (see `refusal`)."""
    headers, body = refusal(status, message)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def log_internal_error(scope: Scope, error: BaseException) -> str:
    """Log an unexpected error once, with its traceback, under a new id; returns the client's message."""
    error_id = secrets.token_hex(6)
    log.error("internal error %s on %s %s", error_id, scope.get("method"), scope.get("path"), exc_info=error)
    return f"internal error {error_id}"


def header_value(scope: Scope, wanted: bytes) -> bytes | None:
    """The first value of a header (ASGI names are lower-case), or None (cheaper than building Headers)."""
    for name, value in scope["headers"]:
        if name == wanted:
            return bytes(value)
    return None


def query_parameters(scope: Scope) -> Mapping[str, str]:
    """The query string's parameters, a repeated name's last value winning as in Starlette's `query_params` (a
    third of its cost: no multi-dict); read-only, as the same query string's are shared."""
    raw = scope.get("query_string", b"")
    return _parsed_query(raw) if raw else _NO_PARAMETERS


_NO_PARAMETERS: Mapping[str, str] = MappingProxyType({})


@functools.lru_cache(maxsize=256)  # clients send the same few query strings (`?cache=false`) again and again
def _parsed_query(raw: bytes) -> Mapping[str, str]:
    return MappingProxyType(dict(parse_qsl(raw.decode("latin-1"), keep_blank_values=True)))


def _bearer(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return None


class TokenCheck:
    """`admin_token` guards the management routes; `api_token` (if set) every route but health and the console's
    page (which asks for the token and sends it with every API call).

    No token: 401; a wrong one: 403. The admin token also opens every other route. Tokens are compared
    in constant time.
    """

    def __init__(self, admin_token: str | None, api_token: str | None) -> None:
        self._admin = admin_token.encode() if admin_token else None
        self._api = api_token.encode() if api_token else None

    def refusal(self, scope: Scope) -> tuple[int, str] | None:
        """The status and message that refuse this request, or None if its token (or route) lets it through."""
        if _PUBLIC.match(scope["path"]):
            return None
        is_management = bool(_MANAGEMENT.match(scope["path"]))
        accepted = [t for t in ((self._admin,) if is_management else (self._admin, self._api)) if t is not None]
        needed = (is_management and self._admin is not None) or (not is_management and self._api is not None)
        if not needed:
            return None
        token = _bearer(scope)
        kind = "an admin" if is_management else "an API"
        if not token:
            return 401, f"this route needs {kind} token: send 'Authorization: Bearer <token>'"
        # Every candidate is compared, so the time taken does not tell which one came close.
        matches = [hmac.compare_digest(token, candidate) for candidate in accepted]
        if not any(matches):
            return 403, f"the bearer token is not {kind} token of this server"
        return None


class AuthMiddleware:
    """Refuses a request without the token its route needs (see TokenCheck)."""

    def __init__(self, app: ASGIApp, admin_token: str | None, api_token: str | None) -> None:
        self.app = app
        self._check = TokenCheck(admin_token, api_token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the token the route needs, then pass the request on."""
        refused = self._check.refusal(scope) if scope["type"] == "http" else None
        if refused is not None:
            await refuse(send, *refused)
            return
        await self.app(scope, receive, send)


def accepted_encoding(scope: Scope) -> str | None:
    """The answer encoding the client accepts that CompressMiddleware would use (gzip first, else deflate)."""
    accepted = (header_value(scope, b"accept-encoding") or b"").decode("latin-1")
    return "gzip" if "gzip" in accepted else "deflate" if "deflate" in accepted else None


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
        encoding = accepted_encoding(scope) if scope["type"] == "http" else None
        if encoding is None:  # nothing to do: no responder wraps the answer
            await self.app(scope, receive, send)
            return
        if encoding == "gzip":
            await super().__call__(scope, receive, send)
            return
        responder = _DeflateResponder(
            self.app, self.minimum_size, self.compresslevel, thread_minimum_size=self.thread_minimum_size,
            exclude_content_types=self.exclude_content_types,
        )  # fmt: skip
        await responder(scope, receive, send)
