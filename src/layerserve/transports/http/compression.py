"""CompressMiddleware: answers of at least `minimum_size` bytes are compressed when the client's Accept-Encoding
asks for gzip (first) or deflate; a streamed answer is compressed piece by piece."""

from __future__ import annotations

import zlib
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from layerserve.transports.http.cycle import header_value

_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def accepted_encoding(scope: Scope) -> str | None:
    """The answer encoding the client accepts that CompressMiddleware would use (gzip first, else deflate)."""
    accepted = (header_value(scope, b"accept-encoding") or b"").decode("latin-1")
    return "gzip" if "gzip" in accepted else "deflate" if "deflate" in accepted else None


class CompressMiddleware:
    """See the module."""

    def __init__(self, app: ASGIApp, minimum_size: int, level: int = 1) -> None:
        self.app = app
        self._minimum_size = minimum_size
        self._level = level

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer through a compressing `send` when the client accepts an encoding."""
        encoding = accepted_encoding(scope) if scope["type"] == "http" else None
        if encoding is None:
            await self.app(scope, receive, send)
            return
        await self.app(scope, receive, _Compressing(send, encoding, self._minimum_size, self._level).send)


class _Compressing:
    """One answer's `send`: its head is held until its first body piece shows whether to compress."""

    def __init__(self, send: Send, encoding: str, minimum_size: int, level: int) -> None:
        self._send = send
        self._encoding = encoding
        self._minimum_size = minimum_size
        self._level = level
        self._start: Message | None = None
        self._compressor: Any = None  # zlib's compressor object, once the answer is being compressed

    async def send(self, message: Message) -> None:
        """Hold the head; compress (or not) the body; pass anything else on."""
        kind = message["type"]
        if kind == "http.response.start":
            self._start = message
        elif kind != "http.response.body":
            await self._send(message)
        elif self._start is not None:
            await self._first(self._start, message)
        elif self._compressor is not None:
            more = message.get("more_body", False)
            body = self._compress(message.get("body", b""), more)
            await self._send({"type": "http.response.body", "body": body, "more_body": more})
        else:
            await self._send(message)

    async def _first(self, start: Message, message: Message) -> None:
        """The head and the body's first piece: compressed unless small, encoded already, or an event stream."""
        self._start = None
        body, more = message.get("body", b""), message.get("more_body", False)
        headers = list(start.get("headers", ()))
        names = {name.lower(): value for name, value in headers}
        if (
            b"content-encoding" in names
            or names.get(b"content-type", b"").startswith(b"text/event-stream")
            or (not more and len(body) < self._minimum_size)
        ):
            await self._send(start)
            await self._send(message)
            return
        self._compressor = zlib.compressobj(self._level, zlib.DEFLATED, _WBITS[self._encoding])
        compressed = self._compress(body, more)
        headers = [(n, v) for n, v in headers if n.lower() not in (b"content-length", b"vary")]
        headers += [(b"content-encoding", self._encoding.encode()), (b"vary", b"Accept-Encoding")]
        if not more:
            headers.append((b"content-length", b"%d" % len(compressed)))
        await self._send({**start, "headers": headers})
        await self._send({"type": "http.response.body", "body": compressed, "more_body": more})

    def _compress(self, body: bytes, more: bool) -> bytes:
        compressor = self._compressor
        return compressor.compress(body) + compressor.flush(zlib.Z_SYNC_FLUSH if more else zlib.Z_FINISH)  # type: ignore[no-any-return]
