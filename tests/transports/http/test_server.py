"""The server's HTTP protocol: an answer leaves in one send; streamed and closing answers arrive whole, in order.

The connection is a real socket pair; the server's end records each `send` call it makes, and the client reads
what arrived. The loop is asyncio's own selector loop, whatever policy other tests left: its transports call the
socket object's `send` (uvloop's, the server's loop, write to the descriptor from C).
"""

from __future__ import annotations

import asyncio
import json
import socket
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.types import Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.server import ServerState

from layerserve.settings import Settings
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


async def _exchange(request: bytes, end: bytes, app: Any = _app) -> tuple[list[bytes], bytes]:
    """Send one request over a new connection served by HttpProtocol over `app`: the server's sends, and what
    arrived until `end` (or the server closed the connection)."""
    loop = asyncio.get_running_loop()
    server_end, client_end = socket.socketpair()
    server_side = _RecordingSocket(fileno=server_end.detach())
    server_side.sends = []
    config = Config(app, log_level="warning", lifespan="off")
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


_REQUEST = b"POST /infer HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"


async def _keep_alive_session(pauses: list[float], timeout_s: float) -> tuple[list[bytes], float | None, int]:
    """On one connection (keep-alive timeout `timeout_s`), a request after each pause: the answers; then, idle,
    how long after the last answer the server closed the connection (None: not within 10 s); and how many
    keep-alive timers the server made."""
    loop = asyncio.get_running_loop()
    timers = 0
    call_later = loop.call_later

    def counting_call_later(delay: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        nonlocal timers
        timers += "keep_alive" in getattr(callback, "__name__", "")
        return call_later(delay, callback, *args)

    loop.call_later = counting_call_later  # type: ignore[method-assign]
    server_end, client_end = socket.socketpair()
    config = Config(_app, log_level="warning", lifespan="off", timeout_keep_alive=timeout_s)  # type: ignore[arg-type]
    config.load()
    transport, _ = await loop.connect_accepted_socket(lambda: HttpProtocol(config, ServerState(), {}), server_end)
    client_end.setblocking(False)
    answers = []
    for pause in pauses:
        await asyncio.sleep(pause)
        await loop.sock_sendall(client_end, _REQUEST)
        received = b""
        while not received.endswith(b"}"):
            chunk = await asyncio.wait_for(loop.sock_recv(client_end, 65536), 10)
            assert chunk, f"the server closed the connection after {len(answers)} answers"
            received += chunk
        answers.append(received)
    idle_from = loop.time()
    try:
        closed = await asyncio.wait_for(loop.sock_recv(client_end, 65536), 10)
        assert closed == b""
        closed_after: float | None = loop.time() - idle_from
    except TimeoutError:
        closed_after = None
    client_end.close()
    transport.close()
    await asyncio.sleep(0)
    return answers, closed_after, timers


def test_a_kept_alive_connection_closes_once_idle_for_the_timeout_and_not_before() -> None:
    # The first timer fires 2 s after the first answer, while the connection has been idle for 0.8 s only.
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        answers, closed_after, _ = runner.run(_keep_alive_session([0, 1.2, 1.2], 2.0))
    assert len(answers) == 3 and all(answer.endswith(b'{"ok":true}') for answer in answers)
    assert closed_after is not None and 1.9 <= closed_after < 9


def test_a_busy_connection_makes_one_keep_alive_timer_not_one_per_answer() -> None:
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        answers, _, timers = runner.run(_keep_alive_session([0] * 20, 0.5))
    assert len(answers) == 20
    assert timers <= 2, f"{timers} keep-alive timers for 20 answers"


class _CountingApp:
    """`_app` after reading the whole body, counting the requests that reach it and those whose client left while
    it read; with `state.runtime.settings` when given settings."""

    def __init__(self, settings: Any = None) -> None:
        self.calls = self.disconnects = 0
        if settings is not None:
            self.state = SimpleNamespace(runtime=SimpleNamespace(settings=settings))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        self.calls += 1
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnects += 1
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break

        async def whole() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        await _app(scope, whole, send)


_REFUSED_END = b'send fewer or shorter headers"}'


def _headers(total: int) -> bytes:
    """Short headers of about `total` bytes in all."""
    return b"".join(b"x-h%05d: v\r\n" % i for i in range(total // 12))


def _exchange_counted(request: bytes, settings: Any = None, end: bytes = _REFUSED_END) -> tuple[bytes, int]:
    """What arrived for `request` (see `_exchange`), and how many requests reached the app."""
    received, app = _exchange_app(request, settings, end)
    return received, app.calls


def _exchange_app(request: bytes, settings: Any = None, end: bytes = _REFUSED_END) -> tuple[bytes, _CountingApp]:
    app = _CountingApp(settings)
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        _, received = runner.run(_exchange(request, end, app))
    return received, app


def test_a_head_over_the_limit_is_refused_with_431_and_never_reaches_the_app() -> None:
    # 80 KB of headers, then a body, all in one send: the head is measured where it ends, not with the body.
    request = b"POST /infer HTTP/1.1\r\nhost: x\r\n" + _headers(80_000) + b"content-length: 2\r\n\r\n{}"
    received, calls = _exchange_counted(request)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ") and b"connection: close" in head
    assert "65536 bytes (max_header_bytes)" in json.loads(body)["error"]
    assert calls == 0


def test_a_header_still_growing_is_refused_before_it_ends() -> None:
    # The head never ends: without a limit, the server would keep every byte of it and never answer.
    received, calls = _exchange_counted(b"GET / HTTP/1.1\r\nhost: x\r\nx-long: " + b"a" * 400_000)
    assert received.startswith(b"HTTP/1.1 431 ") and received.endswith(_REFUSED_END)
    assert calls == 0


def test_a_head_under_the_limit_is_served_with_a_large_body_in_the_same_read() -> None:
    body = b'"' + b"a" * 300_000 + b'"'
    request = b"POST /infer HTTP/1.1\r\nhost: x\r\n" + _headers(60_000) + b"content-length: %d\r\n\r\n" % len(body)
    received, calls = _exchange_counted(request + body, end=b'{"ok":true}')
    assert received.startswith(b"HTTP/1.1 200 ") and received.endswith(b'{"ok":true}')
    assert calls == 1


def test_the_head_limit_is_the_apps_max_header_bytes() -> None:
    request = b"GET / HTTP/1.1\r\nhost: x\r\n" + _headers(3_000) + b"\r\n"
    received, calls = _exchange_counted(request, Settings(max_header_bytes=2048))
    assert received.startswith(b"HTTP/1.1 431 ") and b"2048 bytes (max_header_bytes)" in received
    assert calls == 0
    received, calls = _exchange_counted(request, end=b'{"ok":true}')  # the default limit
    assert received.startswith(b"HTTP/1.1 200 ") and calls == 1


def test_a_head_still_coming_after_header_timeout_s_is_refused_with_408() -> None:
    # A header now and then would keep the connection for as long as the client liked: a head has a deadline.
    received, calls = _exchange_counted(
        b"GET / HTTP/1.1\r\nhost: x\r\n", Settings(header_timeout_s=0.3), end=b'(header_timeout_s)"}'
    )
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head
    assert "within 0.3 s" in json.loads(body)["error"]
    assert calls == 0


async def _paced(app: Any, pieces: list[tuple[float, bytes]], answers: int) -> list[bytes]:
    """Send each piece after its pause on one connection served by HttpProtocol over `app`; `answers` answers."""
    loop = asyncio.get_running_loop()
    server_end, client_end = socket.socketpair()
    config = Config(app, log_level="warning", lifespan="off")
    config.load()
    transport, _ = await loop.connect_accepted_socket(lambda: HttpProtocol(config, ServerState(), {}), server_end)
    client_end.setblocking(False)
    for pause, piece in pieces:
        await asyncio.sleep(pause)
        await loop.sock_sendall(client_end, piece)
    received = b""
    while received.count(b"HTTP/1.1 ") < answers or not received.endswith(b"}"):
        chunk = await asyncio.wait_for(loop.sock_recv(client_end, 65536), 10)
        assert chunk, f"the server closed the connection: {received!r}"
        received += chunk
    client_end.close()
    transport.close()
    await asyncio.sleep(0)
    return [b"HTTP/1.1 " + answer for answer in received.split(b"HTTP/1.1 ")[1:]]


def test_a_slow_head_within_header_timeout_s_and_an_idle_connection_past_it_are_served() -> None:
    # The head arrives in pieces within the timeout; then the kept-alive connection idles for longer than the
    # timeout (idle is the keep-alive timeout's business) before the next request.
    pieces = [(0.0, b"POST /infer HTTP/1.1\r\n"), (0.15, b"host: x\r\n"), (0.15, b"content-length: 2\r\n\r\n{}")]
    pieces += [(0.6, _REQUEST)]
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        answers = runner.run(_paced(_CountingApp(Settings(header_timeout_s=0.4)), pieces, 2))
    assert len(answers) == 2 and all(a.startswith(b"HTTP/1.1 200 ") and a.endswith(b'{"ok":true}') for a in answers)


def test_bytes_that_are_not_http_get_a_400_naming_what_the_parser_found() -> None:
    # Content-Length beside Transfer-Encoding: the request smuggling shape; refused before the app sees it.
    request = b"POST /infer HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
    received, calls = _exchange_counted(request, end=b'"}')
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"connection: close" in head
    assert (
        json.loads(body)["error"]
        == "malformed HTTP/1.1 request: Transfer-Encoding can't be present with Content-Length"
    )
    assert calls == 0


def test_a_malformed_body_is_answered_once_and_its_route_sees_the_client_gone() -> None:
    request = b"POST /infer HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"
    received, app = _exchange_app(request, end=b"never: until the server closes")
    assert received.count(b"\r\n\r\n") == 1 and received.startswith(b"HTTP/1.1 400 ")
    assert b"Invalid character in chunk size" in received
    assert (app.calls, app.disconnects) == (1, 1)  # its head was fine: its read ended with the client gone


def test_a_callback_that_fails_is_a_500_and_logged(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def failing(self: HttpProtocol, cycle: Any, app: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(HttpProtocol, "_start_asgi_task", failing)
    received, calls = _exchange_counted(_REQUEST, end=b'"}')
    assert received.startswith(b"HTTP/1.1 500 ") and b"internal error" in received
    assert calls == 0
    logged = capsys.readouterr().err  # uvicorn's loggers write there and do not propagate
    assert "HTTP request parse failed in a callback" in logged and "RuntimeError: a bug" in logged


def test_a_body_that_stops_for_body_timeout_s_is_refused_with_408_and_its_route_sees_the_client_gone() -> None:
    # A complete head, then a body that stops: without a deadline, the connection would be held forever.
    request = b"POST /infer HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n{}"
    received, app = _exchange_app(request, Settings(body_timeout_s=0.3), end=b'(body_timeout_s)"}')
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head
    assert "no byte of it came for 0.3 s" in json.loads(body)["error"]
    assert (app.calls, app.disconnects) == (1, 1)  # its route's read ended with the client gone: no second answer


def test_a_slow_body_that_keeps_coming_is_served() -> None:
    body = b'"' + b"a" * 8 + b'"'
    pieces = [(0.0, b"POST /infer HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body))]
    pieces += [(0.2, body[i : i + 2]) for i in range(0, len(body), 2)]  # 1 s in all, a piece every 0.2 s
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        answers = runner.run(_paced(_CountingApp(Settings(body_timeout_s=0.4, header_timeout_s=0.4)), pieces, 1))
    assert len(answers) == 1 and answers[0].startswith(b"HTTP/1.1 200 ")


_CHUNKED = b"POST /infer HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n"


def _paced_answer(settings: Settings, pieces: list[tuple[float, bytes]]) -> tuple[bytes, dict[str, Any]]:
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        (answer,) = runner.run(_paced(_CountingApp(settings), pieces, 1))
    head, _, body = answer.partition(b"\r\n\r\n")
    return head, json.loads(body)


def test_a_chunked_bodys_trailer_fields_count_as_headers() -> None:
    # uvicorn appended every trailer field to the request's headers, without a limit.
    trailers = _headers(3_000) + b"\r\n"
    head, error = _paced_answer(Settings(max_header_bytes=2048), [(0.0, _CHUNKED), (0.05, trailers)])
    assert head.startswith(b"HTTP/1.1 431 ") and "trailer fields count as headers" in error["error"]


def test_a_trailer_field_that_never_ends_is_refused_with_413() -> None:
    # httptools keeps a field's pieces until it ends: the bytes of a body, its framing and trailers are bounded.
    settings = Settings(max_body_bytes=4096, max_header_bytes=2048)
    head, error = _paced_answer(settings, [(0.0, _CHUNKED), (0.05, b"x-t: " + b"a" * 10_000)])
    assert head.startswith(b"HTTP/1.1 413 ") and "(max_body_bytes + max_header_bytes)" in error["error"]


async def _slow_app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "http" and scope["path"] == "/slow":
        await asyncio.sleep(0.3)
    await _app(scope, receive, send)


def test_a_malformed_request_pipelined_behind_one_in_flight_never_answers_in_its_place() -> None:
    slow = b"POST /slow HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"
    bad = b"POST /infer HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        _, received = runner.run(_exchange(slow + bad, b"never: until the server closes", _slow_app))
    assert b" 400 " not in received  # the 400 would have been taken for the slow request's answer


async def _echo_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers the request's path and body, read whole."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    answer = json.dumps({"path": scope["path"], "body": body.decode()}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


def test_a_request_asking_for_an_upgrade_is_answered_over_http_with_its_body() -> None:
    # `curl --http2 -d ...` on http:// sends `Upgrade: h2c` with its POST; httptools ends such a request at its
    # head and leaves the body to the new protocol: the route got an empty body, and the body's bytes were then
    # parsed as the next request. A WebSocket handshake was answered 403 with no body.
    body = b"x" * 3000
    upgrade = b"POST /h2c HTTP/1.1\r\nhost: x\r\nupgrade: h2c\r\nconnection: Upgrade, HTTP2-Settings\r\n"
    upgrade += b"http2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\ncontent-length: %d\r\n\r\n" % len(body)
    websocket = b"GET /ws HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
    websocket += b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n"
    after = b"POST /after HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nok"
    # The body in three reads, the last with the requests pipelined after it.
    pieces = [(0.0, upgrade + body[:1000]), (0.05, body[1000:2000]), (0.05, body[2000:] + websocket + after)]
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        answers = runner.run(_paced(_echo_app, pieces, 3))
    heads, bodies = zip(*(answer.partition(b"\r\n\r\n")[::2] for answer in answers), strict=True)
    assert all(head.startswith(b"HTTP/1.1 200 ") and b"connection: close" not in head for head in heads)
    assert [json.loads(b) for b in bodies] == [
        {"path": "/h2c", "body": body.decode()}, {"path": "/ws", "body": ""}, {"path": "/after", "body": "ok"}
    ]  # fmt: skip


def test_a_request_asking_for_an_upgrade_with_a_chunked_body_is_refused() -> None:
    request = b"POST /h2c HTTP/1.1\r\nhost: x\r\nupgrade: h2c\r\nconnection: Upgrade\r\n"
    request += b"transfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    received, app = _exchange_app(request, end=b"never: until the server closes")
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"connection: close" in head
    assert "with Content-Length" in json.loads(body)["error"]
    assert (app.calls, app.disconnects) == (1, 1)  # its route's read ended with the client gone
