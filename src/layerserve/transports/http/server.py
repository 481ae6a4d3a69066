"""How uvicorn runs the app: its options (`uvicorn_options`) and HttpProtocol, uvicorn's httptools protocol whose
answers leave in one send instead of two, and which answers a model's requests below ASGI (direct_lane.py).

uvicorn writes an answer's status line and headers as soon as the app sends `http.response.start`, then the body
at `http.response.body`: two `send` system calls, and on loopback two TCP segments, per answer; for a small model
they were the largest single cost of a request (docs/design.md). `CoalescingTransport` holds a write until the
next one, or until the event loop's next turn if none comes first, and sends both with one `writelines` (one
`writev` in uvloop).

httptools keeps a request's headers, and the pieces of a header not yet ended, in memory until its head ends, and
uvicorn keeps them as a list: 24 MB of short headers on one connection held 250 MB of the server until the client
ended them. `HttpProtocol` answers 431 to a head past `max_header_bytes` (a chunked body's trailer fields, which
uvicorn added to the headers, count too) and closes its connection; 413 to a body whose bytes with their chunk
framing and trailers pass `max_body_bytes` + `max_header_bytes`; 400 with the parser's reason to bytes that are
not HTTP/1.1; and 408 to a head
still coming `header_timeout_s` after its first byte (a client sending a header byte now and then kept its
connection, and a file descriptor, for as long as it liked: the keep-alive timeout counts idle connections only);
and 408 to a body from which nothing came for `body_timeout_s` while the server read it (a complete head, then a
stalled body, held a connection forever too). It speaks HTTP/1.1 only: a request asking for an upgrade (h2c, a
WebSocket) is answered as HTTP/1.1, its body read past httptools, which leaves it to the new protocol.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from layerserve.settings import Settings
from layerserve.transports.http.direct_lane import DirectLane, LaneCall
from layerserve.transports.http.middleware import header_value

# For an app that is not layerserve's:
DEFAULT_MAX_HEADER_BYTES = Settings.model_fields["max_header_bytes"].default
DEFAULT_HEADER_TIMEOUT_S = Settings.model_fields["header_timeout_s"].default
DEFAULT_BODY_TIMEOUT_S = Settings.model_fields["body_timeout_s"].default
DEFAULT_MAX_BODY_BYTES = Settings.model_fields["max_body_bytes"].default
REFUSED_LINGER_S = 2.0  # how long a connection whose head was refused stays open, reading and dropping its bytes


class HeadTooLargeError(Exception):
    """Raised in the parser's callback to stop it at a head (or a chunked body's trailer fields) over the limit."""


class TrailerSink:
    """Where uvicorn's `on_header` puts a chunked body's trailer fields: counted against the head's limit and
    dropped (uvicorn appended them to the request's headers, without a limit; RFC 9110 lets a server discard
    them)."""

    __slots__ = ("limit", "size")

    def __init__(self, limit: int) -> None:
        self.limit, self.size = limit, 0

    def append(self, field: tuple[bytes, bytes]) -> None:
        """Count one trailer field; past the limit, stop the parser."""
        self.size += len(field[0]) + len(field[1]) + 4
        if self.size > self.limit:
            raise HeadTooLargeError


class CoalescingTransport:
    """A transport whose writes leave in pairs: a write waits for the next one, or for the loop's next turn.

    Everything but `write`, `writelines`, `close` and `write_eof` is the wrapped transport's own; those flush the
    held write first, so that nothing is reordered or lost. What uvicorn calls for every request is delegated by a
    method of its own: an attribute found through `__getattr__` first fails the normal lookup, which builds an
    `AttributeError` each time.
    """

    __slots__ = ("_flush_handle", "_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._flush_handle: asyncio.Handle | None = None

    def write(self, data: bytes) -> None:
        """Hold `data` if nothing is held; else send the held data and `data` together."""
        held = self._held
        if held is None:
            self._held = data
            if self._flush_handle is None:
                self._flush_handle = self._loop.call_soon(self._flush_soon)
            return
        self._held = None
        self._transport.writelines((held, data))

    def writelines(self, chunks: Any) -> None:
        """Send what is held, then `chunks`, in one call."""
        held, self._held = self._held, None
        self._transport.writelines((held, *chunks) if held is not None else chunks)

    def flush(self) -> None:
        """Send what is held now."""
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def _flush_soon(self) -> None:
        self._flush_handle = None
        self.flush()

    def is_closing(self) -> bool:
        """Whether the transport is closing (uvicorn asks after every answer: here, not through `__getattr__`)."""
        return self._transport.is_closing()

    def pause_reading(self) -> None:
        """Stop reading from the socket (uvicorn's flow control)."""
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        """Read from the socket again (uvicorn's flow control)."""
        self._transport.resume_reading()

    def write_eof(self) -> None:
        """Flush, then close the write side."""
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        """Flush, then close (the transport sends what it buffered before it closes)."""
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over a `CoalescingTransport` (the server's `http` option); a model's infer,
    classify and features requests go to the app's `DirectLane` instead of through ASGI."""

    _lane: DirectLane | None = None
    _lane_call: LaneCall | None = None  # the connection's lane request now answering (one at a time: see pipeline)
    _max_head_bytes = DEFAULT_MAX_HEADER_BYTES
    _head_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    # Bytes received while a request's head is being read (from the first chunk after the previous message ended;
    # a chunk that ends one message and begins the next counts for neither, at most uvloop's 256 KiB read), and the
    # loop's time at the first of them.
    _head_bytes = 0
    _head_started = 0.0
    _read_timer: asyncio.TimerHandle | None = None  # one per connection, armed while a request is coming
    _reading_head = True
    _body_timeout_s = DEFAULT_BODY_TIMEOUT_S
    # The read timer's longest wait: a body may follow a head before the timer fires.
    _read_check_s = min(DEFAULT_HEADER_TIMEOUT_S, DEFAULT_BODY_TIMEOUT_S)
    _body_since: float | None = None  # while a request's body is coming: the loop's time of its last bytes
    # Bytes received while a body is coming (chunk framing and trailer fields included), and their limit.
    _body_bytes = 0
    _max_body_bytes = DEFAULT_MAX_BODY_BYTES + DEFAULT_MAX_HEADER_BYTES
    _trailers = TrailerSink(DEFAULT_MAX_HEADER_BYTES)  # replaced per connection (connection_made)
    # A request was refused (400, 408, 413, 431, 500): what the client sends is dropped until the close.
    _refused = False
    # Bytes still to come of the body of a request asking for an upgrade, which the parser leaves to the caller.
    _upgrade_body_left: int | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Wrap the connection's transport, then set up the connection as uvicorn does."""
        super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]
        # The app's lane; none when uvicorn wrapped the app (trace logging) or the app is not layerserve's.
        self._lane = getattr(getattr(self.app, "state", None), "direct_lane", None)
        settings = _settings_of(self.app)
        if settings is not None:
            self._max_head_bytes, self._head_timeout_s = settings.max_header_bytes, settings.header_timeout_s
            self._body_timeout_s = settings.body_timeout_s
            self._read_check_s = min(self._head_timeout_s, self._body_timeout_s)
            self._max_body_bytes = settings.max_body_bytes + settings.max_header_bytes
        self._trailers = TrailerSink(self._max_head_bytes)

    def data_received(self, data: bytes) -> None:
        """As uvicorn, but bytes that are not HTTP/1.1 are answered 400 with the parser's reason (uvicorn answered
        "Invalid HTTP request received." in plain text), a request whose head is over `max_header_bytes` 431
        (checked after each chunk is parsed, so a head is refused within one read of the limit, and exactly where
        the head ends within a chunk), one still coming `header_timeout_s` after its first byte 408, as is a body
        from which nothing came for `body_timeout_s`; what the client sends after any of them is dropped unread
        until the connection closes."""
        if self._refused:
            return
        if self._reading_head:
            if not self._head_bytes:  # a head begins
                self._head_started = self.loop.time()
                if self._read_timer is None:
                    self._arm_read_timer(self._read_check_s)
            self._head_bytes += len(data)
        elif self._body_since is not None:
            self._body_since = self.loop.time()
            self._body_bytes += len(data)
            if self._body_bytes > self._max_body_bytes:
                self._refuse(413, self._body_too_large())
                return
        self._idle_since = None  # data came: the connection is not idle (uvicorn's _unset_keepalive_if_required)
        if self._upgrade_body_left is not None:
            self._after_upgrade(data, 0)
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._parse_failed(error)
            return
        except httptools.HttpParserUpgrade as upgrade:
            self._after_upgrade(data, upgrade.args[0])
            return
        if self._reading_head and self._head_bytes > self._max_head_bytes and not self.transport.is_closing():
            self._refuse(431, self._too_large())

    def _should_upgrade(self) -> bool:
        """Never: the app serves no WebSocket route and the server no h2c, so a request's `Upgrade` is ignored
        (RFC 9110 7.8) and the request answered as HTTP/1.1, its body included."""
        return False

    def _after_upgrade(self, data: bytes, parsed: int) -> None:
        """Read on as HTTP/1.1 where the parser stopped after a request asking for an upgrade (at `parsed`, where
        the new protocol's bytes would begin): that request's body, which httptools leaves unparsed for an upgrade
        (see on_message_complete), then the next requests."""
        rest = memoryview(data)[parsed:]
        while rest and not self._refused:
            left = self._upgrade_body_left
            if left is not None:
                piece, rest = rest[:left], rest[left:]
                self._upgrade_body_left = left = left - len(piece)
                self.on_body(bytes(piece))
                if not left:
                    self._upgrade_body_left = None
                    self._message_complete()
                continue
            try:
                self.parser.feed_data(rest)
                return
            except httptools.HttpParserError as error:
                self._parse_failed(error)
            except httptools.HttpParserUpgrade as upgrade:
                rest = rest[upgrade.args[0] :]

    def _parse_failed(self, error: httptools.HttpParserError) -> None:
        """431 for a head (or a chunked body's trailer fields) over the limit; else 400 naming what the parser
        found wrong (uvicorn answered "Invalid HTTP request received." in plain text); a callback's own failure
        other than the parser's (a bug) is logged and answered 500."""
        if self._reading_head and self._head_bytes > self._max_head_bytes:
            self._refuse(431, self._too_large())  # on_headers_complete stopped the parser
            return
        cause = error.__context__ if isinstance(error, httptools.HttpParserCallbackError) else error
        if isinstance(cause, HeadTooLargeError):  # the trailer fields' sink stopped it
            self._refuse(431, f"{self._too_large()} (a chunked body's trailer fields count as headers)")
            return
        if cause is None or isinstance(cause, httptools.HttpParserError):
            self._refuse(400, f"malformed HTTP/1.1 request: {cause or error}")
            return
        self.logger.error("HTTP request parse failed in a callback", exc_info=cause)
        self._refuse(500, "internal error (logged): the request could not be parsed")

    def _body_too_large(self) -> str:
        return (
            f"the request body, with its chunk framing and trailer fields, is over {self._max_body_bytes} bytes "
            "(max_body_bytes + max_header_bytes)"
        )

    def _too_large(self) -> str:
        return (
            f"the request line and headers are over the limit of {self._max_head_bytes} bytes (max_header_bytes); "
            "send fewer or shorter headers"
        )

    def _arm_read_timer(self, delay: float) -> None:
        self._read_timer = self.loop.call_later(delay, self._read_timer_fired)

    def _read_timer_fired(self) -> None:
        """408 if a head has been coming for `header_timeout_s`, or a body has brought nothing for `body_timeout_s`
        (while the server reads it); else the timer again while a request comes.

        One timer per connection, made when a head begins with none armed: not one made and cancelled per
        request. It fires at least every `min(header_timeout_s, body_timeout_s)` while a request comes, so a
        deadline is enforced within that much of its passing."""
        self._read_timer = None
        if self._refused or self.transport.is_closing():
            return
        now = self.loop.time()
        if self._reading_head and self._head_bytes:
            left = self._head_started + self._head_timeout_s - now
            message = (
                f"the request line and headers did not arrive within {self._head_timeout_s:g} s of their first byte "
                "(header_timeout_s)"
            )
        elif self._body_since is not None:
            if self.cycle is not None and self.cycle.response_complete:
                return  # answered without its whole body (a 413 from the header): idle, if anything, from here
            if self.flow.read_paused:  # the server is not reading: the client is not late
                self._body_since = now
            left = self._body_since + self._body_timeout_s - now
            message = f"the request body stopped: no byte of it came for {self._body_timeout_s:g} s (body_timeout_s)"
        else:
            return  # no request coming: the next head arms the timer
        if left > 0:
            self._arm_read_timer(min(left, self._read_check_s))
        else:
            self._refuse(408, message)

    def _refuse(self, status: int, message: str) -> None:
        """A request the connection cannot go on after (a head over the limit or too slow, bytes that are not
        HTTP): `status` with the error, the write side closed, and the connection closed `REFUSED_LINGER_S`
        later, what the client still sends dropped unread.

        Closing at once, with the client's unread bytes in the socket, would reset the connection, and a client
        still sending could lose the answer. Pipelined behind an unanswered request (or in the middle of an
        answer), the connection is closed without one: the answer cannot go before the one in flight. A request
        whose own body is malformed gets the answer, and its route sees the client gone."""
        self._refused = True
        cycle = self.cycle
        if cycle is not None:
            if cycle.response_complete:
                if not self._reading_head:  # answered before its body ended (a 413 from its header): no second
                    self.transport.close()
                    return
            elif self._reading_head or cycle.response_started or self.pipeline:
                self.transport.close()  # behind an answer in flight, or in the middle of one
                return
            else:
                cycle.disconnected = True  # as uvicorn marks a lost connection: the route's next read ends it
                cycle.message_event.set()
        self.logger.warning("Request refused (%d): %s", status, message)
        body = orjson.dumps({"error": message})
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += (name, b": ", value, b"\r\n")
        head += (b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(), b"\r\n")
        head.append(b"connection: close\r\n\r\n")
        self.transport.writelines((b"".join(head), body))
        self.transport.write_eof()
        self.loop.call_later(REFUSED_LINGER_S, self.transport.close)

    def on_headers_complete(self) -> None:
        """The head ended: if it is over the limit, the parser stops (data_received answers 431); else as uvicorn.

        The chunks counted may hold a body after the head: only then is the head measured itself."""
        if self._head_bytes > self._max_head_bytes and self._head_size() > self._max_head_bytes:
            raise HeadTooLargeError
        self._reading_head, self._head_bytes, self._body_since = False, 0, self.loop.time()
        self._body_bytes = 0
        if self._read_timer is None:  # (a head that began inside the chunk that ended the previous request)
            self._arm_read_timer(self._read_check_s)
        super().on_headers_complete()
        trailers = self.headers = self._trailers  # type: ignore[assignment]  # the scope keeps the head's list
        trailers.size = 0

    def _head_size(self) -> int:
        """The bytes of the request line and headers just parsed (the line's method and version counted as the
        longest)."""
        return len(self.url) + 20 + sum(len(name) + len(value) + 4 for name, value in self.headers)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        """Start the request's lane task, or (not a lane request) its ASGI task as uvicorn does."""
        lane = self._lane
        target = None if lane is None or app is not self.app else lane.target(cycle.scope)  # type: ignore[arg-type]
        if target is None:
            super()._start_asgi_task(cycle, app)
            return
        call = self._lane_call = LaneCall(cycle, lane.reads_whole(cycle.scope))  # type: ignore[union-attr, arg-type]
        # A Task named here: one left unnamed formats its default name ("Task-<n>") as it is created.
        call.task = task = asyncio.Task(lane.serve(call, *target), loop=self.loop, name="lane")  # type: ignore[union-attr]
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def on_body(self, body: bytes) -> None:
        """As uvicorn, except for a lane request whose body is read whole: its pieces kept without waking the route,
        which takes them when the message is complete, and without pausing the connection at every 64 KiB."""
        call, cycle = self._lane_call, self.cycle
        if call is None or not call.whole_body or call.cycle is not cycle or cycle.response_complete:
            super().on_body(body)
        else:
            call.parts.append(body)

    def on_message_complete(self) -> None:
        """As uvicorn, after joining a whole-read body's pieces: one copy for a body read in several, none for one
        read at once (uvicorn grows a bytearray, then copies it into the message's bytes).

        A request asking for an upgrade ends at its head for httptools, which leaves its body to the new protocol:
        here, where no protocol is switched to, its `Content-Length` bytes are read as its body first
        (`_after_upgrade`), and the message completes after them; a chunked one is refused."""
        if self.parser.should_upgrade() and self._upgrade_body_left is None:
            scope: Any = self.cycle.scope
            if header_value(scope, b"transfer-encoding") is not None:
                self._refuse(400, "a request asking for an upgrade (Upgrade) is answered over HTTP/1.1 here: send "
                             "its body with Content-Length, or without Upgrade")  # fmt: skip
                return
            length = header_value(scope, b"content-length")
            if length is not None and int(length):
                self._upgrade_body_left = int(length)
                return
        self._message_complete()

    def _message_complete(self) -> None:
        self._reading_head, self._body_since = True, None  # what comes next is the next request's head
        call = self._lane_call
        if call is not None and call.parts and call.cycle is self.cycle:
            parts, call.parts = call.parts, []
            if not self.cycle.response_complete:  # else answered already (refused before its body was read)
                self.cycle.body = parts[0] if len(parts) == 1 else b"".join(parts)  # type: ignore[assignment]
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        """As uvicorn, and a lane request whose answer has not begun is cancelled: nobody is left to answer."""
        super().connection_lost(exc)
        if self._lane_call is not None:
            self._lane_call.cancel()
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None

    # Keep-alive: uvicorn makes a timer after every answer and cancels it when the next request's data comes (a
    # timer made and cancelled per request). Here a connection's timer is made when it turns idle with none armed;
    # data coming only marks it busy, and a timer that finds the connection busy or idle for less than the timeout
    # when it fires is made again for what is left (or by the next answer).
    _idle_since: float | None = None  # the loop's time of the last answer, while no data has come since

    def _unset_keepalive_if_required(self) -> None:
        """Data came: the connection is not idle."""
        self._idle_since = None

    def on_response_complete(self) -> None:
        """As uvicorn: start the next pipelined request, or else the connection is idle from now."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self._keep_alive_expired)

    def _keep_alive_expired(self) -> None:
        """Close the connection if it has been idle for the keep-alive timeout; else wait for what is left."""
        self.timeout_keep_alive_task = None
        if self._idle_since is None:
            return  # busy: its next answer arms the timer
        left = self._idle_since + self.timeout_keep_alive - self.loop.time()
        if left > 0:
            self.timeout_keep_alive_task = self.loop.call_later(left, self._keep_alive_expired)
        else:
            self.timeout_keep_alive_handler()


def _settings_of(app: Any) -> Settings | None:
    """The settings of a layerserve app, also under the middleware uvicorn may wrap it in; None for another app."""
    for _ in range(4):
        runtime = getattr(getattr(app, "state", None), "runtime", None)
        if runtime is not None:
            return runtime.settings  # type: ignore[no-any-return]
        app = getattr(app, "app", None)
    return None


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The options `uvicorn.run` / `uvicorn.Config` serve the app with (host, port, loop, protocol, timeouts)."""
    return {
        "host": settings.host, "port": settings.port, "log_level": settings.log_level, "log_config": None,
        "loop": "uvloop", "http": f"{__name__}:HttpProtocol", "ws": "none", "access_log": False, "proxy_headers": False,
        "timeout_graceful_shutdown": settings.shutdown_timeout_s,
        # Longer than clients' own keep-alive expiry (httpx: 5 s, uvicorn's default too): when the server closes
        # an idle connection first, a request the client sends on it at that moment is reset.
        "timeout_keep_alive": settings.keep_alive_timeout_s,
    }  # fmt: skip
