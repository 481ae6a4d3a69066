"""A minimal HTTP/2 gRPC client for the load generator: one unary call at a time on one connection, the request
framed once, the answer's grpc-status read from its trailers; about what the raw-socket HTTP/1.1 client costs.

It announces a header table of size 0, so the server's HPACK needs no dynamic table to be read; it honours the
server's flow-control windows and frame size (large requests are split), answers PINGs and acknowledges SETTINGS.
"""

from __future__ import annotations

import asyncio
import struct

from layerserve.transports.grpc.wire import HTTP2_PREFACE

_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY, _WINDOW_UPDATE, _CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
_END_STREAM, _ACK, _END_HEADERS, _PADDED, _PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
_BIG_WINDOW = 2**31 - 1
_REFUSED_STREAM = 7
_UNKNOWN = 2  # gRPC's UNKNOWN: an answer whose status could not be read


class GoingAwayError(Exception):
    """The server went away before taking the call (GOAWAY, REFUSED_STREAM): send it again on a new connection.
    `code` is the GOAWAY's error code (0: a graceful one)."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class ConnectionLostError(Exception):
    """The connection closed, was reset or was refused (GOAWAY) before the answer came."""


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer with an N-bit prefix, the prefix's other bits set from `first`."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out, value = bytearray([first | limit]), value - limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def _literal(name_index: int, value: str, name: str = "") -> bytes:
    """A header field as a literal without indexing (no Huffman), its name by static index or literally."""
    head = _integer(name_index, 4, 0x00) + (b"" if name_index else _integer(len(name), 7, 0) + name.encode())
    return head + _integer(len(value), 7, 0) + value.encode()


def request_headers(authority: str, path: str) -> bytes:
    """The HPACK block of a gRPC call: POST, http, the path, the authority, application/grpc, te: trailers."""
    return (
        b"\x83\x86"  # :method POST, :scheme http (static table 3, 6)
        + _literal(4, path)
        + _literal(1, authority)
        + _literal(31, "application/grpc")
        + _literal(0, "trailers", "te")
    )


def _read_integer(block: bytes, at: int, prefix_bits: int) -> tuple[int, int]:
    limit = (1 << prefix_bits) - 1
    value, at = block[at] & limit, at + 1
    if value < limit:
        return value, at
    shift = 0
    while True:
        byte, at = block[at], at + 1
        value += (byte & 127) << shift
        shift += 7
        if byte < 128:
            return value, at


def _read_string(block: bytes, at: int) -> tuple[bytes | None, int]:
    """A string literal, or None for a Huffman-coded one (not decoded: grpc-status never needs it)."""
    huffman = block[at] & 0x80
    length, at = _read_integer(block, at, 7)
    return (None if huffman else bytes(block[at : at + length])), at + length


def grpc_status(block: bytes) -> int | None:
    """The grpc-status in an HPACK header block (static table only, as our table size is 0), or None."""
    at = 0
    while at < len(block):
        byte = block[at]
        if byte & 0x80:  # indexed field: static entries only, none is grpc-status
            _, at = _read_integer(block, at, 7)
            continue
        if byte & 0xE0 == 0x20:  # dynamic table size update
            _, at = _read_integer(block, at, 5)
            continue
        index, at = _read_integer(block, at, 6 if byte & 0x40 else 4)
        name = None
        if index == 0:
            name, at = _read_string(block, at)
        value, at = _read_string(block, at)
        if name == b"grpc-status":
            return int(value) if value is not None and value.isdigit() else _UNKNOWN
    return None


class H2Connection:
    """One HTTP/2 connection to a gRPC server, making unary calls one after another."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, headers: bytes) -> None:
        self._reader, self._writer, self._headers = reader, writer, headers
        self._buffer = bytearray()
        self._stream = -1
        self._send_window = 65_535  # the connection's; a stream's starts at the server's initial window
        self._initial_window = 65_535
        self._stream_window = 0
        self._max_frame = 16_384
        self._received = 0
        self._last_taken: int | None = None  # the last stream the server takes, once it sent GOAWAY
        self._going_away_code = 0

    @classmethod
    async def open(cls, host: str, port: int, path: str) -> H2Connection:
        """Connect and send the preface and our SETTINGS (no header table, large windows)."""
        reader, writer = await asyncio.open_connection(host, port)
        connection = cls(reader, writer, request_headers(f"{host}:{port}", path))
        settings = struct.pack(">HIHIHI", 0x1, 0, 0x2, 0, 0x4, _BIG_WINDOW)  # table size, no push, window
        writer.write(
            HTTP2_PREFACE
            + connection._frame(_SETTINGS, 0, 0, settings)
            + connection._frame(_WINDOW_UPDATE, 0, 0, struct.pack(">I", _BIG_WINDOW - 65_535))
        )
        return connection

    def close(self) -> None:
        """Close the socket."""
        self._writer.close()

    @staticmethod
    def _frame(kind: int, flags: int, stream: int, payload: bytes | memoryview) -> bytes:
        return struct.pack(">IBI", len(payload) << 8 | kind, flags, stream) + bytes(payload)

    async def _next_frame(self) -> tuple[int, int, int, bytes]:
        buffer = self._buffer
        while len(buffer) < 9 or len(buffer) < 9 + int.from_bytes(buffer[:3], "big"):
            chunk = await self._reader.read(1 << 16)
            if not chunk:
                raise ConnectionLostError("the server closed the connection")
            buffer += chunk
        length = int.from_bytes(buffer[:3], "big")
        kind, flags, stream = buffer[3], buffer[4], int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
        payload = bytes(buffer[9 : 9 + length])
        del buffer[: 9 + length]
        return kind, flags, stream, payload

    def _control(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        """Frames on any stream that need no answer from the call: settings, pings, windows, goaway."""
        if kind == _SETTINGS and not flags & _ACK:
            for at in range(0, len(payload), 6):
                key, value = struct.unpack_from(">HI", payload, at)
                if key == 0x4:
                    self._stream_window += value - self._initial_window
                    self._initial_window = value
                elif key == 0x5:
                    self._max_frame = value
            self._writer.write(self._frame(_SETTINGS, _ACK, 0, b""))
        elif kind == _PING and not flags & _ACK:
            self._writer.write(self._frame(_PING, _ACK, 0, payload))
        elif kind == _WINDOW_UPDATE:
            increment = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            if stream == 0:
                self._send_window += increment
            elif stream == self._stream:
                self._stream_window += increment
        elif kind == _GOAWAY:  # calls up to its last stream are answered; later ones are not taken
            self._last_taken = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            self._going_away_code = int.from_bytes(payload[4:8], "big")

    async def call(self, message: bytes) -> int:
        """Send one gRPC message (already framed with its 5-byte prefix); the answer's status code number.

        Raises:
            GoingAwayError: the server sent GOAWAY before taking the call.
            ConnectionLostError: the connection ended.
        """
        if self._last_taken is not None:
            raise GoingAwayError(f"the server is going away after stream {self._last_taken}", self._going_away_code)
        self._stream += 2
        stream, self._stream_window = self._stream, self._initial_window
        frames = [self._frame(_HEADERS, _END_HEADERS, stream, self._headers)]  # sent with the data: one write
        data, sent = memoryview(message), 0
        while sent < len(data):
            room = min(self._send_window, self._stream_window, self._max_frame, len(data) - sent)
            if room <= 0:
                if frames:
                    self._writer.write(b"".join(frames))
                    frames = []
                self._control(*await self._next_frame())
                continue
            last = sent + room == len(data)
            frames.append(self._frame(_DATA, _END_STREAM if last else 0, stream, data[sent : sent + room]))
            sent += room
            self._send_window -= room
            self._stream_window -= room
        if frames:
            self._writer.write(b"".join(frames))
        return await self._answer(stream)

    async def _answer(self, stream: int) -> int:
        block, got_message, ended = b"", False, False
        while True:
            kind, flags, on, payload = await self._next_frame()
            if on != stream or kind not in (_DATA, _HEADERS, _CONTINUATION, _RST_STREAM):
                self._control(kind, flags, on, payload)
                if self._last_taken is not None and stream > self._last_taken:
                    raise GoingAwayError(f"the server went away before taking stream {stream}", self._going_away_code)
                continue
            if kind == _RST_STREAM:
                if int.from_bytes(payload[:4], "big") == _REFUSED_STREAM:
                    raise GoingAwayError(f"the server refused stream {stream}")
                return _UNKNOWN
            if kind == _DATA:
                got_message = True
                self._received += len(payload)
                if self._received > 1 << 30:  # give the server its connection window back
                    self._writer.write(self._frame(_WINDOW_UPDATE, 0, 0, struct.pack(">I", self._received)))
                    self._received = 0
                if flags & _END_STREAM:
                    return _UNKNOWN  # no trailers, so no status
                continue
            if kind == _HEADERS:
                ended = bool(flags & _END_STREAM)
                pad = payload[0] if flags & _PADDED else 0
                payload = payload[(1 if flags & _PADDED else 0) + (5 if flags & _PRIORITY else 0) : len(payload) - pad]
            block += payload
            if flags & _END_HEADERS:
                if ended:  # the trailers (or a trailers-only answer), where grpc-status is: an OK needs a message
                    status = grpc_status(block)
                    return status if status is not None and (status != 0 or got_message) else _UNKNOWN
                block = b""  # the answer's headers: nothing to read in them
