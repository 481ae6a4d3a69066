"""RequestCycle: one HTTP/1.1 request on its connection and its answer: the ASGI `receive` and `send` its app gets,
and `answer`, which writes a whole answer at once (the fast path's, and the refusals').

An answer leaves in one write: the status line and headers are held until the body's first piece comes, and go
with it (uvicorn wrote them at `http.response.start`, then the body: two system calls, two TCP segments on
loopback, for every answer). An answer without a Content-Length is sent chunked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any, Protocol

STATUS_LINES = {status.value: b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode()) for status in HTTPStatus}
STATUS_LINES[499] = b"HTTP/1.1 499 Client Closed Request\r\n"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_DISCONNECT: dict[str, Any] = {"type": "http.disconnect"}


def status_line(status: int) -> bytes:
    """`HTTP/1.1 <status> <phrase>\\r\\n` (a status without a phrase gets none)."""
    return STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status


class Connection(Protocol):
    """What a cycle asks of its connection."""

    transport: asyncio.Transport
    default_headers: list[tuple[bytes, bytes]]

    def resume_reading(self) -> None:
        """Read from the socket again (the app asks for more of the body)."""

    async def drain(self) -> None:
        """Wait while the transport's write buffer is full."""

    def is_write_paused(self) -> bool:
        """Whether the transport asked the writer to wait."""

    def answered(self, cycle: RequestCycle) -> None:
        """The cycle's answer is complete: the next request may start."""


class RequestCycle:
    """One request: its ASGI scope and body, and the state of its answer (see the module)."""

    __slots__ = (
        "_body_taken", "_chunked", "_connection", "_event", "_expected_length", "_head", "body", "disconnected",
        "expect_continue",
        "keep_alive", "more_body", "parts", "response_complete", "response_started", "scope", "task", "whole_body",
    )  # fmt: skip

    def __init__(self, scope: dict[str, Any], connection: Connection, keep_alive: bool, expect_continue: bool) -> None:
        self.scope = scope
        self._connection = connection
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.body = b""  # what came and the app has not received
        self.parts: list[bytes] = []  # a body read whole (`whole_body`): its pieces until the message is complete
        self.whole_body = False
        self.more_body = True
        self._body_taken = False  # the app has received the body's last piece
        self.disconnected = False
        self.response_started = self.response_complete = False
        self._event = asyncio.Event()
        self._head: list[bytes] | None = None
        self._chunked = False
        self._expected_length: int | None = None
        self.task: asyncio.Task[None] | None = None

    # What the connection tells the cycle.

    def received(self, body: bytes) -> None:
        """A piece of the body came."""
        if self.whole_body:
            self.parts.append(body)
            return
        self.body = self.body + body if self.body else body
        self._event.set()

    def ended(self) -> None:
        """The request's body is complete."""
        if self.parts:
            parts, self.parts = self.parts, []
            if self.body:  # (what came while it was queued behind a pipelined answer, before it was read whole)
                parts.insert(0, self.body)
            self.body = parts[0] if len(parts) == 1 else b"".join(parts)
        self.more_body = False
        self._event.set()

    def lost(self) -> None:
        """The connection is gone: `receive` says so, nothing more is sent."""
        self.disconnected = True
        self._event.set()

    @property
    def buffered(self) -> int:
        """Body bytes received and not yet taken by the app."""
        return len(self.body)

    # ASGI.

    async def receive(self) -> dict[str, Any]:
        """The next piece of the body; once the last was received, `http.disconnect` when the client is gone or the
        answer complete (a receive after the body waits for that, as ASGI asks)."""
        connection = self._connection
        if self.expect_continue and not self.response_started:
            self.expect_continue = False
            connection.transport.write(_CONTINUE)
        while True:
            if self.disconnected or self.response_complete:
                return _DISCONNECT
            if self.body or (not self.more_body and not self._body_taken):
                body, self.body = self.body, b""
                self._body_taken = not self.more_body
                return {"type": "http.request", "body": body, "more_body": self.more_body}
            if self.more_body:
                connection.resume_reading()
            self._event.clear()
            await self._event.wait()

    async def send(self, message: dict[str, Any]) -> None:
        """Write the app's answer (see the module); messages after the client left are dropped.

        Raises:
            RuntimeError: messages out of order, or a body that does not match its Content-Length.
        """
        if self._connection.is_write_paused() and not self.disconnected:
            await self._connection.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"expected ASGI message 'http.response.start', got {kind!r}")
            self._start(message["status"], message.get("headers", ()))
        elif not self.response_complete:
            if kind != "http.response.body":
                raise RuntimeError(f"expected ASGI message 'http.response.body', got {kind!r}")
            self._body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r} after the answer was complete")

    def answer(self, status: int, headers: Any, body: bytes | memoryview, extra: Any = ()) -> None:
        """A whole answer at once: status line, headers (the server's first, `extra` last) and body in one write."""
        if self.disconnected or self.response_started:
            return
        self._start(status, headers, extra)
        self._body(body, False)

    def _start(self, status: int, headers: Any, extra: Any = ()) -> None:
        self.response_started, self.expect_continue = True, False
        head = [status_line(status)]
        connection = self._connection
        length = None
        for name, value in (*connection.default_headers, *headers, *extra):
            lowered = name.lower()
            if lowered == b"content-length":
                length = int(value)
            elif lowered == b"connection" and b"close" in value.lower():
                self.keep_alive = False
                continue  # written once, below
            head += (name, b": ", value, b"\r\n")
        if not self.keep_alive:
            head.append(b"connection: close\r\n")
        bodyless = self.scope["method"] == "HEAD" or status in (204, 304) or status < 200
        if length is None and not bodyless:
            self._chunked = True
            head.append(b"transfer-encoding: chunked\r\n")
        self._expected_length = 0 if bodyless else length
        head.append(b"\r\n")
        self._head = head

    def _body(self, body: bytes | memoryview, more_body: bool) -> None:
        pieces: list[Any] = self._head or []
        self._head = None
        if self._chunked:
            if body:
                pieces += (b"%x\r\n" % len(body), body, b"\r\n")
            if not more_body:
                pieces.append(b"0\r\n\r\n")
        elif self._expected_length is not None and self.scope["method"] != "HEAD":
            self._expected_length -= len(body)
            if self._expected_length < 0:
                raise RuntimeError("the answer's body is longer than its Content-Length")
            pieces.append(body)
        if pieces:
            transport = self._connection.transport
            if len(pieces) == 1:
                transport.write(pieces[0])
            else:
                transport.writelines(pieces)
        if more_body:
            return
        if self._expected_length and self.scope["method"] != "HEAD":
            raise RuntimeError("the answer's body is shorter than its Content-Length")
        self.response_complete = True
        self._event.set()
        if not self.keep_alive:
            self._connection.transport.close()
        self._connection.answered(self)


def header_value(scope: Mapping[str, Any], wanted: bytes) -> bytes | None:
    """The first value of a request header (ASGI names are lower-case), or None."""
    for name, value in scope["headers"]:
        if name == wanted:
            return bytes(value)
    return None
