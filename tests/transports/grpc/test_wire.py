"""gRPC's HTTP/2 conventions: grpc-timeout, status trailers, metadata, compressed messages."""

from __future__ import annotations

import gzip
import zlib

import grpc
import pytest

from layerserve.transports.grpc import wire
from layerserve.transports.grpc.wire import CallError


def test_timeouts_in_every_unit_and_bad_ones() -> None:
    assert wire.timeout_s(None) is None
    seconds = [wire.timeout_s(v) for v in (b"2H", b"3M", b"5S", b"250m", b"70u", b"900n")]
    assert seconds == pytest.approx([7200, 180, 5, 0.25, 70e-6, 900e-9])
    for bad in (b"", b"S", b"10", b"10x", b"-1S", b"123456789S"):
        with pytest.raises(CallError) as caught:
            wire.timeout_s(bad)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_status_trailers_percent_encode_the_message() -> None:
    assert wire.status_trailers(grpc.StatusCode.OK, "") == [(b"grpc-status", b"0")]
    trailers = dict(wire.status_trailers(grpc.StatusCode.NOT_FOUND, "model 'ü' 100% gone\n"))
    assert trailers[b"grpc-status"] == b"5"
    assert trailers[b"grpc-message"] == b"model '%C3%BC' 100%25 gone%0A"


def test_metadata_leaves_out_the_transport_s_headers_and_decodes_binary_values() -> None:
    headers = [(b"content-type", b"application/grpc"), (b"te", b"trailers"), (b"grpc-timeout", b"1S"),
               (b"authorization", b"Bearer t"), (b"trace-bin", b"AAEC")]  # fmt: skip
    assert wire.metadata(headers) == (("authorization", "Bearer t"), ("trace-bin", b"\x00\x01\x02"))


def test_compressed_messages_inflate_within_the_limit() -> None:
    message = b"x" * 1000
    assert wire.decompress(gzip.compress(message), b"gzip", 1000) == message
    assert wire.decompress(zlib.compress(message), b"deflate", 1000) == message
    for data, encoding, code in (
        (gzip.compress(message), b"gzip", grpc.StatusCode.RESOURCE_EXHAUSTED),  # inflates past the limit
        (b"not gzip", b"gzip", grpc.StatusCode.INTERNAL),
        (gzip.compress(message)[:-12], b"gzip", grpc.StatusCode.INTERNAL),  # truncated
        (message, b"snappy", grpc.StatusCode.UNIMPLEMENTED),
        (message, None, grpc.StatusCode.UNIMPLEMENTED),
    ):
        with pytest.raises(CallError) as caught:
            wire.decompress(data, encoding, 999)
        assert caught.value.code == code


def test_a_message_is_framed_with_its_length() -> None:
    assert wire.frame(b"abc") == b"\x00\x00\x00\x00\x03abc"
