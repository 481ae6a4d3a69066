"""Request bodies: compressed ones decompressed within the limit, a little on the event loop and the rest in a
thread (over a live server: test_triton_routes.py's compression tests and tests/hostile/test_http_bodies.py)."""

from __future__ import annotations

import gzip
import zlib

import pytest

from layerserve.errors import BadRequestError, PayloadTooLargeError
from layerserve.transports.http.bodies import _WBITS, _Inflation


def _inflation(data: bytes, encoding: str = "gzip", limit: int = 1_000_000) -> _Inflation:
    return _Inflation(data, _WBITS[encoding], encoding, limit)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_body_decompressed_in_budgets_equals_the_whole(encoding: str) -> None:
    original = bytes(range(256)) * 2000 + b"tail"
    compress = gzip.compress if encoding == "gzip" else zlib.compress
    inflation = _inflation(compress(original), encoding)
    rounds = 0
    while not inflation.run(7_000):
        rounds += 1
    assert b"".join(inflation.parts) == original and rounds == len(original) // 7_000


def test_gzip_members_one_after_the_other_are_one_body() -> None:
    inflation = _inflation(gzip.compress(b"a" * 10_000) + gzip.compress(b"b" * 10_000))
    assert not inflation.run(15_000) and inflation.run(15_000)
    assert b"".join(inflation.parts) == b"a" * 10_000 + b"b" * 10_000


def test_a_bomb_stops_at_the_budget_and_is_refused_past_the_limit() -> None:
    inflation = _inflation(gzip.compress(b"\0" * 50_000_000), limit=10_000_000)
    assert not inflation.run(256 * 1024) and inflation.size == 256 * 1024  # what the event loop does
    with pytest.raises(PayloadTooLargeError, match="over the limit of 10000000 bytes"):
        inflation.run(10_000_001)
    assert inflation.size == 10_000_001


def test_truncated_and_corrupt_bodies_are_bad_requests() -> None:
    with pytest.raises(BadRequestError, match="truncated"):
        _inflation(gzip.compress(b"x" * 100_000)[:-20]).run(1_000_000)
    with pytest.raises(BadRequestError, match="not valid gzip"):
        _inflation(b"not gzip").run(1_000_000)
