"""HttpProtocol: layerserve's HTTP/1.1 connection, on httptools' public parser (`HttpRequestParser` and its
callbacks). Each request is a RequestCycle (cycle.py) answered by the door's lane (a model's request, straight to
its route: lane.py) or by the ASGI app; one answer at a time, pipelined requests in order.

Besides HTTP/1.1 itself (keep-alive, pipelining, 100-continue, chunked bodies both ways, flow control both ways),
the connection holds clients to limits no other layer can see: a request line and headers over
`max_header_bytes` (a chunked body's trailer fields count too) are answered 431 within one read of the limit
(httptools keeps a head whole until it ends); a body whose bytes with their framing pass `max_body_bytes` +
`max_header_bytes`, 413; bytes that are not HTTP/1.1, 400 with the parser's reason; a head still coming
`header_timeout_s` after its first byte, or a body silent for `body_timeout_s` while it is read, 408; an HTTP/1.1
request without exactly one Host (or any request with two), 400. A connection that sends nothing for
`header_timeout_s` (or `keep_alive_timeout_s`, if shorter) after it opens, or for `keep_alive_timeout_s` after an
answer, is closed. After a refusal the connection drops what the client sends and closes a little later (closing
at once, with the client's bytes unread, would reset it and could lose the answer); refusals are logged at debug,
with one warning a minute counting them (a hostile client cannot flood the log). A request asking for an upgrade
(h2c, a WebSocket) is answered as HTTP/1.1, its body read past the parser, which leaves it to the new protocol.

Pipelined requests are answered one at a time, and cost the server a bounded amount whatever the client sends: a
read is parsed `PARSE_SLICE_BYTES` at a time, and once requests wait behind the one answered, the rest is held
unparsed (reading paused) until they have started; while the client does not read its answers (the transport's
write buffer is full) no further request starts and nothing is read, and a client that leaves its answers unread
for `keep_alive_timeout_s` is dropped.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import unquote

import httptools
import orjson

from layerserve.transports.http.cycle import RequestCycle, header_value, status_line
from layerserve.transports.http.disconnect import EXTENSION as CANCELS

log = logging.getLogger("layerserve.transports.http")

# What the connection does beyond ASGI, as scope extensions: it cancels a request whose client left before its answer
# began (the policy middleware need not watch for it: see disconnect.py).
_EXTENSIONS: dict[str, Any] = {CANCELS: {}}
HIGH_WATER_BYTES = 65_536  # a body buffered past this, the connection stops reading until the app takes it
REFUSED_LINGER_S = 2.0  # how long a connection whose request was refused stays open, dropping what comes
PARSE_SLICE_BYTES = 16_384  # a longer read is parsed in pieces this long (pipelined requests: see the module)
REFUSALS_LOG_EVERY_S = 60.0  # refusals are logged at debug, and counted in one warning at most this often


@dataclass(frozen=True)
class HttpLimits:
    """What a connection holds clients to (see the module); `keep_alive_timeout_s` closes an idle connection."""

    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    max_body_bytes: int
    keep_alive_timeout_s: float


class Lane(Protocol):
    """The door's fast path: a model's requests answered from the connection, past the ASGI app."""

    def target(self, scope: dict[str, Any]) -> Any:
        """What answers this request on the lane, or None for the app."""

    def reads_whole(self, scope: dict[str, Any]) -> bool:
        """Whether the request's body is buffered whole before its route runs."""

    async def serve(self, cycle: RequestCycle, target: Any) -> None:
        """Answer one lane request on its cycle."""


class DoorState:
    """What every connection of one HTTP door shares: the app, the lane, the limits, the open connections and the
    request tasks, and the headers every answer begins with (the door refreshes `date` every second)."""

    def __init__(self, app: Any, lane: Lane | None, limits: HttpLimits) -> None:
        self.app = app
        self.lane = lane
        self.limits = limits
        self.connections: set[HttpProtocol] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.default_headers: list[tuple[bytes, bytes]] = [(b"server", b"layerserve")]
        self.total_requests = 0
        self._closed: asyncio.Event | None = None  # set once no connection is left (see `all_closed`)
        self._refusals = 0  # since the last warning about them
        self._refusals_logged_at: float | None = None

    def refused(self, now: float, status: int, message: str) -> None:
        """Log a refusal: at debug, and in a warning at most every `REFUSALS_LOG_EVERY_S` (with the count since)."""
        log.debug("Request refused (%d): %s", status, message)
        self._refusals += 1
        if self._refusals_logged_at is not None and now - self._refusals_logged_at < REFUSALS_LOG_EVERY_S:
            return
        log.warning("Request refused (%d): %s (%d refused since the last such line; each at debug)", status, message,
                    self._refusals)  # fmt: skip
        self._refusals, self._refusals_logged_at = 0, now

    def connection_closed(self, connection: HttpProtocol) -> None:
        """A connection is gone (its last bytes sent, or the client left)."""
        self.connections.discard(connection)
        if not self.connections and self._closed is not None:
            self._closed.set()

    async def all_closed(self) -> None:
        """Return once no connection is left."""
        if self.connections:
            self._closed = asyncio.Event()
            await self._closed.wait()


class HeadTooLargeError(Exception):
    """Raised in a parser callback to stop it at a head (or a chunked body's trailer fields) over the limit."""


class BadHeadError(Exception):
    """Raised in a parser callback to stop it at a head HTTP/1.1 forbids (400 with this message)."""


class HttpProtocol(asyncio.Protocol):
    """One client connection (see the module)."""

    def __init__(self, state: DoorState, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._state = state
        self._limits = limits = state.limits
        self._loop = loop or asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set by connection_made
        self.default_headers = state.default_headers
        self._addresses: tuple[Any, Any, str] = (None, None, "http")
        # The request being read, the one being answered, and requests read while another was answered.
        self._cycle: RequestCycle | None = None
        self._answering: RequestCycle | None = None
        self._pipeline: collections.deque[RequestCycle] = collections.deque()
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._hosts = 0  # Host fields in the head being read
        self._expect_continue = False
        self._unparsed = b""  # pipelined input held back while requests wait (see the module)
        self._read_paused = False
        self._writable: asyncio.Future[None] | None = None
        # Limits: bytes of the head being read (from the first read after the previous message ended) and when its
        # first came; while a body is read, its bytes and when the last came; trailer fields' bytes.
        self._reading_head = True
        self._head_bytes = 0
        self._head_started = 0.0
        self._body_since: float | None = None
        self._body_bytes = 0
        self._max_raw_body = limits.max_body_bytes + limits.max_header_bytes
        self._trailer_bytes = 0
        self._read_check_s = min(limits.header_timeout_s, limits.body_timeout_s)
        self._read_timer: asyncio.TimerHandle | None = None  # one per connection, armed while a request comes
        self._refused = False
        self._upgrade_body_left: int | None = None
        # Idle connections: one timer per connection, made when it turns idle with none armed (not one per answer);
        # idle until `_idle_until` (from the connection's start, then from each answer).
        self._keep_alive_s = limits.keep_alive_timeout_s
        self._idle_until: float | None = None
        self._keep_alive_timer: asyncio.TimerHandle | None = None

    # asyncio's calls.

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Register the connection with its door."""
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio's classes
        self._state.connections.add(self)
        scheme = "https" if transport.get_extra_info("sslcontext") else "http"
        self._addresses = (_address(transport, "sockname"), _address(transport, "peername"), scheme)
        # A connection that sends nothing is closed (no later than a keep-alive deadline: the timer is reused).
        timeout_s = min(self._limits.header_timeout_s, self._keep_alive_s)
        self._idle_until = self._loop.time() + timeout_s
        self._keep_alive_timer = self._loop.call_later(timeout_s, self._keep_alive_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        """Every request of the connection is over: one not answered yet is cancelled (nobody is left to answer)."""
        self._state.connection_closed(self)
        for cycle in (self._answering, self._cycle, *self._pipeline):
            if cycle is not None and not cycle.response_complete:
                cycle.lost()
                task = cycle.task
                if task is not None and not task.done() and not cycle.response_started:
                    task.cancel()
        # Nothing of the connection outlives it (its requests' bodies, pipelined input).
        self._pipeline.clear()
        self._cycle = self._answering = None
        self._unparsed, self._headers = b"", []
        for timer in (self._read_timer, self._keep_alive_timer):
            if timer is not None:
                timer.cancel()
        self._read_timer = self._keep_alive_timer = None
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def eof_received(self) -> bool:
        """The client closed its side: let the transport close the connection once the answer is written."""
        return False

    def pause_writing(self) -> None:
        """The transport's buffer is full: writers wait (`drain`)."""
        if self._writable is None:
            self._writable = self._loop.create_future()

    def resume_writing(self) -> None:
        """The transport's buffer drained: writers go on, and the next request starts if it waited for this."""
        if self._writable is not None:
            if not self._writable.done():
                self._writable.set_result(None)
            self._writable = None
        if self._answering is None and not self._refused and not self.transport.is_closing():
            self._next()

    def data_received(self, data: bytes) -> None:
        """Parse what came, within the limits (see the module)."""
        if self._refused:
            return
        if self._unparsed:  # (came before reading paused)
            self._unparsed += data
            return
        if self._reading_head:
            if not self._head_bytes:  # a head begins
                self._head_started = self._loop.time()
                if self._read_timer is None:
                    self._read_timer = self._loop.call_later(self._read_check_s, self._read_timer_fired)
            self._head_bytes += len(data)
        elif self._body_since is not None:
            self._body_since = self._loop.time()
            self._body_bytes += len(data)
            if self._body_bytes > self._max_raw_body:
                self._refuse(413, self._body_too_large())
                return
        self._idle_until = None
        if self._upgrade_body_left is not None:
            self._after_upgrade(data, 0)
            return
        if not (self._parse_in_slices(data) if len(data) > PARSE_SLICE_BYTES else self._parse(data, data)):
            return
        if self._reading_head and self._head_bytes > self._limits.max_header_bytes and not self._refused:
            self._refuse(431, self._too_large())

    def _parse(self, piece: bytes | memoryview, rest: bytes | memoryview) -> bool:
        """Feed `piece` (which begins `rest`) to the parser; False when parsing stopped (a refusal, an upgrade)."""
        try:
            self._parser.feed_data(piece)
        except httptools.HttpParserError as error:
            self._parse_failed(error)
            return False
        except httptools.HttpParserUpgrade as upgrade:
            self._after_upgrade(rest, upgrade.args[0])
            return False
        return True

    def _parse_in_slices(self, data: bytes) -> bool:
        """Parse a long read `PARSE_SLICE_BYTES` at a time, holding the rest back (reading paused) once requests wait
        behind the one answered; False when parsing stopped."""
        view = memoryview(data)
        for start in range(0, len(view), PARSE_SLICE_BYTES):
            if self._pipeline:
                self._unparsed = bytes(view[start:])
                self._pause_reading()
                return True
            if not self._parse(view[start : start + PARSE_SLICE_BYTES], view[start:]):
                return False
        return True

    # The parser's callbacks.

    def on_message_begin(self) -> None:
        """A request begins."""
        self._url, self._headers, self._expect_continue, self._trailer_bytes, self._hosts = b"", [], False, 0, 0

    def on_url(self, url: bytes) -> None:
        """A piece of the request target."""
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        """One header field (or, after a chunked body, one trailer field: counted against the head's limit and
        dropped, as RFC 9110 lets a server)."""
        if not self._reading_head:
            self._trailer_bytes += len(name) + len(value) + 4
            if self._trailer_bytes > self._limits.max_header_bytes:
                raise HeadTooLargeError
            return
        name = name.lower()
        if name == b"host":
            self._hosts += 1
        elif name == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        """The head ended: build the request's scope and start its answer (or queue it behind the one in flight)."""
        limits = self._limits
        if self._head_bytes > limits.max_header_bytes and self._head_size() > limits.max_header_bytes:
            raise HeadTooLargeError
        parser = self._parser
        version = parser.get_http_version()
        if self._hosts != 1 and (self._hosts or version != "1.0"):  # RFC 9112 3.2 (HTTP/1.0 may omit it)
            raise BadHeadError(f"an HTTP/{version} request needs exactly one Host header, got {self._hosts}")
        self._reading_head, self._head_bytes, self._body_since, self._body_bytes = False, 0, self._loop.time(), 0
        if self._read_timer is None:  # (a head that began inside the chunk that ended the previous request)
            self._read_timer = self._loop.call_later(self._read_check_s, self._read_timer_fired)
        parsed = httptools.parse_url(self._url)
        raw_path = parsed.path
        server, client, scheme = self._addresses
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": version,
            "server": server, "client": client, "scheme": scheme,
            "method": parser.get_method().decode("ascii"), "root_path": "",
            "path": unquote(raw_path.decode("ascii")) if b"%" in raw_path else raw_path.decode("ascii"),
            "raw_path": raw_path, "query_string": parsed.query or b"", "headers": self._headers, "state": {},
            "extensions": _EXTENSIONS,
        }  # fmt: skip
        cycle = RequestCycle(scope, self, parser.should_keep_alive(), self._expect_continue)
        self._cycle = cycle
        if self._answering is None:
            self._start(cycle)
        else:
            self._pause_reading()  # one answer at a time: the next waits for this one (see `answered`)
            self._pipeline.append(cycle)

    def on_body(self, body: bytes) -> None:
        """A piece of the body: to the request, which the connection stops reading past a high-water mark until the
        app takes it (a body read whole by the lane is kept without waking the route, and without pausing)."""
        cycle = self._cycle
        if cycle is None or cycle.response_complete:
            return
        cycle.received(body)
        if not cycle.whole_body and cycle.buffered > HIGH_WATER_BYTES:
            self._pause_reading()

    def on_message_complete(self) -> None:
        """The request is complete. One asking for an upgrade ends at its head for httptools, which leaves its body
        to the new protocol: here, where none is switched to, its Content-Length bytes are read as its body first
        (`_after_upgrade`); a chunked one is refused."""
        cycle = self._cycle
        if self._parser.should_upgrade() and self._upgrade_body_left is None and cycle is not None:
            if header_value(cycle.scope, b"transfer-encoding") is not None:
                self._refuse(400, "a request asking for an upgrade (Upgrade) is answered over HTTP/1.1 here: send "
                             "its body with Content-Length, or without Upgrade")  # fmt: skip
                return
            length = header_value(cycle.scope, b"content-length")
            if length is not None and length.isdigit() and int(length):
                self._upgrade_body_left = int(length)
                return
        self._message_complete()

    def _message_complete(self) -> None:
        self._reading_head, self._body_since = True, None  # what comes next is the next request's head
        cycle = self._cycle
        if cycle is not None and not cycle.response_complete:
            cycle.ended()

    # Running requests.

    def _start(self, cycle: RequestCycle) -> None:
        """Answer `cycle`: on the lane, or through the app."""
        self._answering = cycle
        state = self._state
        lane = state.lane
        target = None if lane is None else lane.target(cycle.scope)
        if target is not None:
            assert lane is not None
            cycle.whole_body = lane.reads_whole(cycle.scope)
            coroutine = lane.serve(cycle, target)
        else:
            coroutine = self._run_app(cycle)
        # A Task named here: one left unnamed formats its default name ("Task-<n>") as it is created.
        cycle.task = task = self._loop.create_task(coroutine, name="http")
        task.add_done_callback(state.tasks.discard)
        state.tasks.add(task)

    async def _run_app(self, cycle: RequestCycle) -> None:
        """The ASGI app's answer; an app that fails or ends without a whole answer is logged and answered 500 (or,
        past the answer's start, its connection closed)."""
        try:
            await self._state.app(cycle.scope, cycle.receive, cycle.send)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the ASGI app failed on %s %s", cycle.scope["method"], cycle.scope["path"])
            self._fail(cycle)
            return
        if not cycle.response_complete and not cycle.disconnected:
            log.error("the ASGI app returned without a whole answer on %s %s", cycle.scope["method"],
                      cycle.scope["path"])  # fmt: skip
            self._fail(cycle)

    def _fail(self, cycle: RequestCycle) -> None:
        if not cycle.response_started:
            cycle.keep_alive = False
            body = b'{"error": "internal error (logged)"}'
            cycle.answer(500, [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))], body)
        elif not self.transport.is_closing():
            self.transport.close()

    def answered(self, cycle: RequestCycle) -> None:
        """An answer is complete: start the next pipelined request, or else the connection is idle from now; while
        the client leaves answers unread (the write buffer full), neither until it reads (`resume_writing`)."""
        self._state.total_requests += 1
        if self._answering is cycle:
            self._answering = None
        if self.transport.is_closing():
            return
        if self._writable is not None:
            self._pause_reading()
            self._idle()
            return
        self._next()

    def _next(self) -> None:
        """Start the next pipelined request; once none waits, parse what was held back, and read again."""
        if self._pipeline:
            self._start(self._pipeline.popleft())
            if self._pipeline:
                return  # (its body is whole: the parser is past it)
        if self._unparsed:
            held, self._unparsed = self._unparsed, b""
            self.data_received(held)
            if self._unparsed or self._refused:
                return
        self.resume_reading()
        if self._answering is None:
            self._idle()

    def _idle(self) -> None:
        """Nothing to answer from now: the connection closes unless a request comes within the keep-alive timeout."""
        self._idle_until = self._loop.time() + self._keep_alive_s
        if self._keep_alive_timer is None:
            self._keep_alive_timer = self._loop.call_later(self._keep_alive_s, self._keep_alive_expired)

    def _keep_alive_expired(self) -> None:
        """Close the connection if it has been idle until now (dropped if its answers are still unread); else wait
        for what is left."""
        self._keep_alive_timer = None
        if self._idle_until is None or self._answering is not None:
            return  # busy: its next answer arms the timer
        left = self._idle_until - self._loop.time()
        if left > 0:
            self._keep_alive_timer = self._loop.call_later(left, self._keep_alive_expired)
        elif self._writable is not None:
            self.transport.abort()  # closing would wait for the client to read
        elif not self.transport.is_closing():
            self.transport.close()

    def shutdown(self) -> None:
        """The door stops: close now if idle, else after the answer in flight."""
        cycle = self._answering
        if cycle is None or cycle.response_complete:
            self.transport.close()
        else:
            cycle.keep_alive = False
            self._pipeline.clear()

    # What a cycle asks of its connection.

    def resume_reading(self) -> None:
        """Read from the socket again."""
        if self._read_paused:
            self._read_paused = False
            self.transport.resume_reading()

    def _pause_reading(self) -> None:
        if not self._read_paused:
            self._read_paused = True
            self.transport.pause_reading()

    def is_write_paused(self) -> bool:
        """Whether the transport asked writers to wait."""
        return self._writable is not None

    async def drain(self) -> None:
        """Wait while the transport's write buffer is over its high-water mark; a client that takes none of it for
        the keep-alive timeout is dropped (an answer sent in pieces cannot hold its connection for ever)."""
        writable = self._writable
        if writable is None:
            return
        timer = self._loop.call_later(self._keep_alive_s, self._drop_unread, writable)
        try:
            await asyncio.shield(writable)
        finally:
            timer.cancel()

    def _drop_unread(self, writable: asyncio.Future[None]) -> None:
        if not writable.done():
            self.transport.abort()  # its connection_lost wakes the writer

    # Limits and refusals.

    def _read_timer_fired(self) -> None:
        """408 if a head has been coming for `header_timeout_s`, or a body has brought nothing for `body_timeout_s`
        (while it is read); else the timer again while a request comes. It fires at least every
        `min(header_timeout_s, body_timeout_s)` while a request comes, so a deadline is enforced within that much
        of its passing."""
        self._read_timer = None
        if self._refused or self.transport.is_closing():
            return
        now, limits = self._loop.time(), self._limits
        if self._reading_head and self._head_bytes:
            left = self._head_started + limits.header_timeout_s - now
            message = (
                f"the request line and headers did not arrive within {limits.header_timeout_s:g} s of their first "
                "byte (header_timeout_s)"
            )
        elif self._body_since is not None:
            if self._cycle is not None and self._cycle.response_complete:
                return  # answered without its whole body (a 413 from the header): idle, if anything, from here
            if self._read_paused:  # the server is not reading: the client is not late
                self._body_since = now
            left = self._body_since + limits.body_timeout_s - now
            message = f"the request body stopped: no byte of it came for {limits.body_timeout_s:g} s (body_timeout_s)"
        else:
            return  # no request coming: the next head arms the timer
        if left > 0:
            self._read_timer = self._loop.call_later(min(left, self._read_check_s), self._read_timer_fired)
        else:
            self._refuse(408, message)

    def _after_upgrade(self, data: bytes | memoryview, parsed: int) -> None:
        """Read on as HTTP/1.1 where the parser stopped after a request asking for an upgrade (at `parsed`, where the
        new protocol's bytes would begin): that request's body, then the next requests."""
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
                self._parser.feed_data(rest)
                return
            except httptools.HttpParserError as error:
                self._parse_failed(error)
            except httptools.HttpParserUpgrade as upgrade:
                rest = rest[upgrade.args[0] :]

    def _parse_failed(self, error: httptools.HttpParserError) -> None:
        """431 for a head (or trailer fields) over the limit; else 400 naming what the parser found wrong; a callback's
        own failure (a bug) is logged and answered 500."""
        cause = error.__context__ if isinstance(error, httptools.HttpParserCallbackError) else error
        if isinstance(cause, HeadTooLargeError):
            trailers = "" if self._reading_head else " (a chunked body's trailer fields count as headers)"
            self._refuse(431, self._too_large() + trailers)
            return
        if isinstance(cause, BadHeadError):
            self._refuse(400, str(cause))
            return
        if cause is None or isinstance(cause, httptools.HttpParserError):
            self._refuse(400, f"malformed HTTP/1.1 request: {cause or error}")
            return
        log.error("HTTP request parse failed in a callback", exc_info=cause)
        self._refuse(500, "internal error (logged): the request could not be parsed")

    def _too_large(self) -> str:
        return (
            f"the request line and headers are over the limit of {self._limits.max_header_bytes} bytes "
            "(max_header_bytes); send fewer or shorter headers"
        )

    def _body_too_large(self) -> str:
        return (
            f"the request body, with its chunk framing and trailer fields, is over {self._max_raw_body} bytes "
            "(max_body_bytes + max_header_bytes)"
        )

    def _head_size(self) -> int:
        """The bytes of the request line and headers just parsed (the method and version counted as the longest)."""
        return len(self._url) + 20 + sum(len(name) + len(value) + 4 for name, value in self._headers)

    def _refuse(self, status: int, message: str) -> None:
        """A request the connection cannot go on after: `status` with the error, the write side closed, and the
        connection closed `REFUSED_LINGER_S` later, what the client still sends dropped unread.

        Behind an answer in flight (or in the middle of one) the connection closes without it: the refusal cannot
        go before the answer. A request whose own body is malformed gets the refusal, and its route sees the client
        gone."""
        self._refused = True
        cycle = self._cycle
        if cycle is not None:
            if cycle.response_complete:
                if not self._reading_head:  # answered before its body ended (a 413 from its header): no second
                    self.transport.close()
                    return
            elif self._reading_head or cycle.response_started or self._pipeline:
                self.transport.close()  # behind an answer in flight, or in the middle of one
                return
            else:
                cycle.lost()  # its route's next read ends it; the refusal is its answer
        self._state.refused(self._loop.time(), status, message)
        body = orjson.dumps({"error": message})
        head = [status_line(status)]
        for name, value in self.default_headers:
            head += (name, b": ", value, b"\r\n")
        head += (b"content-type: application/json\r\ncontent-length: ", b"%d" % len(body), b"\r\n")
        head.append(b"connection: close\r\n\r\n")
        self.transport.writelines((b"".join(head), body))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._loop.call_later(REFUSED_LINGER_S, self.transport.close)


def _address(transport: asyncio.BaseTransport, which: str) -> tuple[str, int] | None:
    found = transport.get_extra_info(which)
    return (str(found[0]), int(found[1])) if isinstance(found, tuple) and len(found) >= 2 else None
