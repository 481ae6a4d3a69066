"""An attacker's HTTP/1.1 on a raw connection of the harness (`HostileServer.connect("http")`, plaintext or TLS):
its answers read by hand, its end seen, its reset."""

from __future__ import annotations

import re
import socket
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tests.hostile.harness import MB, HostileServer, Latencies, assert_normal_client_served

_LENGTH = re.compile(rb"\r\ncontent-length: *(\d+)", re.IGNORECASE)


def request(method: str, path: str, body: bytes = b"", headers: bytes = b"host: x\r\n") -> bytes:
    """One HTTP/1.1 request's bytes, with a Content-Length when it has a body."""
    length = b"content-length: %d\r\n" % len(body) if body or method == "POST" else b""
    return f"{method} {path} HTTP/1.1\r\n".encode() + headers + length + b"\r\n" + body


def read_answer(sock: socket.socket) -> tuple[int, bytes, bytes]:
    """The next answer's status, head and body (framed by its Content-Length); what follows it is dropped.

    Raises:
        EOFError: the connection ended first.
    """
    data = b""
    while b"\r\n\r\n" not in data:
        data += _recv(sock)
    head, _, rest = data.partition(b"\r\n\r\n")
    found = _LENGTH.search(head)
    length = int(found.group(1)) if found else 0
    while len(rest) < length:
        rest += _recv(sock)
    return int(head.split(b" ", 2)[1]), head, rest[:length]


def _recv(sock: socket.socket) -> bytes:
    chunk = sock.recv(65536)
    if not chunk:
        raise EOFError("the server closed the connection")
    return chunk


def closed_by_server(sock: socket.socket, timeout_s: float) -> bytes:
    """What the server sent until it closed the connection (or reset it).

    Raises:
        AssertionError: still open after `timeout_s`.
    """
    received, deadline = b"", time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except OSError:  # a reset (or TLS's own word for the end)
            return received
        if not chunk:
            return received
        received += chunk
    raise AssertionError(f"the server left the connection open for {timeout_s} s (received {received[:80]!r})")


def reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a hostile client does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@contextmanager
def attack(server: HostileServer, usual: tuple[float, float], name: str) -> Iterator[None]:
    """Run the block as an attack: a normal client served within twice its usual latency during it and after it,
    and the server's memory back within 50 MB of before once it is over (the figures printed: pytest -s)."""
    before = server.rss_bytes()
    with server.normal_client() as during:
        yield
    peak = server.rss_bytes()
    after_attack = _served_for(server, 1.0)
    settled = server.settle_rss(before + 50 * MB)
    medians = [f"{m * 1e3:.2f}" for m in (*usual, *during.medians(), *after_attack.medians())]
    print(
        f"\n{name}: RSS {before / MB:.0f} MB before, {peak / MB:.0f} MB at its end, {settled / MB:.0f} MB after; "
        f"normal client median HTTP/gRPC ms usual {medians[0]}/{medians[1]}, during {medians[2]}/{medians[3]} "
        f"({len(during.http)} requests), after {medians[4]}/{medians[5]}"
    )
    assert_normal_client_served(during, usual)
    assert_normal_client_served(after_attack, usual)
    assert settled <= before + 50 * MB, f"{name}: {settled / MB:.0f} MB, {before / MB:.0f} MB before"


def _served_for(server: HostileServer, seconds: float) -> Latencies:
    with server.normal_client() as seen:
        time.sleep(seconds)
    return seen


def each_within(deadline_s: float, items: list[socket.socket], check: Callable[[socket.socket, float], object]) -> None:
    """`check(item, time left)` on every item, all within one deadline."""
    deadline = time.monotonic() + deadline_s
    for item in items:
        check(item, max(0.1, deadline - time.monotonic()))
