"""GrpcConnection: one client's HTTP/2 connection to the gRPC door (zttp parses and writes the frames), and Call,
one RPC on it, which is also the context its handler gets (the part of grpc.aio's ServicerContext that
grpcio's generated handlers, its health and reflection services and our servicer use).

Each call runs in its own task; a client's RST_STREAM, the call's deadline (`grpc-timeout`) or a lost
connection cancels that task (a request waiting in a batcher's queue is then dropped, never computed). An answer
leaves at once when its call was the connection's last in flight, else at the end of the loop's turn, so that the
answers one batch finishes on one connection share a write.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any, NoReturn

import grpc
import zttp

from layerserve.transports.grpc import wire
from layerserve.transports.grpc.wire import CallError

log = logging.getLogger(__name__)

_OK = grpc.StatusCode.OK
_END = object()  # ends a streaming request's messages
_MAX_PARKED_BYTES = 1 << 20  # a streaming answer waits while more than this waits for the client's window
# zttp 0.0.35 ends a connection with ENHANCE_YOUR_CALM ("flood") at its 4,096th stream, however slowly they come;
# a connection is told to go away (gracefully: clients reconnect) before that.
_MAX_STREAMS = 4_000


def _header(headers: Any, name: bytes) -> bytes | None:
    if isinstance(headers, zttp.HeaderBlock):
        return headers.get(name)
    for key, value in headers:
        if key == name:
            return value  # type: ignore[no-any-return]
    return None


class Call:
    """One RPC: its request messages in, its answer out, and the context its handler is given."""

    __slots__ = (
        "_buffer", "_connection", "_deadline", "_ended", "_expired", "_handler", "_headers", "_messages",
        "_metadata", "_sent_headers", "_timer", "closed", "stream_id", "task",
    )  # fmt: skip

    def __init__(self, connection: GrpcConnection, stream_id: int, handler: Any, headers: Any) -> None:
        self._connection = connection
        self.stream_id = stream_id
        self._handler = handler
        self._headers = headers
        self._buffer = bytearray()
        self._messages: asyncio.Queue[Any] | None = asyncio.Queue() if handler.request_streaming else None
        self._metadata: tuple[tuple[str, str | bytes], ...] | None = None
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False
        self._ended = False  # the request's last frame is in
        self._sent_headers = False
        self.closed = False  # answered, reset by the client, or the connection is gone: nothing more is sent
        self.task: asyncio.Task[None] | None = None

    # What the connection tells the call.

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Arm the deadline; a streaming request's handler starts now, a unary one's once its message is in."""
        seconds = wire.timeout_s(_header(self._headers, b"grpc-timeout"))
        if seconds is not None:
            self._deadline = loop.time() + seconds
            self._timer = loop.call_at(self._deadline, self._expire)
        if self._messages is not None:
            self.task = loop.create_task(self._run(None))

    def received(self, data: bytes) -> None:
        """Body bytes: whole messages go to a streaming handler; a message over the size limit ends the call."""
        buffer = self._buffer
        buffer += data
        limit = self._connection.max_message_bytes
        while len(buffer) >= wire.PREFIX_BYTES:
            size = int.from_bytes(buffer[1:5], "big")
            if size > limit:
                raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED, wire.too_large(size, limit))
            if self._messages is None:
                if len(buffer) > wire.PREFIX_BYTES + size:
                    raise CallError(grpc.StatusCode.INTERNAL, "a unary call's request must be exactly one message")
                return
            if len(buffer) < wire.PREFIX_BYTES + size:
                return
            self._messages.put_nowait(self._unframe(bytes(buffer[: wire.PREFIX_BYTES + size])))
            del buffer[: wire.PREFIX_BYTES + size]

    def ended(self, loop: asyncio.AbstractEventLoop) -> None:
        """The request is complete: a unary handler starts, a streaming one's messages end."""
        self._ended = True
        if self._messages is not None:
            if self._buffer:
                raise CallError(grpc.StatusCode.INTERNAL, "the request ended inside a message")
            self._messages.put_nowait(_END)
            return
        body = self._buffer
        if len(body) < wire.PREFIX_BYTES or len(body) != wire.PREFIX_BYTES + int.from_bytes(body[1:5], "big"):
            raise CallError(grpc.StatusCode.INTERNAL, "a unary call's request must be exactly one message")
        self.task = loop.create_task(self._run(self._unframe(bytes(body))))
        self._buffer = bytearray()

    def _unframe(self, framed: bytes) -> bytes:
        message = framed[wire.PREFIX_BYTES :]
        if framed[0]:
            encoding = _header(self._headers, b"grpc-encoding")
            return wire.decompress(message, encoding, self._connection.max_message_bytes)
        return message

    def cancel(self) -> None:
        """The client reset the stream or the connection is gone: nothing is sent; the handler is cancelled."""
        self.closed = True
        self._stop_timer()
        if self.task is not None:
            self.task.cancel()

    def _expire(self) -> None:
        self._timer = None
        if self.closed:
            return
        if self.task is None:  # still receiving its request
            self.finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        else:
            self._expired = True
            self.task.cancel()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # Running the handler.

    async def _run(self, message: bytes | None) -> None:
        code, details = _OK, ""
        try:
            await self._invoke(message)
        except CallError as error:
            code, details = error.code, error.details
        except asyncio.CancelledError:
            if not self._expired:
                if not self.closed:  # cancelled by the door's shutdown
                    self.finish(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
                return
            code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        except Exception:  # the handlers of grpcio's services; ours answer their errors as statuses
            log.exception("unexpected error in gRPC handler of stream %d", self.stream_id)
            code, details = grpc.StatusCode.UNKNOWN, "Unexpected error in the RPC handler"
        self.finish(code, details)

    async def _invoke(self, message: bytes | None) -> None:
        handler = self._handler
        request: Any = self._requests() if message is None else self._parse(message)
        if handler.response_streaming:
            method = handler.stream_stream if handler.request_streaming else handler.unary_stream
            answers = method(request, self)
            if hasattr(answers, "__aiter__"):
                async for answer in answers:
                    self._send(answer)
            else:
                await answers
        else:
            method = handler.stream_unary if handler.request_streaming else handler.unary_unary
            self._send(await method(request, self))

    def _parse(self, message: bytes) -> Any:
        deserializer = self._handler.request_deserializer
        if deserializer is None:  # a handler of bytes
            return message
        try:
            return deserializer(message)
        except Exception as error:
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT, f"the request message does not parse: {error}") from None

    async def _requests(self) -> AsyncIterator[Any]:
        assert self._messages is not None
        while (message := await self._messages.get()) is not _END:
            yield self._parse(message)

    def _send(self, answer: Any) -> None:
        serializer = self._handler.response_serializer
        payload = answer if serializer is None else serializer(answer)
        limit = self._connection.max_message_bytes
        if len(payload) > limit:
            raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the answer ({len(payload)} bytes) is over {limit}")
        if self.closed:
            return
        stream = self._connection.stream(self.stream_id)
        if not self._sent_headers:
            self._sent_headers = True
            stream.send_response(200, wire.RESPONSE_HEADERS)
        stream.send_data(wire.frame(payload))
        if self._handler.response_streaming:  # a unary answer leaves with its status (finish)
            self._connection.flush_soon()

    def finish(self, code: grpc.StatusCode, details: str) -> None:
        """Send the status (trailers-only when nothing was sent) and forget the call."""
        if self.closed:
            return
        self.closed = True
        self._stop_timer()
        connection = self._connection
        connection.forget(self)
        stream = connection.stream(self.stream_id)
        trailers = wire.status_trailers(code, details)
        try:
            if self._sent_headers:
                stream.end_message(trailers)
            else:
                stream.send_response(200, wire.RESPONSE_HEADERS + trailers, True)
            if not self._ended and not stream.pending_bytes:
                # Answered before the request ended: the client may stop sending (NO_ERROR). Not while answers
                # wait for the client's window: the reset would drop them.
                stream.reset(0)
        except zttp.LocalProtocolError:  # the stream closed meanwhile (the client reset it)
            pass
        connection.answered()

    # grpc.aio's ServicerContext, as far as handlers use it.

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """The call's metadata: (key, value) pairs, values of `-bin` keys as bytes."""
        if self._metadata is None:
            headers = self._headers
            self._metadata = wire.metadata(headers.to_list() if isinstance(headers, zttp.HeaderBlock) else headers)
        return self._metadata

    def time_remaining(self) -> float | None:
        """Seconds to the call's deadline, or None without one."""
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - self._connection.loop.time())

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Iterable[Any] = ()) -> NoReturn:
        """End the call with `code` and `details`."""
        raise CallError(code, details)

    async def write(self, message: Any) -> None:
        """Send one message of a streaming answer; wait while the client is slow to take the earlier ones."""
        self._send(message)
        connection = self._connection
        while not self.closed and (connection.stream(self.stream_id).pending_bytes or 0) > _MAX_PARKED_BYTES:
            await connection.window_opened()
        await connection.drained()

    def peer(self) -> str:
        """The client's address, as grpc writes it."""
        return self._connection.peer

    def cancelled(self) -> bool:
        """Whether the client went away before the answer."""
        return self.closed and self.task is not None and self.task.cancelled()

    def done(self) -> bool:
        """Whether the call has ended."""
        return self.closed


class GrpcConnection(asyncio.Protocol):
    """One client connection: its calls by stream id, the handlers by path, one write per loop turn."""

    def __init__(self, handlers: dict[bytes, Any], max_message_bytes: int, connections: set[GrpcConnection]) -> None:
        self.loop = asyncio.get_running_loop()
        self.max_message_bytes = max_message_bytes
        self.peer = ""
        self._handlers = handlers
        self._connections = connections
        self._h2 = zttp.Connection(zttp.SERVER, protocol=zttp.HTTP2)
        self._transport: asyncio.Transport | None = None
        self._calls: dict[int, Call] = {}
        self._flush_handle: asyncio.Handle | None = None
        self._last_stream = 0
        self._streams = 0
        self._going_away = False
        self._writable: asyncio.Future[None] | None = None
        self._window: asyncio.Future[None] | None = None
        self._idle: asyncio.Future[None] | None = None
        self._close_when_sent = False
        self._greeted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Send the server's preface."""
        self._transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio's classes
        self._connections.add(self)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            host, port = peer[:2]
            self.peer = f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"
        self._h2.initiate_connection()  # sent once the client's first bytes show it speaks HTTP/2 (`_greet`)

    def connection_lost(self, exc: Exception | None) -> None:
        """Cancel the calls still running."""
        self._connections.discard(self)
        for call in list(self._calls.values()):
            call.cancel()
        self._calls.clear()
        for waiter in (self._writable, self._window, self._idle):
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def data_received(self, data: bytes) -> None:
        """Read the frames; what they call for (acks, window updates, refusals) leaves at once."""
        if not self._greeted and not self._greet(data):
            return
        try:
            self._h2.receive_data(data)
            self._read_events()
        except zttp.RemoteProtocolError as error:
            log.warning("gRPC connection from %s closed: invalid HTTP/2: %s", self.peer, error)
            self._flush()
            self.close()
            return
        self._flush()
        if self._close_when_sent and not self._h2.has_pending_send():
            self.close()

    def _greet(self, data: bytes) -> bool:
        """Send the server's preface to an HTTP/2 client; answer an HTTP/1.1 request saying where it belongs."""
        if not data.startswith(wire.HTTP2_PREFACE[: len(data)]) and b" HTTP/1." in data.split(b"\r\n", 1)[0]:
            log.warning("HTTP/1.1 request to the gRPC port from %s: answered 426", self.peer)
            assert self._transport is not None
            self._transport.write(wire.HTTP1_REFUSAL)
            self._transport.close()
            return False
        self._greeted = True
        # zttp 0.0.35 has no setting for its receive windows: larger ones are announced here, after its preface.
        # It does not hold clients to its own windows and takes the extra SETTINGS ACK (tests/transports/grpc).
        self._flush()
        self._transport.write(wire.receive_windows(self.max_message_bytes))  # type: ignore[union-attr]
        return True

    def _read_events(self) -> None:
        h2, calls = self._h2, self._calls
        while True:
            event: Any = h2.next_event()  # dispatched on its exact type below (cheaper than isinstance)
            kind = type(event)
            if kind is zttp.Data:
                call = calls.get(event.stream_id)
                if call is not None:
                    self._guard(call, call.received, event.data)
            elif kind is zttp.Request:
                self._open(event)
            elif kind is zttp.EndOfMessage:
                call = calls.get(event.stream_id)
                if call is not None and not call.closed:
                    self._guard(call, call.ended, self.loop)
            elif event is zttp.NEED_DATA or event is zttp.CONNECTION_CLOSED:
                return
            elif kind is zttp.RstStream:
                call = calls.pop(event.stream_id, None)
                if call is not None:
                    call.cancel()
                    self._removed()
            elif kind is zttp.WindowUpdate:
                if self._window is not None and not self._window.done():
                    self._window.set_result(None)
                self._window = None
            elif kind is zttp.GoAway:
                self._going_away = True

    @staticmethod
    def _guard(call: Call, step: Any, argument: Any) -> None:
        try:
            step(argument)
        except CallError as error:
            call.finish(error.code, error.details)
            if call.task is not None:
                call.task.cancel()

    def _open(self, request: zttp.Request) -> None:
        stream_id = request.stream_id
        self._last_stream = max(self._last_stream, stream_id)
        stream = self._h2.stream(stream_id)
        if self._going_away:
            stream.reset(7)  # REFUSED_STREAM: the client retries it on a new connection
            return
        content_type = _header(request.headers, b"content-type") or b""
        if request.method != b"POST" or not content_type.startswith(b"application/grpc"):
            stream.send_response(415, [(b"content-type", b"text/plain")], False)
            stream.send_data(b"the gRPC door takes POST with content-type application/grpc\n")
            stream.end_message()
            return
        handler = self._handlers.get(request.path)
        if handler is None:
            trailers = wire.status_trailers(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {request.path!r}")
            stream.send_response(200, wire.RESPONSE_HEADERS + trailers, True)
            return
        call = Call(self, stream_id, handler, request.headers)
        self._calls[stream_id] = call
        self._guard(call, call.start, self.loop)
        if request.end_stream and not call.closed:
            self._guard(call, call.ended, self.loop)
        self._streams += 1
        if self._streams >= _MAX_STREAMS and not self._going_away:
            self.go_away()  # this call is answered; the client opens a new connection for the next ones

    # What calls use.

    def stream(self, stream_id: int) -> zttp.Stream:
        """The send surface of one stream."""
        return self._h2.stream(stream_id)

    def forget(self, call: Call) -> None:
        """A call has answered; a connection told to go away closes after its last one."""
        self._calls.pop(call.stream_id, None)
        self._removed()

    def _removed(self) -> None:
        """After a call left: wake who waits for the connection to be idle; one going away closes once idle
        and once what zttp holds for the client's window is sent."""
        if self._calls:
            return
        if self._idle is not None and not self._idle.done():
            self._idle.set_result(None)
        if self._going_away:
            self.loop.call_soon(self._close_once_sent)

    def _close_once_sent(self) -> None:
        if self._h2.has_pending_send():
            self._close_when_sent = True  # data_received closes it once window updates let the rest out
        else:
            self.close()

    async def window_opened(self) -> None:
        """Wait for the client's next WINDOW_UPDATE (or the connection's end)."""
        if self._window is None:
            self._window = self.loop.create_future()
        await asyncio.shield(self._window)

    async def idle(self) -> None:
        """Wait until no call is in flight (or the connection is gone)."""
        if not self._calls or self._transport is None or self._transport.is_closing():
            return
        if self._idle is None or self._idle.done():
            self._idle = self.loop.create_future()
        await asyncio.shield(self._idle)

    def answered(self) -> None:
        """A call has sent its status: the last call in flight writes now, others at the end of this loop turn
        (answers of one batch on one connection then share a write)."""
        if self._calls:
            self.flush_soon()
        else:
            self._flush()

    def flush_soon(self) -> None:
        """Write what zttp queued at the end of this loop turn, with whatever else is written in it."""
        if self._flush_handle is None:
            self._flush_handle = self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        data = self._h2.data_to_send()
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    async def drained(self) -> None:
        """Wait while the transport's write buffer is over its high-water mark."""
        if self._writable is not None:
            await asyncio.shield(self._writable)

    def pause_writing(self) -> None:
        """The transport's buffer is full: streaming writers wait."""
        if self._writable is None:
            self._writable = self.loop.create_future()

    def resume_writing(self) -> None:
        """The transport's buffer drained."""
        if self._writable is not None:
            self._writable.set_result(None)
            self._writable = None

    # Shutdown.

    def go_away(self) -> None:
        """GOAWAY: no new calls; those in flight finish, then the connection closes."""
        self._going_away = True
        self._h2.close(0, self._last_stream)
        self._flush()
        self._removed()

    def cancel_calls(self) -> None:
        """Cancel the handlers still running (they answer UNAVAILABLE)."""
        for call in list(self._calls.values()):
            if call.task is not None:
                call.task.cancel()

    def close(self) -> None:
        """Close the connection (calls still running are cancelled by `connection_lost`)."""
        if self._transport is not None and not self._transport.is_closing():
            self._flush()
            self._transport.close()
