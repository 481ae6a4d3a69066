"""Hostile HTTP/1.1 requests: compression bombs, a missing or doubled Host, smuggling shapes, oversized heads. Each
attack is bounded in count and time; the server must refuse it with the right 4xx as RFC 9112 asks, keep its memory,
and serve a normal client meanwhile (tests/hostile/http_wire.py's `attack`)."""

from __future__ import annotations

import gzip
import json
import threading
import time

import pytest

from tests.hostile import http_wire
from tests.hostile.harness import INFER_BODY, MB, HostileServer
from tests.hostile.http_wire import attack, closed_by_server, read_answer

LIMIT = 64 * MB  # the default max_body_bytes
INFER = http_wire.request("POST", "/v2/models/mlp/infer", json.dumps(INFER_BODY).encode())


@pytest.fixture(scope="module")
def usual(hostile_server: HostileServer) -> tuple[float, float]:
    """The normal client's medians with nothing else going on."""
    return hostile_server.usual()


def test_gzip_bombs_are_413_and_other_clients_are_served_meanwhile(
    hostile_server: HostileServer, usual: tuple[float, float]
) -> None:
    bomb = gzip.compress(b"\0" * (LIMIT + MB), compresslevel=9)  # ~65 KB, inflating past the limit
    headers = b"host: x\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
    shot = http_wire.request("POST", "/v2/models/mlp/infer", bomb, headers)
    statuses: list[int] = []

    def bomber() -> None:
        sock = hostile_server.connect("http", timeout_s=30)
        for _ in range(6):
            sock.sendall(shot)
            statuses.append(read_answer(sock)[0])
        sock.close()

    with attack(hostile_server, usual, "2 connections sending 6 gzip bombs each"):
        bombers = [threading.Thread(target=bomber) for _ in range(2)]
        for thread in bombers:
            thread.start()
        for thread in bombers:
            thread.join(60)
    assert statuses == [413] * 12


@pytest.mark.parametrize(
    ("head", "status", "error"),
    [
        (b"GET /v2/health/live HTTP/1.1\r\n\r\n", 400, "an HTTP/1.1 request needs exactly one Host header, got 0"),
        (
            b"GET /v2/health/live HTTP/1.1\r\nhost: a\r\nhost: b\r\n\r\n",
            400,
            "an HTTP/1.1 request needs exactly one Host header, got 2",
        ),
        (
            b"POST /v2/models/mlp/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n"
            b"0\r\n\r\n",
            400,
            "malformed HTTP/1.1 request: Transfer-Encoding can't be present with Content-Length",
        ),
        (
            b"POST /v2/models/mlp/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ncontent-length: 40\r\n\r\n{}",
            400,
            "malformed HTTP/1.1 request: Duplicate Content-Length",
        ),
        (
            b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n" + b"x-big: " + b"a" * 70_000 + b"\r\n\r\n",
            431,
            "the request line and headers are over the limit of 65536 bytes",
        ),
    ],
    ids=["no Host", "two Hosts", "Content-Length and Transfer-Encoding", "two Content-Lengths", "a 70 KB head"],
)
def test_bad_heads_are_refused_and_the_connection_closed(
    hostile_server: HostileServer, usual: tuple[float, float], head: bytes, status: int, error: str,
    request: pytest.FixtureRequest,
) -> None:  # fmt: skip
    with attack(hostile_server, usual, f"{request.node.name}: new connections for 1 s"):
        end = time.monotonic() + 1  # (long enough for the normal client to be measured)
        while time.monotonic() < end:
            sock = hostile_server.connect("http")
            sock.sendall(head + INFER)  # (a smuggled request behind it is never answered)
            received = closed_by_server(sock, 10)
            sock.close()
            answer_head, _, body = received.partition(b"\r\n\r\n")
            assert answer_head.startswith(b"HTTP/1.1 %d " % status), received[:200]
            assert json.loads(body)["error"].startswith(error) and b"connection: close" in answer_head


def test_an_http_10_request_may_omit_host(hostile_server: HostileServer) -> None:
    sock = hostile_server.connect("http")
    sock.sendall(b"GET /v2/health/live HTTP/1.0\r\n\r\n")
    assert read_answer(sock)[0] == 200
    sock.close()
