"""The load generator's HTTP/2 framing: HPACK integers and strings, and reading grpc-status from trailers."""

from __future__ import annotations

from layerserve.bench.h2_client import _integer, _read_integer, grpc_status, request_headers


def test_hpack_integers_round_trip() -> None:
    for value in (0, 14, 15, 16, 127, 128, 1337, 2**20):
        for bits in (4, 5, 6, 7):
            encoded = _integer(value, bits, 0)
            assert _read_integer(encoded, 0, bits) == (value, len(encoded))


def test_grpc_status_of_literal_and_indexed_fields() -> None:
    status = b"\x40" + _integer(11, 7, 0) + b"grpc-status" + _integer(2, 7, 0) + b"14"  # with incremental indexing
    message = b"\x00" + _integer(12, 7, 0) + b"grpc-message" + _integer(3, 7, 0) + b"bad"
    assert grpc_status(b"\x88" + message + status) == 14  # :status 200 indexed, then literals
    assert grpc_status(b"\x10" + _integer(11, 7, 0) + b"grpc-status" + _integer(1, 7, 0) + b"0") == 0  # never indexed
    assert grpc_status(b"\x88") is None
    assert grpc_status(b"\x00" + _integer(11, 7, 0) + b"grpc-status" + b"\x81\x07") == 2  # Huffman: UNKNOWN


def test_request_headers_start_with_post_and_http() -> None:
    block = request_headers("127.0.0.1:8001", "/inference.GRPCInferenceService/ModelInfer")
    assert block[:2] == b"\x83\x86" and b"application/grpc" in block and b"te" in block
