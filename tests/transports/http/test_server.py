"""The server's HTTP protocol: an answer leaves in one send; streamed and closing answers arrive whole, in order.

The connection is a real socket pair; the server's end records each `send` call it makes, and the client reads
what arrived. The loop is asyncio's own selector loop, whatever policy other tests left: its transports call the
socket object's `send` (uvloop's, the server's loop, write to the descriptor from C).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from starlette.types import Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.server import ServerState

from layerserve.transports.http.server import CoalescingTransport, HttpProtocol


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    await receive()
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"one,", "more_body": True})
        await asyncio.sleep(0.01)  # the next chunk comes on a later turn of the loop
        await send({"type": "http.response.body", "body": b"two"})
        return
    body = b'{"ok":true}'
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _RecordingSocket(socket.socket):
    """A socket that keeps what each of its `send` calls sent."""

    sends: list[bytes]

    def send(self, data: object, flags: int = 0) -> int:  # type: ignore[override]
        sent = super().send(data, flags)  # type: ignore[arg-type]
        self.sends.append(bytes(memoryview(data)[:sent]))  # type: ignore[arg-type]
        return sent


async def _exchange(request: bytes, end: bytes) -> tuple[list[bytes], bytes]:
    """Send one request over a new connection served by HttpProtocol: the server's sends, and what arrived until
    `end` (or the server closed the connection)."""
    loop = asyncio.get_running_loop()
    server_end, client_end = socket.socketpair()
    server_side = _RecordingSocket(fileno=server_end.detach())
    server_side.sends = []
    config = Config(_app, log_level="warning", lifespan="off")
    config.load()
    transport, _ = await loop.connect_accepted_socket(lambda: HttpProtocol(config, ServerState(), {}), server_side)
    client_end.setblocking(False)
    await loop.sock_sendall(client_end, request)
    received = b""
    while not received.endswith(end):
        chunk = await asyncio.wait_for(loop.sock_recv(client_end, 65536), 30)
        if not chunk:  # the server closed the connection
            break
        received += chunk
    client_end.close()
    transport.close()
    await asyncio.sleep(0)  # the transport closes its socket on the loop's next turn
    return server_side.sends, received


def _run(request: bytes, end: bytes) -> tuple[list[bytes], bytes]:
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        return runner.run(_exchange(request, end))


def test_an_answer_leaves_in_one_send() -> None:
    sends, received = _run(b"POST /infer HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}", b"}")
    assert len(sends) == 1 and sends[0] == received
    assert received.startswith(b"HTTP/1.1 200 OK\r\n") and received.endswith(b'\r\n\r\n{"ok":true}')


def test_a_closing_answer_is_sent_whole_before_the_connection_closes() -> None:
    request = b"POST /infer HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}"
    sends, received = _run(request, b"never: until the server closes")
    assert len(sends) == 1 and received.endswith(b'{"ok":true}')


def test_a_streamed_answer_arrives_whole_and_in_order() -> None:
    sends, answer = _run(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n", b"\r\n0\r\n\r\n")
    assert b"".join(sends) == answer
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert answer.endswith(b"\r\n\r\n4\r\none,\r\n3\r\ntwo\r\n0\r\n\r\n")  # chunked: every chunk, then the end


def test_what_uvicorn_asks_of_every_request_is_no_failed_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    # An attribute found through `__getattr__` first fails the normal lookup, which builds an AttributeError.
    through_getattr: list[str] = []
    delegate = CoalescingTransport.__getattr__

    def recording(self: CoalescingTransport, name: str) -> Any:
        through_getattr.append(name)
        return delegate(self, name)

    monkeypatch.setattr(CoalescingTransport, "__getattr__", recording)
    _, received = _run(b"POST /infer HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}", b"}")
    assert received.endswith(b'{"ok":true}')
    assert set(through_getattr) <= {"get_extra_info"}, through_getattr  # once per connection, as it opens
