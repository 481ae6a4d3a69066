"""gRPC over HTTP/2, the parts above the frames: the 5-byte message prefix, `grpc-timeout`, the status trailers
and metadata (https://github.com/grpc/grpc/blob/master/doc/PROTOCOL-HTTP2.md)."""

from __future__ import annotations

import base64
import zlib
from urllib.parse import quote

import grpc

PREFIX_BYTES = 5
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HTTP1_MESSAGE = (
    b'{"error": "this is the gRPC port: it speaks HTTP/2 (gRPC clients such as tritonclient.grpc); '
    b'send HTTP/1.1 requests to the HTTP port (--port, 8000 by default)"}'
)
# The answer to an HTTP/1.1 request sent to the gRPC port (curl, a browser, an HTTP client on the wrong port).
HTTP1_REFUSAL = (
    b"HTTP/1.1 426 Upgrade Required\r\nupgrade: h2c\r\nconnection: close\r\ncontent-type: application/json\r\n"
    + b"content-length: "
    + str(len(_HTTP1_MESSAGE)).encode()
    + b"\r\n\r\n"
    + _HTTP1_MESSAGE
)
# Answer headers, the same for every call (grpc-accept-encoding: what `decompress` reads).
RESPONSE_HEADERS = [(b"content-type", b"application/grpc"), (b"grpc-accept-encoding", b"identity,deflate,gzip")]
# Request headers that are the transport's, not the call's metadata.
_NOT_METADATA = frozenset(
    {b"content-type", b"te", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding", b"content-length"}
)
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_INFLATE_STEP_BYTES = 64 * 1024
_KEPT_BYTES = 1 << 20  # a message inflating to more is measured before it is inflated whole
_STATUS_NUMBERS = {code: str(code.value[0]).encode() for code in grpc.StatusCode}


class CallError(Exception):
    """A call ends with this status (the handler's `abort`, or a request the door refuses)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def frame(message: bytes) -> bytes:
    """One uncompressed length-prefixed message."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


def timeout_s(value: bytes | None) -> float | None:
    """Seconds of a `grpc-timeout` header (`100m`, `5S`, ...), or None without one.

    Raises:
        CallError: INVALID_ARGUMENT for a header that is not 1-8 digits and a unit of H M S m u n.
    """
    if value is None:
        return None
    digits, unit = value[:-1], value[-1:]
    scale = _TIMEOUT_UNITS.get(unit)
    if scale is None or not digits.isdigit() or len(digits) > 8:
        raise CallError(grpc.StatusCode.INVALID_ARGUMENT, f"invalid grpc-timeout {value.decode('latin-1')!r}")
    return int(digits) * scale


def status_trailers(code: grpc.StatusCode, details: str) -> list[tuple[bytes, bytes]]:
    """`grpc-status` and, when there is one, the percent-encoded `grpc-message`."""
    trailers = [(b"grpc-status", _STATUS_NUMBERS[code])]
    if details:
        trailers.append((b"grpc-message", quote(details, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode()))
    return trailers


def metadata(headers: list[tuple[bytes, bytes]]) -> tuple[tuple[str, str | bytes], ...]:
    """A call's metadata as grpc gives it to handlers: text values as str, `-bin` values base64-decoded."""
    pairs: list[tuple[str, str | bytes]] = []
    for name, value in headers:
        if name.startswith(b":") or name in _NOT_METADATA:
            continue
        key = name.decode("latin-1")
        if key.endswith("-bin"):
            pairs.append((key, base64.b64decode(value + b"=" * (-len(value) % 4))))
        else:
            pairs.append((key, value.decode("latin-1")))
    return tuple(pairs)


def decompress(message: bytes, encoding: bytes | None, max_bytes: int) -> bytes:
    """A message sent with the compressed flag, in the call's `grpc-encoding`. It is inflated _INFLATE_STEP_BYTES
    at a time, kept while small; a bigger one is measured first (its pieces dropped as they come, so a gzip bomb is
    refused without its output ever held: whole outputs of 64 MiB stayed resident in the allocator), then inflated
    in one go when under `max_bytes`.

    Raises:
        CallError: UNIMPLEMENTED for an encoding other than gzip or deflate, RESOURCE_EXHAUSTED when it inflates
            past `max_bytes`, INTERNAL when it does not inflate.
    """
    if encoding not in (b"gzip", b"deflate"):
        name = (encoding or b"identity").decode("latin-1")
        raise CallError(grpc.StatusCode.UNIMPLEMENTED, f"compressed message in unsupported encoding {name!r}")
    wbits = 31 if encoding == b"gzip" else 15
    inflater = zlib.decompressobj(wbits=wbits)
    pieces: list[bytes] = []
    size, rest = 0, message
    try:
        while True:
            piece = inflater.decompress(rest, _INFLATE_STEP_BYTES)
            size += len(piece)
            if size > max_bytes:
                raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED, too_large(max_bytes + 1, max_bytes))
            if size <= _KEPT_BYTES:
                pieces.append(piece)
            rest = inflater.unconsumed_tail
            if not rest and len(piece) < _INFLATE_STEP_BYTES:
                break
        if not inflater.eof:
            raise CallError(grpc.StatusCode.INTERNAL, "the compressed message is truncated")
        if size > _KEPT_BYTES:
            return zlib.decompressobj(wbits=wbits).decompress(message)
    except zlib.error as error:
        raise CallError(grpc.StatusCode.INTERNAL, f"the message does not decompress: {error}") from None
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def too_large(size: int, max_bytes: int) -> str:
    """grpc's own message for a message over the limit."""
    return f"Received message larger than max ({size} vs. {max_bytes})"
