"""A minimal HTTP/2 gRPC client for the load generator: one unary call at a time on one connection, the request
framed once, the answer's grpc-status read from its trailers; zttp's client connection reads and writes the frames.

zttp acknowledges SETTINGS, answers PINGs, gives the server window back as answers arrive, and parks the part of a
large request that does not fit the server's windows until it opens them (sent as its WINDOW_UPDATEs are read).
zttp 0.0.35 sends `:scheme https` whatever the connection (it takes no pseudo-header from the caller); gRPC servers
do not check it on a cleartext connection (grpcio's and ours are tested in tests/bench/test_h2_client.py).
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any, cast

import zttp

_REFUSED_STREAM = zttp.H2ErrorCode.REFUSED_STREAM
_UNKNOWN = 2  # gRPC's UNKNOWN: an answer whose status could not be read
# zttp 0.0.35 takes a large request in 64 KiB pieces for about a third of what one send_data of it costs
# (a 588 KiB request: about 0.3 ms instead of 0.8-0.9 ms of the client's CPU).
_PIECE_BYTES = 1 << 16


class GoingAwayError(Exception):
    """The server went away before taking the call (GOAWAY, REFUSED_STREAM): send it again on a new connection.
    `code` is the GOAWAY's error code (0: a graceful one)."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class ConnectionLostError(Exception):
    """The connection closed or was reset before the answer came."""


def _status(fields: Any) -> int | None:
    """The grpc-status among header or trailer fields, or None without one."""
    for name, value in fields:
        if name == b"grpc-status":
            return int(value) if value.isdigit() else _UNKNOWN
    return None


class H2Connection(asyncio.Protocol):
    """One HTTP/2 connection to a gRPC server, making unary calls one after another."""

    def __init__(self, authority: str, path: str) -> None:
        self._path = path.encode()
        self._headers = [(b"host", authority.encode()), (b"content-type", b"application/grpc"), (b"te", b"trailers")]
        self._h2 = zttp.Connection(zttp.CLIENT, protocol=zttp.HTTP2)
        self._transport: asyncio.Transport | None = None
        self._received: asyncio.Future[None] | None = None  # what `call` waits on for more bytes
        self._lost: str | None = None  # why the connection ended
        self._last_taken: int | None = None  # the last stream the server takes, once it sent GOAWAY
        self._going_away_code = 0
        self.settings: dict[int, int] = {}  # the server's SETTINGS as read so far (zttp.H2Settings id -> value)

    @classmethod
    async def open(cls, host: str, port: int, path: str, tls: ssl.SSLContext | None = None) -> H2Connection:
        """Connect (over TLS with a `tls` context offering h2) and send the preface and our SETTINGS (zttp's)."""
        loop = asyncio.get_running_loop()
        _, connection = await loop.create_connection(lambda: cls(f"{host}:{port}", path), host, port, ssl=tls)
        return connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Send the client's preface."""
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes
        self._h2.initiate_connection()
        self._transport.write(self._h2.data_to_send())

    def data_received(self, data: bytes) -> None:
        """Give the bytes to zttp; wake the call waiting for them."""
        try:
            self._h2.receive_data(data)
        except zttp.ProtocolError as error:
            self._lost = f"invalid HTTP/2 from the server: {error}"
            self.close()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        """Wake the call waiting for an answer: it ends with ConnectionLostError once zttp's events are read."""
        self._lost = f"the connection was reset: {exc}" if exc is not None else "the server closed the connection"
        self._wake()

    def _wake(self) -> None:
        waiter = self._received
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        """Close the socket."""
        if self._transport is not None:
            self._transport.close()

    async def call(self, message: bytes) -> int:
        """Send one gRPC message (already framed with its 5-byte prefix); the answer's status code number.

        Raises:
            GoingAwayError: the server sent GOAWAY before taking the call, or refused its stream.
            ConnectionLostError: the connection ended.
        """
        if self._lost is not None and self._last_taken is None:
            self._read_left()
        if self._last_taken is not None:
            raise GoingAwayError(f"the server is going away after stream {self._last_taken}", self._going_away_code)
        if self._lost is not None or self._transport is None:
            raise ConnectionLostError(self._lost or "not connected")
        h2 = self._h2
        try:
            stream = h2.send_request(b"POST", self._path, b"2", self._headers)
            if len(message) <= _PIECE_BYTES:  # what the server's windows do not take yet waits in zttp
                stream.send_data(message)
            else:
                view = memoryview(message)
                for at in range(0, len(message), _PIECE_BYTES):
                    stream.send_data(view[at : at + _PIECE_BYTES])
            stream.end_message()
        except zttp.LocalProtocolError as error:  # zttp opens no more streams on this connection
            raise ConnectionLostError(f"no new stream on this connection: {error}") from error
        self._transport.write(h2.data_to_send())
        try:
            return await self._answer(stream.stream_id)
        except zttp.RemoteProtocolError as error:
            raise ConnectionLostError(f"invalid HTTP/2 from the server: {error}") from error

    async def _answer(self, stream_id: int) -> int:
        h2, status, got_message = self._h2, None, False
        while True:
            event: Any = h2.next_event()  # dispatched on its exact type (cheaper than isinstance)
            kind = type(event)
            if event is zttp.NEED_DATA:
                await self._more()
            elif kind is zttp.Data:
                got_message = got_message or event.stream_id == stream_id
            elif kind is zttp.Response:
                if event.stream_id == stream_id:
                    status = _status(event.headers)  # a trailers-only answer has its status here
            elif kind is zttp.EndOfMessage:
                if event.stream_id == stream_id:
                    status = _status(event.trailers) if event.trailers else status
                    return status if status is not None and (status != 0 or got_message) else _UNKNOWN
            elif kind is zttp.RstStream:
                if event.stream_id == stream_id:
                    if event.error_code == _REFUSED_STREAM:
                        raise GoingAwayError(f"the server refused stream {stream_id}")
                    return _UNKNOWN
            else:
                self._control(event, stream_id)

    def _control(self, event: Any, stream_id: int) -> None:
        """Events that are not the answer's: the server's settings, GOAWAY, the connection's end."""
        if event is zttp.CONNECTION_CLOSED:
            raise ConnectionLostError("the connection closed")
        kind = type(event)
        if kind is zttp.Settings:
            self.settings.update(event.params)
        elif kind is zttp.GoAway:  # calls up to its last stream are answered; later ones are not taken
            self._last_taken, self._going_away_code = event.last_stream_id, event.error_code
            if stream_id > event.last_stream_id:
                raise GoingAwayError(f"the server went away before taking stream {stream_id}", event.error_code)

    def _read_left(self) -> None:
        """Read the events zttp still holds from a connection that ended: a GOAWAY among them refuses the call."""
        try:
            while (event := self._h2.next_event()) is not zttp.NEED_DATA and event is not zttp.CONNECTION_CLOSED:
                self._control(event, 0)
        except zttp.RemoteProtocolError:
            pass

    async def _more(self) -> None:
        """Send what zttp has for the server (acks, window updates, request bytes its windows now take); wait
        for more bytes from it.

        Raises:
            ConnectionLostError: the connection ended (after all it had sent was read).
        """
        if self._lost is not None or self._transport is None:
            raise ConnectionLostError(self._lost or "not connected")
        data = self._h2.data_to_send()
        if data:
            self._transport.write(data)
        self._received = asyncio.get_running_loop().create_future()
        await self._received
