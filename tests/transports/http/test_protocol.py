"""HttpProtocol, the HTTP door's own connection, tested as uvicorn tests its protocols: bytes fed to the protocol, a
mock transport recording what it writes, a clock the test moves (timeouts without sleeping), and the request tasks
awaited (no sleeps).

Over a real socket and against the real app: test_model_lane.py, test_hardening.py, and every route's tests."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from layerserve.settings import Settings
from layerserve.transports.http.door import limits_of
from layerserve.transports.http.protocol import PARSE_SLICE_BYTES, DoorState, HttpProtocol

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
_OK = b'{"ok":true}'
_REQUEST = b"POST /infer HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"


class MockTransport:
    """Records every write call (one entry per `write` or `writelines`); closing, pausing and EOF as flags."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.read_paused = self.eof_written = self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def writelines(self, chunks: Any) -> None:
        self.writes.append(b"".join(bytes(chunk) for chunk in chunks))

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.read_paused = True

    def resume_reading(self) -> None:
        self.read_paused = False

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    @property
    def received(self) -> bytes:
        """Everything written, as the client would read it."""
        return b"".join(self.writes)


class _Timer:
    def __init__(self, when: float, callback: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.when, self.callback, self.args, self.cancelled = when, callback, args, False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClockLoop:
    """The running loop, but for time: `time()` and `call_later` run on a clock the test moves with `advance`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.now = 1000.0
        self.timers: list[_Timer] = []

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[..., None], *args: Any) -> _Timer:
        timer = _Timer(self.now + delay, callback, args)
        self.timers.append(timer)
        return timer

    def advance(self, seconds: float) -> None:
        """Move the clock, firing every timer due on the way, in order."""
        end = self.now + seconds
        while True:
            due = sorted((t for t in self.timers if not t.cancelled and t.when <= end), key=lambda t: t.when)
            if not due:
                break
            timer = due[0]
            self.timers.remove(timer)
            self.now = max(self.now, timer.when)
            timer.callback(*timer.args)
        self.now = end

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)


class Connection:
    """One protocol over a mock transport, and the means to drive it."""

    def __init__(self, app: App, settings: Settings) -> None:
        self.loop = FakeClockLoop(asyncio.get_running_loop())
        self.state = DoorState(app, None, limits_of(settings))
        self.protocol = HttpProtocol(self.state, self.loop)  # type: ignore[arg-type]
        self.transport = MockTransport()
        self.protocol.connection_made(self.transport)  # type: ignore[arg-type]

    def send(self, data: bytes) -> None:
        self.protocol.data_received(data)

    async def settle(self) -> None:
        """Run the request tasks until none is left (a pipelined request starts when the one before answers)."""
        for _ in range(100):
            if not self.state.tasks:
                return
            await asyncio.wait(list(self.state.tasks))
        raise AssertionError("requests still running after 100 rounds")

    async def answers(self, data: bytes) -> bytes:
        """Send `data` (if any), let the requests run, and what the client received."""
        if data:
            self.send(data)
        await self.settle()
        return self.transport.received


def _settings(**values: Any) -> Settings:
    return Settings(model_repository=".", **values)


def _connection(app: App | None = None, **values: Any) -> Connection:
    return Connection(app or ok_app, _settings(**values))


async def read_body(receive: Any) -> bytes:
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionResetError
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def ok_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await read_body(receive)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(_OK))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": _OK})


class CountingApp:
    """`ok_app`, counting the requests that reach it and those whose client left while it read the body."""

    def __init__(self) -> None:
        self.calls = self.disconnects = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.calls += 1
        try:
            await read_body(receive)
        except ConnectionResetError:
            self.disconnects += 1
            return
        await ok_app(scope, _replay(b""), send)


def _replay(body: bytes) -> Any:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


async def echo_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers the request's path and body."""
    body = await read_body(receive)
    answer = json.dumps({"path": scope["path"], "body": body.decode()}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


def _split(received: bytes) -> list[tuple[bytes, bytes]]:
    """The answers in what was received: (head, body), bodies framed by Content-Length."""
    answers = []
    while received:
        head, _, rest = received.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.startswith(b"content-length"))
        answers.append((head, rest[:length]))
        received = rest[length:]
    return answers


def _headers(total: int) -> bytes:
    """Short headers of about `total` bytes in all."""
    return b"".join(b"x-h%05d: v\r\n" % i for i in range(total // 12))


pytestmark = pytest.mark.anyio


async def test_an_answer_leaves_in_one_write() -> None:
    connection = _connection()
    received = await connection.answers(_REQUEST)
    assert len(connection.transport.writes) == 1
    assert received.startswith(b"HTTP/1.1 200 OK\r\nserver: layerserve\r\n") and received.endswith(b"\r\n\r\n" + _OK)
    assert not connection.transport.closed


async def test_a_closing_answer_is_whole_and_then_the_connection_closes() -> None:
    connection = _connection()
    received = await connection.answers(_REQUEST.replace(b"host: x\r\n", b"host: x\r\nconnection: close\r\n"))
    assert len(connection.transport.writes) == 1 and b"connection: close\r\n" in received
    assert received.endswith(_OK) and connection.transport.closed


async def test_a_streamed_answer_is_chunked_in_order_and_an_http_10_client_is_closed_after_it() -> None:
    async def streaming(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"one,", "more_body": True})
        await send({"type": "http.response.body", "body": b"two"})

    connection = _connection(streaming)
    received = await connection.answers(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
    assert b"transfer-encoding: chunked\r\n" in received
    assert received.endswith(b"\r\n\r\n4\r\none,\r\n3\r\ntwo\r\n0\r\n\r\n")  # every chunk, then the end
    assert len(connection.transport.writes) == 2  # the head went with the first piece
    old = _connection(streaming)
    await old.answers(b"GET /stream HTTP/1.0\r\n\r\n")
    assert old.transport.closed and b"connection: close\r\n" in old.transport.received


async def test_head_requests_get_the_length_but_no_body() -> None:
    connection = _connection()
    received = await connection.answers(b"HEAD / HTTP/1.1\r\nhost: x\r\n\r\n")
    assert received.startswith(b"HTTP/1.1 200 ") and b"content-length: 11\r\n" in received
    assert received.endswith(b"\r\n\r\n")


async def test_pipelined_requests_are_answered_in_order_one_at_a_time() -> None:
    gate, started = asyncio.Event(), []

    async def gated(scope: dict[str, Any], receive: Any, send: Any) -> None:
        started.append(scope["path"])
        if scope["path"] == "/first":
            await gate.wait()
        await echo_app(scope, receive, send)

    connection = _connection(gated)
    first = b"POST /first HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n\r\na"
    connection.send(first + first.replace(b"/first", b"/second").replace(b"\r\na", b"\r\nb"))
    await asyncio.sleep(0)  # the first request's task starts (a yield to the loop, not a wait)
    assert started == ["/first"] and connection.transport.read_paused  # the second waits for the first's answer
    gate.set()
    await connection.settle()
    answers = [json.loads(body) for _, body in _split(connection.transport.received)]
    assert answers == [{"path": "/first", "body": "a"}, {"path": "/second", "body": "b"}]
    assert not connection.transport.read_paused


async def test_an_idle_connection_closes_after_the_keep_alive_timeout_with_one_timer_for_many_answers() -> None:
    connection = _connection(keep_alive_timeout_s=2)
    for _ in range(3):
        await connection.answers(_REQUEST)
        connection.loop.advance(1.2)  # idle for less than the timeout before each next request
    assert not connection.transport.closed and len(_split(connection.transport.received)) == 3
    made = len(connection.loop.timers) + sum(1 for t in connection.loop.timers if t.cancelled)
    busy = _connection(keep_alive_timeout_s=2)
    for _ in range(20):
        await busy.answers(_REQUEST)
    keep_alive = [t for t in busy.loop.timers if "keep_alive" in t.callback.__name__]
    assert len(keep_alive) == 1, f"{len(keep_alive)} keep-alive timers for 20 answers"
    assert made >= 1
    connection.loop.advance(0.9)  # 2.1 s idle since the last answer
    assert connection.transport.closed


async def test_a_head_over_the_limit_is_refused_with_431_and_never_reaches_the_app() -> None:
    # 80 KB of headers, then a body, all in one read: the head is measured where it ends, not with the body.
    app = CountingApp()
    connection = Connection(app, _settings())
    received = await connection.answers(
        b"POST /infer HTTP/1.1\r\nhost: x\r\n" + _headers(80_000) + b"content-length: 2\r\n\r\n{}"
    )
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ") and b"connection: close" in head and connection.transport.eof_written
    assert "65536 bytes (max_header_bytes)" in json.loads(body)["error"] and app.calls == 0
    connection.send(b"more bytes the client still sends")  # dropped unread until the connection closes
    connection.loop.advance(2.0)
    assert connection.transport.closed and connection.transport.received == received


async def test_a_header_still_growing_is_refused_before_it_ends_and_the_limit_is_max_header_bytes() -> None:
    app = CountingApp()
    growing = Connection(app, _settings())
    received = await growing.answers(b"GET / HTTP/1.1\r\nhost: x\r\nx-long: " + b"a" * 400_000)
    assert received.startswith(b"HTTP/1.1 431 ") and app.calls == 0
    small = Connection(app, _settings(max_header_bytes=2048))
    request = b"GET / HTTP/1.1\r\nhost: x\r\n" + _headers(3_000) + b"\r\n"
    assert (await small.answers(request)).startswith(b"HTTP/1.1 431 ") and b"2048 bytes" in small.transport.received
    assert (await Connection(app, _settings()).answers(request)).startswith(b"HTTP/1.1 200 ") and app.calls == 1


async def test_a_head_under_the_limit_is_served_with_a_large_body_in_the_same_read() -> None:
    body = b'"' + b"a" * 300_000 + b'"'
    connection = Connection(echo_app, _settings())
    received = await connection.answers(
        b"POST /x HTTP/1.1\r\nhost: x\r\n" + _headers(60_000) + b"content-length: %d\r\n\r\n" % len(body) + body
    )
    assert received.startswith(b"HTTP/1.1 200 ") and json.loads(_split(received)[0][1])["body"] == body.decode()


async def test_a_head_still_coming_after_header_timeout_s_is_refused_with_408() -> None:
    app = CountingApp()
    connection = Connection(app, _settings(header_timeout_s=0.3))
    connection.send(b"GET / HTTP/1.1\r\nhost: x\r\n")
    connection.loop.advance(0.29)
    assert connection.transport.received == b""
    connection.loop.advance(0.3)  # (the read timer fires at least every header_timeout_s)
    head, _, body = connection.transport.received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head
    assert "within 0.3 s" in json.loads(body)["error"] and app.calls == 0


async def test_a_slow_head_within_header_timeout_s_and_an_idle_connection_past_it_are_served() -> None:
    connection = Connection(ok_app, _settings(header_timeout_s=0.4))
    for piece in (b"POST /infer HTTP/1.1\r\n", b"host: x\r\n", b"content-length: 2\r\n\r\n{}"):
        connection.send(piece)
        connection.loop.advance(0.15)
    await connection.settle()
    connection.loop.advance(0.6)  # idle: the keep-alive timeout's business, not the head's
    await connection.answers(_REQUEST)
    assert [head[:13] for head, _ in _split(connection.transport.received)] == [b"HTTP/1.1 200 "] * 2


async def test_a_body_that_stops_for_body_timeout_s_is_408_and_its_route_sees_the_client_gone() -> None:
    app = CountingApp()
    connection = Connection(app, _settings(body_timeout_s=0.3))
    connection.send(b"POST /infer HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n{}")
    await asyncio.sleep(0)  # the route starts and waits for the rest of the body
    connection.loop.advance(0.61)
    await connection.settle()
    head, _, body = connection.transport.received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and "no byte of it came for 0.3 s" in json.loads(body)["error"]
    assert (app.calls, app.disconnects) == (1, 1)  # its read ended with the client gone: no second answer


async def test_a_slow_body_that_keeps_coming_is_served() -> None:
    connection = Connection(echo_app, _settings(body_timeout_s=0.4, header_timeout_s=0.4))
    body = b"a" * 10
    connection.send(b"POST /slow HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n")
    for start in range(0, 10, 2):  # 1 s in all, a piece every 0.2 s
        connection.loop.advance(0.2)
        connection.send(body[start : start + 2])
        await asyncio.sleep(0)
    await connection.settle()
    assert json.loads(_split(connection.transport.received)[0][1]) == {"path": "/slow", "body": "a" * 10}


async def test_bytes_that_are_not_http_get_a_400_naming_what_the_parser_found() -> None:
    # Content-Length beside Transfer-Encoding: the request smuggling shape; refused before the app sees it.
    app = CountingApp()
    connection = Connection(app, _settings())
    received = await connection.answers(
        b"POST /infer HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
    )
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and app.calls == 0
    assert json.loads(body)["error"] == (
        "malformed HTTP/1.1 request: Transfer-Encoding can't be present with Content-Length"
    )


async def test_a_malformed_body_is_answered_once_and_its_route_sees_the_client_gone() -> None:
    app = CountingApp()
    connection = Connection(app, _settings())
    received = await connection.answers(
        b"POST /infer HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"
    )
    assert received.count(b"\r\n\r\n") == 1 and received.startswith(b"HTTP/1.1 400 ")
    assert b"Invalid character in chunk size" in received and (app.calls, app.disconnects) == (1, 1)


async def test_a_callback_that_fails_is_a_500_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def failing(self: HttpProtocol, cycle: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(HttpProtocol, "_start", failing)
    with caplog.at_level(logging.ERROR, "layerserve.transports.http"):
        received = await _connection().answers(_REQUEST)
    assert received.startswith(b"HTTP/1.1 500 ") and b"internal error" in received
    (record,) = [r for r in caplog.records if "parse failed in a callback" in r.getMessage()]
    assert record.exc_info is not None and "a bug" in str(record.exc_info[1])


async def test_an_app_that_fails_is_a_500_and_one_that_fails_mid_answer_closes_the_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def failing(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["path"] == "/late":
            await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("a bug")

    with caplog.at_level(logging.ERROR, "layerserve.transports.http"):
        early = _connection(failing)
        assert (await early.answers(_REQUEST)).startswith(b"HTTP/1.1 500 ") and early.transport.closed
        late = _connection(failing)
        await late.answers(_REQUEST.replace(b"/infer", b"/late"))
    assert late.transport.closed and b" 500 " not in late.transport.received
    assert len([r for r in caplog.records if "the ASGI app failed" in r.getMessage()]) == 2


_CHUNKED = b"POST /infer HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n"


async def test_a_chunked_bodys_trailer_fields_count_as_headers_and_a_trailer_that_never_ends_is_413() -> None:
    counted = Connection(CountingApp(), _settings(max_header_bytes=2048))
    counted.send(_CHUNKED)
    received = await counted.answers(_headers(3_000) + b"\r\n")
    assert received.startswith(b"HTTP/1.1 431 ") and b"trailer fields count as headers" in received
    endless = Connection(CountingApp(), _settings(max_body_bytes=4096, max_header_bytes=2048))
    endless.send(_CHUNKED)
    received = await endless.answers(b"x-t: " + b"a" * 10_000)
    assert received.startswith(b"HTTP/1.1 413 ") and b"(max_body_bytes + max_header_bytes)" in received


async def test_a_malformed_request_pipelined_behind_one_in_flight_never_answers_in_its_place() -> None:
    gate = asyncio.Event()

    async def slow(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await gate.wait()
        await ok_app(scope, receive, send)

    connection = _connection(slow)
    connection.send(_REQUEST + b"POST /infer HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n")
    assert connection.transport.closed  # no answer for the bad one could go before the one in flight
    gate.set()
    await connection.settle()
    assert b" 400 " not in connection.transport.received


async def test_a_request_asking_for_an_upgrade_is_answered_over_http_with_its_body() -> None:
    # `curl --http2 -d ...` on http:// sends `Upgrade: h2c` with its POST; httptools ends such a request at its
    # head and leaves the body to the new protocol.
    body = b"x" * 3000
    upgrade = b"POST /h2c HTTP/1.1\r\nhost: x\r\nupgrade: h2c\r\nconnection: Upgrade, HTTP2-Settings\r\n"
    upgrade += b"http2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\ncontent-length: %d\r\n\r\n" % len(body)
    websocket = b"GET /ws HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
    websocket += b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n"
    after = b"POST /after HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nok"
    connection = _connection(echo_app)
    for piece in (upgrade + body[:1000], body[1000:2000], body[2000:] + websocket + after):  # three reads
        connection.send(piece)
    await connection.settle()
    answers = _split(connection.transport.received)
    assert all(head.startswith(b"HTTP/1.1 200 ") and b"connection: close" not in head for head, _ in answers)
    assert [json.loads(b) for _, b in answers] == [
        {"path": "/h2c", "body": body.decode()}, {"path": "/ws", "body": ""}, {"path": "/after", "body": "ok"}
    ]  # fmt: skip


async def test_a_request_asking_for_an_upgrade_with_a_chunked_body_is_refused() -> None:
    app = CountingApp()
    connection = Connection(app, _settings())
    received = await connection.answers(
        b"POST /h2c HTTP/1.1\r\nhost: x\r\nupgrade: h2c\r\nconnection: Upgrade\r\n"
        b"transfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    )
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and "with Content-Length" in json.loads(body)["error"]
    assert (app.calls, app.disconnects) == (1, 1)


async def test_a_client_that_leaves_before_its_answer_has_its_request_cancelled() -> None:
    cancelled = []

    async def waits(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await read_body(receive)
        try:
            await asyncio.Event().wait()  # a queue that never moves
        except asyncio.CancelledError:
            cancelled.append(scope["path"])
            raise

    connection = _connection(waits)
    connection.send(_REQUEST)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    connection.protocol.connection_lost(None)
    await connection.settle()
    assert cancelled == ["/infer"] and connection.transport.received == b""


async def test_100_continue_is_sent_when_the_app_reads_the_body() -> None:
    connection = _connection(echo_app)
    connection.send(b"POST /c HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n")
    await asyncio.sleep(0)
    assert connection.transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    received = await connection.answers(b"hi")
    assert json.loads(_split(received.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n"))[0][1])["body"] == "hi"


async def test_a_body_past_the_high_water_mark_pauses_reading_until_the_app_takes_it() -> None:
    taken = asyncio.Event()
    go = asyncio.Event()

    async def slow_reader(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await go.wait()
        body = await read_body(receive)
        taken.set()
        await ok_app(scope, _replay(body), send)

    connection = _connection(slow_reader)
    connection.send(b"POST /big HTTP/1.1\r\nhost: x\r\ncontent-length: 200000\r\n\r\n" + b"a" * 100_000)
    assert connection.transport.read_paused
    go.set()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not connection.transport.read_paused  # the app asked for more
    await connection.answers(b"a" * 100_000)
    assert taken.is_set() and connection.transport.received.startswith(b"HTTP/1.1 200 ")


async def test_shutdown_closes_an_idle_connection_now_and_a_busy_one_after_its_answer() -> None:
    idle = _connection()
    await idle.answers(_REQUEST)
    idle.protocol.shutdown()
    assert idle.transport.closed
    gate = asyncio.Event()

    async def slow(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await gate.wait()
        await ok_app(scope, receive, send)

    busy = _connection(slow)
    busy.send(_REQUEST)
    busy.protocol.shutdown()
    assert not busy.transport.closed
    gate.set()
    received = await busy.answers(b"")
    assert busy.transport.closed and received.endswith(_OK) and b"connection: close" in received


async def test_a_connection_that_sends_nothing_closes_after_the_head_or_keep_alive_timeout() -> None:
    silent = _connection(header_timeout_s=5, keep_alive_timeout_s=20)
    silent.loop.advance(4.9)
    assert not silent.transport.closed
    silent.loop.advance(0.2)
    assert silent.transport.closed and silent.transport.received == b""  # nothing to answer: closed quietly
    shorter = _connection(header_timeout_s=30, keep_alive_timeout_s=3)
    shorter.loop.advance(3.1)
    assert shorter.transport.closed
    talking = _connection(header_timeout_s=5, keep_alive_timeout_s=20)
    talking.loop.advance(4)
    await talking.answers(_REQUEST)
    talking.loop.advance(19)  # from its answer on, the keep-alive timeout
    assert not talking.transport.closed
    talking.loop.advance(1.1)
    assert talking.transport.closed


@pytest.mark.parametrize(
    ("head", "error"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", "an HTTP/1.1 request needs exactly one Host header, got 0"),
        (b"GET / HTTP/1.1\r\nhost: a\r\nHost: b\r\n\r\n", "an HTTP/1.1 request needs exactly one Host header, got 2"),
        (b"GET / HTTP/1.0\r\nhost: a\r\nhost: a\r\n\r\n", "an HTTP/1.0 request needs exactly one Host header, got 2"),
    ],
)
async def test_a_request_without_exactly_one_host_is_400_and_closes(head: bytes, error: str) -> None:
    app = CountingApp()
    connection = Connection(app, _settings())
    received = await connection.answers(head)
    answer_head, _, body = received.partition(b"\r\n\r\n")
    assert answer_head.startswith(b"HTTP/1.1 400 ") and b"connection: close" in answer_head
    assert json.loads(body) == {"error": error} and app.calls == 0


async def test_an_http_10_request_may_omit_host() -> None:
    received = await _connection().answers(b"GET / HTTP/1.0\r\n\r\n")
    assert received.startswith(b"HTTP/1.1 200 ")


async def test_pipelined_input_is_parsed_a_slice_at_a_time_while_requests_wait() -> None:
    gate = asyncio.Event()

    async def gated(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await gate.wait()
        await echo_app(scope, receive, send)

    connection = _connection(gated)
    request = b"POST /p HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n\r\na"
    connection.send(request * 2_000)  # 106 KB of requests in one read
    await asyncio.sleep(0)
    protocol = connection.protocol
    assert 0 < len(protocol._pipeline) <= PARSE_SLICE_BYTES // len(request) and connection.transport.read_paused
    assert len(protocol._unparsed) > len(request) * 1_600  # held as bytes, not as requests
    gate.set()
    for _ in range(3_000):  # (one request at a time: a round each)
        if connection.state.tasks:
            await asyncio.wait(list(connection.state.tasks))
    assert len(_split(connection.transport.received)) == 2_000 and not connection.transport.read_paused


async def test_no_request_starts_while_the_client_leaves_its_answers_unread() -> None:
    connection = _connection(ok_app, keep_alive_timeout_s=10)
    protocol, transport = connection.protocol, connection.transport
    write = transport.writelines

    def fills(chunks: Any) -> None:  # the client reads nothing: every answer fills the transport's buffer
        write(chunks)
        protocol.pause_writing()

    transport.writelines = fills  # type: ignore[method-assign]
    connection.send(_REQUEST * 3)
    await connection.settle()
    assert len(_split(transport.received)) == 1 and transport.read_paused
    protocol.resume_writing()  # it read: the next answer starts (and fills the buffer again)
    await connection.settle()
    assert len(_split(transport.received)) == 2 and transport.read_paused
    connection.loop.advance(10.1)  # its answers unread for the keep-alive timeout: dropped
    assert transport.aborted


async def test_an_answer_sent_in_pieces_to_a_client_that_never_reads_is_dropped_after_the_keep_alive_timeout() -> None:
    sent: list[bytes] = []

    async def pieces_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for _ in range(3):
            await send({"type": "http.response.body", "body": b"x" * 1000, "more_body": True})
            sent.append(b"x")
        await send({"type": "http.response.body", "body": b""})

    connection = _connection(pieces_app, keep_alive_timeout_s=10)
    protocol, transport = connection.protocol, connection.transport
    write, writelines = transport.write, transport.writelines

    def fills(data: bytes) -> None:  # the client reads nothing: every piece fills the transport's buffer
        write(data)
        protocol.pause_writing()

    def fills_lines(chunks: Any) -> None:
        writelines(chunks)
        protocol.pause_writing()

    transport.write, transport.writelines = fills, fills_lines  # type: ignore[method-assign]
    connection.send(_REQUEST)
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(sent) == 1 and not transport.aborted  # the second piece waits for the client to read
    connection.loop.advance(9.9)
    assert not transport.aborted
    connection.loop.advance(0.2)  # none of it read for the keep-alive timeout: dropped
    assert transport.aborted
    protocol.connection_lost(None)  # as the transport then says: the app's writer goes on, and its task ends
    await connection.settle()
    assert not connection.state.tasks


async def test_a_pipelined_request_read_whole_keeps_what_came_before_it_started() -> None:
    connection = _connection(echo_app)
    first = b"POST /1 HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n\r\na"
    connection.send(first + b"POST /2 HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n\r\nbc")
    cycle = connection.protocol._pipeline[0]
    cycle.whole_body = True  # as the lane does when it starts a request it reads whole
    connection.send(b"de")
    answers = [json.loads(body) for _, body in _split(await connection.answers(b""))]
    assert answers == [{"path": "/1", "body": "a"}, {"path": "/2", "body": "bcde"}]


async def test_refusals_are_logged_at_debug_and_counted_in_a_warning_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    state = _connection().state
    with caplog.at_level(logging.DEBUG, "layerserve.transports.http"):
        for second in range(130):
            Connection(ok_app, _settings()).send(b"BAD\r\n\r\n") if second == 0 else None
            state.refused(1000.0 + second, 400, "bad")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4  # the other connection's, then this door's at 0, 60 and 120 s
    assert warnings[2] == "Request refused (400): bad (60 refused since the last such line; each at debug)"
    assert len([r for r in caplog.records if r.levelno == logging.DEBUG]) == 131
