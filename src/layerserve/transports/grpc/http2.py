"""GrpcHttp2: gRPC over one HTTP/2 connection, without IO, in the shape of python-hyper's h2: bytes in
(`receive_data`), events out, bytes to send (`data_to_send`). zttp parses and writes every HTTP/2 frame through its
public API; this adds gRPC's conventions (https://github.com/grpc/grpc/blob/master/doc/PROTOCOL-HTTP2.md): the
5-byte message prefix, compressed messages, `grpc-timeout`, the status trailers, the message size limit; and what a
server needs of HTTP/2 for long-lived clients: a connection told to go away before zttp's stream limit; and of
hostile ones: a connection whose frames are mostly overhead (PING, SETTINGS, empty or tiny DATA frames) is ended
with ENHANCE_YOUR_CALM, as nginx does, and a call can be refused the same way (RST_STREAM, RESOURCE_EXHAUSTED to
gRPC clients). Compressed messages come out as they came (the IO inflates them off the event loop).

The IO around it (connection.py) runs each call's handler and writes what this holds.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import grpc
import zttp

from layerserve.transports.grpc import wire

# zttp 0.0.35 ends a connection with ENHANCE_YOUR_CALM ("flood") at its 4,096th stream, however slowly they come;
# a connection is told to go away (gracefully: clients open a new one) before that.
MAX_STREAMS = 4_000
_REFUSED_STREAM = 7
_NO_ERROR = 0
_ENHANCE_YOUR_CALM = 11
# A connection whose bytes are more than FLOOD_RATIO times its payload, past FLOOD_ALLOWANCE_BYTES, is a flood
# (nginx's rule, at 8 times): payload is DATA bytes, a request head counts as _HEAD_BYTES, a window update for
# answers taken as up to _WINDOW_UPDATE_BYTES (its own size).
FLOOD_RATIO = 4
FLOOD_ALLOWANCE_BYTES = 1 << 20
_HEAD_BYTES = 512
_WINDOW_UPDATE_BYTES = 13


@dataclass(frozen=True, slots=True)
class CallStarted:
    """A call's head came: its method's path, its headers and its deadline (seconds from now, or None)."""

    stream_id: int
    path: bytes
    headers: list[tuple[bytes, bytes]]
    timeout_s: float | None


@dataclass(frozen=True, slots=True)
class MessageReceived:
    """One whole request message of a call, uncompressed."""

    stream_id: int
    message: bytes


@dataclass(frozen=True, slots=True)
class CompressedMessageReceived:
    """One whole request message of a call, compressed in `encoding` (the call's `grpc-encoding`, or None)."""

    stream_id: int
    message: bytes
    encoding: bytes | None


@dataclass(frozen=True, slots=True)
class RequestEnded:
    """The client sent the last of a call's request."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class CallClosed:
    """A call is over before its handler answered: the client reset it, or its request broke a rule (its status is
    sent already). Nothing more is sent for it."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class WindowOpened:
    """The client gave more flow-control credit: answers held for it may leave."""


@dataclass(frozen=True, slots=True)
class ConnectionEnded:
    """The connection cannot go on (bytes that are not HTTP/2, an HTTP/1.1 request, a flood): close it once what is
    held is sent; with `abort`, at once after this turn's bytes (a hostile client gets no TLS shutdown, during which
    its bytes would still be read and decrypted)."""

    reason: str
    abort: bool = False


Event = (
    CallStarted
    | MessageReceived
    | CompressedMessageReceived
    | RequestEnded
    | CallClosed
    | WindowOpened
    | ConnectionEnded
)


class _Stream:
    """What the connection knows of one call's stream: the pieces of the request message being read (joined once, when
    it is whole: a 600 KB message comes in about 40 DATA frames) and, once its prefix is in, its framed length."""

    __slots__ = ("encoding", "ended", "expected", "headers_sent", "pieces", "size")

    def __init__(self, encoding: bytes | None) -> None:
        self.pieces: list[bytes] = []
        self.size = 0  # the bytes in `pieces`
        self.expected: int | None = None  # the message's length with its prefix, once the prefix is in
        self.encoding = encoding
        self.ended = False  # the request's last frame is in
        self.headers_sent = False

    def take(self) -> tuple[int, bytes]:
        """The whole message's compressed flag and bytes (less the prefix); what follows it stays."""
        end, pieces = self.expected, self.pieces
        assert end is not None
        flag = pieces[0][0]
        overflow = self.size - end
        rest = b""
        if overflow:
            last = pieces[-1]
            pieces[-1], rest = last[: len(last) - overflow], last[len(last) - overflow :]
        if len(pieces) == 1:
            message = pieces[0][wire.PREFIX_BYTES :]
        else:
            message = b"".join([pieces[0][wire.PREFIX_BYTES :], *pieces[1:]])
        self.pieces, self.size, self.expected = ([rest] if rest else []), len(rest), None
        return flag, message

    def prefix(self) -> bytes | None:
        """The message's 5-byte prefix, once it is in."""
        if self.size < wire.PREFIX_BYTES:
            return None
        if len(self.pieces[0]) < wire.PREFIX_BYTES:
            self.pieces = [b"".join(self.pieces)]
        return self.pieces[0][: wire.PREFIX_BYTES]


class GrpcHttp2:
    """See the module. `max_message_bytes` bounds every message, request or answer."""

    def __init__(self, max_message_bytes: int, max_streams: int = MAX_STREAMS) -> None:
        self.max_message_bytes = max_message_bytes
        self._max_streams = max_streams
        self._h2 = zttp.Connection(zttp.SERVER, protocol=zttp.HTTP2)
        self._streams: dict[int, _Stream] = {}
        self._opened = 0
        self._last_stream = 0
        self._greeted = False
        self._refusal = b""  # the answer to an HTTP/1.1 request, sent instead of HTTP/2
        self._received_bytes = 0
        self._payload_bytes = 0  # see FLOOD_RATIO
        self.going_away = False
        self.preface_received = False  # the client's preface and SETTINGS came

    # Bytes in, events out.

    def receive_data(self, data: bytes) -> list[Event]:
        """The events the bytes complete (what they call for, acknowledgements and refusals, is queued to send)."""
        if not self._greeted:
            if not data.startswith(wire.HTTP2_PREFACE[: len(data)]) and b" HTTP/1." in data.split(b"\r\n", 1)[0]:
                self._refusal = wire.HTTP1_REFUSAL
                return [ConnectionEnded("an HTTP/1.1 request: answered 426")]
            self._greeted = True
            self._h2.initiate_connection()
        try:
            self._h2.receive_data(data)
            events = self._events()
        except zttp.RemoteProtocolError as error:
            return [ConnectionEnded(f"invalid HTTP/2: {error}", abort=True)]
        self._received_bytes += len(data)
        if self._received_bytes > FLOOD_RATIO * self._payload_bytes + FLOOD_ALLOWANCE_BYTES:
            events.append(self._calm_down())
        return events

    def _calm_down(self) -> ConnectionEnded:
        """GOAWAY ENHANCE_YOUR_CALM: the client's frames are mostly overhead."""
        received, payload = self._received_bytes, self._payload_bytes
        self._received_bytes = self._payload_bytes = 0  # told once
        self.going_away = True
        self._h2.close(_ENHANCE_YOUR_CALM, self._last_stream)
        return ConnectionEnded(f"flood: {received} bytes received for {payload} of payload", abort=True)

    def _events(self) -> list[Event]:
        events: list[Event] = []
        h2, streams = self._h2, self._streams
        while True:
            event: Any = h2.next_event()  # dispatched on its exact type (cheaper than isinstance)
            kind = type(event)
            if kind is zttp.Data:
                self._payload_bytes += len(event.data)
                stream = streams.get(event.stream_id)
                if stream is not None:
                    self._received(event.stream_id, stream, event.data, events)
            elif kind is zttp.Request:
                self._open(event, events)
            elif kind is zttp.EndOfMessage:
                stream = streams.get(event.stream_id)
                if stream is not None:
                    self._ended(event.stream_id, stream, events)
            elif event is zttp.NEED_DATA or event is zttp.CONNECTION_CLOSED:
                return events
            elif kind is zttp.RstStream:
                if streams.pop(event.stream_id, None) is not None:
                    events.append(CallClosed(event.stream_id))
            elif kind is zttp.WindowUpdate:
                self._payload_bytes += min(_WINDOW_UPDATE_BYTES, event.increment >> 10)
                events.append(WindowOpened())
            elif kind is zttp.Settings:
                self.preface_received = True
            elif kind is zttp.GoAway:
                self.going_away = True

    def _open(self, request: zttp.Request, events: list[Event]) -> None:
        stream_id = request.stream_id
        self._payload_bytes += _HEAD_BYTES
        self._last_stream = max(self._last_stream, stream_id)
        stream = self._h2.stream(stream_id)
        if self.going_away:
            stream.reset(_REFUSED_STREAM)  # the client sends it again on a new connection
            return
        headers = request.headers.to_list() if isinstance(request.headers, zttp.HeaderBlock) else request.headers
        found = dict(headers)
        if request.method != b"POST" or not found.get(b"content-type", b"").startswith(b"application/grpc"):
            stream.send_response(415, [(b"content-type", b"text/plain")], False)
            stream.send_data(b"the gRPC door takes POST with content-type application/grpc\n")
            stream.end_message()
            return
        self._streams[stream_id] = _Stream(found.get(b"grpc-encoding"))
        try:
            timeout_s = wire.timeout_s(found.get(b"grpc-timeout"))
        except wire.CallError as error:
            self.end_call(stream_id, error.code, error.details)
            return
        events.append(CallStarted(stream_id, request.path, headers, timeout_s))
        if request.end_stream:
            self._ended(stream_id, self._streams[stream_id], events)
        self._opened += 1
        if self._opened >= self._max_streams and not self.going_away:
            self.go_away()  # this call is answered; the client opens a new connection for the next ones

    def _received(self, stream_id: int, stream: _Stream, data: bytes, events: list[Event]) -> None:
        """Body bytes: each whole message out; one over the size limit ends the call."""
        stream.pieces.append(data)
        stream.size += len(data)
        while True:
            if stream.expected is None:
                prefix = stream.prefix()
                if prefix is None:
                    return
                size, limit = int.from_bytes(prefix[1:5], "big"), self.max_message_bytes
                if size > limit:
                    self.end_call(stream_id, grpc.StatusCode.RESOURCE_EXHAUSTED, wire.too_large(size, limit))
                    events.append(CallClosed(stream_id))
                    return
                stream.expected = wire.PREFIX_BYTES + size
            if stream.size < stream.expected:
                return
            compressed, message = stream.take()
            if compressed:
                events.append(CompressedMessageReceived(stream_id, message, stream.encoding))
            else:
                events.append(MessageReceived(stream_id, message))

    def _ended(self, stream_id: int, stream: _Stream, events: list[Event]) -> None:
        stream.ended = True
        if stream.size:
            self.end_call(stream_id, grpc.StatusCode.INTERNAL, "the request ended inside a message")
            events.append(CallClosed(stream_id))
            return
        events.append(RequestEnded(stream_id))

    # What the calls send.

    def send_message(self, stream_id: int, payload: bytes) -> None:
        """One answer message (the response head goes first, once).

        Raises:
            CallError: RESOURCE_EXHAUSTED for an answer over the size limit.
        """
        limit = self.max_message_bytes
        if len(payload) > limit:
            too_large = f"the answer ({len(payload)} bytes) is over {limit}"
            raise wire.CallError(grpc.StatusCode.RESOURCE_EXHAUSTED, too_large)
        stream = self._streams.get(stream_id)
        if stream is None:
            return  # reset by the client meanwhile
        h2_stream = self._h2.stream(stream_id)
        if not stream.headers_sent:
            stream.headers_sent = True
            h2_stream.send_response(200, wire.RESPONSE_HEADERS)
        h2_stream.send_data(wire.frame(payload))

    def end_call(self, stream_id: int, code: grpc.StatusCode, details: str) -> None:
        """The call's status (trailers-only when nothing was sent); the call is then forgotten. A call answered
        before its request ended has its stream reset (NO_ERROR: the client may stop sending), unless answers still
        wait for the client's window."""
        stream = self._streams.pop(stream_id, None)
        if stream is None:
            return  # ended already, or reset by the client
        h2_stream = self._h2.stream(stream_id)
        trailers = wire.status_trailers(code, details)
        try:
            if stream.headers_sent:
                h2_stream.end_message(trailers)
            else:
                h2_stream.send_response(200, wire.RESPONSE_HEADERS + trailers, True)
            if not stream.ended and not h2_stream.pending_bytes:
                h2_stream.reset(_NO_ERROR)
        except zttp.LocalProtocolError:  # the stream closed meanwhile (the client reset it)
            pass

    def refuse_call(self, stream_id: int) -> None:
        """RST_STREAM ENHANCE_YOUR_CALM (gRPC clients see RESOURCE_EXHAUSTED): the call's client sends faster than
        it takes the answers; what waits for its window is dropped. The call is then forgotten."""
        if self._streams.pop(stream_id, None) is None:
            return
        with contextlib.suppress(zttp.LocalProtocolError):  # the stream closed meanwhile
            self._h2.stream(stream_id).reset(_ENHANCE_YOUR_CALM)

    def pending_bytes(self, stream_id: int) -> int:
        """Answer bytes of a call that wait for the client's window."""
        if stream_id not in self._streams:
            return 0
        return self._h2.stream(stream_id).pending_bytes or 0

    def has_pending_send(self) -> bool:
        """Whether answers wait for the client's window."""
        return self._h2.has_pending_send()

    def go_away(self) -> None:
        """GOAWAY: no new calls on this connection; those in flight finish."""
        self.going_away = True
        self._h2.close(_NO_ERROR, self._last_stream)

    def data_to_send(self) -> bytes:
        """The bytes queued to send since the last call (and clear them)."""
        refusal, self._refusal = self._refusal, b""
        return refusal + self._h2.data_to_send() if self._greeted else refusal

    @property
    def open_streams(self) -> int:
        """Calls not yet ended."""
        return len(self._streams)
