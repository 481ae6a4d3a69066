"""Hostile HTTP/1.1 clients that hold connections: silent ones, slow heads (slowloris), pipelining without reading,
resets. Each attack is bounded in count and time; the server must end it as RFC 9112 allows, keep its memory, and
serve a normal client meanwhile (tests/hostile/http_wire.py's `attack`)."""

from __future__ import annotations

import json
import ssl
import time

import pytest

from tests.hostile.harness import INFER_BODY, MB, HostileServer
from tests.hostile.http_wire import attack, closed_by_server, each_within, read_answer, request, reset

HEADER_TIMEOUT_S = 2
SERVER_FLAGS = ("--header-timeout-s", str(HEADER_TIMEOUT_S), "--body-timeout-s", "2", "--keep-alive-timeout-s", "4")
INFER = request("POST", "/v2/models/mlp/infer", json.dumps(INFER_BODY).encode())


@pytest.fixture(scope="module")
def usual(hostile_server: HostileServer) -> tuple[float, float]:
    """The normal client's medians with nothing else going on."""
    return hostile_server.usual()


def test_silent_connections_are_closed_after_the_header_timeout(
    hostile_server: HostileServer, usual: tuple[float, float]
) -> None:
    with attack(hostile_server, usual, "50 silent connections"):
        silent = [hostile_server.connect("http") for _ in range(50)]
        started = time.monotonic()
        each_within(HEADER_TIMEOUT_S + 8, silent, closed_by_server)
        assert time.monotonic() - started >= HEADER_TIMEOUT_S - 0.5  # (not closed at once: timed out)
        for sock in silent:
            sock.close()


def test_slow_heads_are_refused_with_408(hostile_server: HostileServer, usual: tuple[float, float]) -> None:
    with attack(hostile_server, usual, "20 slowloris heads"):
        slow = [hostile_server.connect("http") for _ in range(20)]
        for sock in slow:
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n")
        open_ = list(slow)
        deadline = time.monotonic() + HEADER_TIMEOUT_S + 6
        while open_ and time.monotonic() < deadline:  # a header line every 0.3 s, while the server takes them
            time.sleep(0.3)
            for sock in list(open_):
                try:
                    sock.sendall(b"x-drip: 1\r\n")
                except OSError:
                    open_.remove(sock)
        answers = [closed_by_server(sock, 8) for sock in slow]
        assert all(answer.startswith(b"HTTP/1.1 408 ") for answer in answers), answers[0][:200]
        for sock in slow:
            sock.close()


def test_pipelining_to_a_client_that_never_reads_is_held_to_a_bound(
    hostile_server: HostileServer, usual: tuple[float, float]
) -> None:
    burst = INFER * 200  # 54 KB a write
    with attack(hostile_server, usual, "4 connections pipelining, never reading"):
        before = hostile_server.rss_bytes()
        clients = [hostile_server.connect("http", timeout_s=0.5) for _ in range(4)]
        sent = [0] * len(clients)
        deadline = time.monotonic() + 6
        stalled = set()
        while len(stalled) < len(clients) and time.monotonic() < deadline:
            for i, sock in enumerate(clients):
                if i in stalled:
                    continue
                try:
                    sent[i] += sock.send(burst)
                except TimeoutError:
                    stalled.add(i)  # the server stopped reading
                except (ConnectionResetError, ssl.SSLEOFError):
                    stalled.add(i)  # (and dropped the connection: its answers unread for keep_alive_timeout_s)
        held = hostile_server.rss_bytes()
        print(f"\n  sent {[f'{n / MB:.1f} MB' for n in sent]}; server RSS +{(held - before) / MB:.1f} MB while held")
        assert len(stalled) == len(clients), f"the server read on: {sent}"
        assert held - before < 50 * MB
        for sock in clients:
            reset(sock)


def test_resets_do_not_flood_the_log(hostile_server: HostileServer, usual: tuple[float, float]) -> None:
    lines = len(hostile_server.log.read_text().splitlines())
    shapes = [b"", b"NOT HTTP\r\n\r\n", b"GET /v2/health/li", INFER, INFER[:-10], b"GET / HTTP/1.1\r\n\r\n"]
    with attack(hostile_server, usual, "connections reset, 300 and at least 1 s"):
        end, count = time.monotonic() + 1, 0  # (long enough for the normal client to be measured)
        while count < 300 or time.monotonic() < end:
            sock = hostile_server.connect("http")
            sock.sendall(shapes[count % len(shapes)])
            reset(sock)
            count += 1
    added = hostile_server.log.read_text().splitlines()[lines:]
    assert len(added) <= 1, added[:5]  # at most the minute's warning about refusals


def test_an_idle_kept_alive_connection_is_closed(hostile_server: HostileServer) -> None:
    sock = hostile_server.connect("http")
    sock.sendall(INFER)
    assert read_answer(sock)[0] == 200
    assert closed_by_server(sock, 4 + 5) == b""
    sock.close()
