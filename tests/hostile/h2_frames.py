"""HTTP/2 frames as an attacker writes them, packed by hand (what a hostile client sends need not be what a parser
would let it send), and a reader of the frames the server sends back: their types, streams and error codes (no
HPACK: the tests look at RST_STREAM and GOAWAY)."""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, SETTINGS, RST_STREAM, PING, GOAWAY = 0, 1, 4, 3, 6, 7
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
ENHANCE_YOUR_CALM = 11
INITIAL_WINDOW_SIZE = 4
MAX_FRAME_BYTES = 16_384


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame: a 24-bit length, its type and flags, the stream."""
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream_id) + payload


def settings(*pairs: tuple[int, int]) -> bytes:
    """A SETTINGS frame of (identifier, value) pairs."""
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", key, value) for key, value in pairs))


def ping(data: bytes = b"12345678") -> bytes:
    """A PING (the server must answer it)."""
    return frame(PING, 0, 0, data)


def _literal(name: bytes, value: bytes) -> bytes:
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value  # HPACK: literal, never indexed


def request_head(stream_id: int, path: str, *extra: tuple[bytes, bytes], end_stream: bool = False) -> bytes:
    """A gRPC call's HEADERS (HPACK literals only)."""
    fields = [
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()), (b":authority", b"localhost"),
        (b"content-type", b"application/grpc"), (b"te", b"trailers"), *extra,
    ]  # fmt: skip
    block = b"".join(_literal(name, value) for name, value in fields)
    return frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), stream_id, block)


def grpc_message(message: bytes, compressed: bool = False) -> bytes:
    """A length-prefixed gRPC message."""
    return bytes([int(compressed)]) + struct.pack(">I", len(message)) + message


def data(stream_id: int, payload: bytes, end_stream: bool = False) -> bytes:
    """DATA frames carrying `payload` (split at the default frame size)."""
    if not payload:
        return frame(DATA, END_STREAM if end_stream else 0, stream_id)
    pieces = [payload[at : at + MAX_FRAME_BYTES] for at in range(0, len(payload), MAX_FRAME_BYTES)]
    last = len(pieces) - 1
    return b"".join(
        frame(DATA, END_STREAM if end_stream and index == last else 0, stream_id, piece)
        for index, piece in enumerate(pieces)
    )


def open_connection(sock: socket.socket, *pairs: tuple[int, int]) -> None:
    """The client's preface and SETTINGS (`pairs`), and the ack of the server's SETTINGS."""
    sock.sendall(PREFACE + settings(*pairs) + frame(SETTINGS, ACK, 0))


@dataclass(frozen=True)
class Frame:
    """A frame the server sent."""

    kind: int
    flags: int
    stream_id: int
    payload: bytes

    @property
    def error_code(self) -> int:
        """RST_STREAM's or GOAWAY's error code."""
        return struct.unpack(">I", self.payload[:4] if self.kind == RST_STREAM else self.payload[4:8])[0]


class FrameReader:
    """The frames a server sends on `sock`, as they come; `closed` once it closed the connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.closed = False
        self.frames: list[Frame] = []

    def read(self, timeout_s: float) -> list[Frame]:
        """What comes within `timeout_s` (or up to the close): the frames completed, also kept in `frames`."""
        self.sock.settimeout(timeout_s)
        try:
            chunk = self.sock.recv(1 << 20)
        except TimeoutError:
            chunk = None
        except (ConnectionError, OSError):
            chunk = b""
        if chunk == b"":
            self.closed = True
        elif chunk:
            self.buffer += chunk
        found = []
        while len(self.buffer) >= 9:
            length = int.from_bytes(self.buffer[:3], "big")
            if len(self.buffer) < 9 + length:
                break
            kind, flags, stream_id = struct.unpack(">BBI", self.buffer[3:9])
            found.append(Frame(kind, flags, stream_id & 0x7FFFFFFF, self.buffer[9 : 9 + length]))
            self.buffer = self.buffer[9 + length :]
        self.frames += found
        return found

    def read_until_closed(self, timeout_s: float) -> bool:
        """Read (dropping DATA) until the server closes the connection; whether it did within `timeout_s`."""
        import time

        deadline = time.monotonic() + timeout_s
        while not self.closed and time.monotonic() < deadline:
            self.read(min(1.0, max(0.01, deadline - time.monotonic())))
            self.frames = [f for f in self.frames if f.kind != DATA]
        return self.closed

    def goaway_code(self) -> int | None:
        """The error code of the server's last GOAWAY, if one came."""
        codes = [f.error_code for f in self.frames if f.kind == GOAWAY]
        return codes[-1] if codes else None

    def reset_code(self, stream_id: int) -> int | None:
        """The error code of the server's RST_STREAM of `stream_id`, if one came."""
        codes = [f.error_code for f in self.frames if f.kind == RST_STREAM and f.stream_id == stream_id]
        return codes[0] if codes else None


def send_until_stopped(sock: socket.socket, chunk: bytes, total_bytes: int, stall_s: float = 5.0) -> tuple[int, str]:
    """Send `chunk` again and again, up to `total_bytes`: how much went, and why it stopped ("sent": all of it;
    "closed": the server closed or reset the connection; "stalled": the server stopped reading for `stall_s`)."""
    sock.settimeout(stall_s)
    sent = 0
    while sent < total_bytes:
        try:
            sock.sendall(chunk)
        except TimeoutError:
            return sent, "stalled"
        except (ConnectionError, OSError):
            return sent, "closed"
        sent += len(chunk)
    return sent, "sent"
