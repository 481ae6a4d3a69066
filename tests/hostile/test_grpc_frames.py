"""Hostile gRPC frames from a client that never reads: floods of PING, of SETTINGS, of empty DATA frames
(CVE-2019-9518) and of 1-byte DATA frames. Each connection is ended with GOAWAY ENHANCE_YOUR_CALM (or, for one
that does not read, its server side aborted) within a bounded count of frames; the server's memory comes back and a
normal client is served meanwhile."""

from __future__ import annotations

import pytest

from tests.hostile import h2_frames as h2
from tests.hostile.harness import MB, HostileServer, assert_normal_client_served, repeat_attack

INFER = "/inference.GRPCInferenceService/ModelInfer"
LIMIT_BYTES = 16 * MB  # far more than the server lets a flood send (FLOOD_ALLOWANCE_BYTES and the ratio)


_HEAD = h2.request_head(1, INFER)
_ONE_MB_MESSAGE = h2.data(1, h2.grpc_message(b"")[:1] + (1 << 20).to_bytes(4, "big"))  # its prefix: 1 MB follow
# What each flood sends first (once), then again and again (never reading).
FLOODS: dict[str, tuple[bytes, bytes]] = {
    "ping": (b"", h2.ping() * 2000),
    "settings": (b"", h2.settings((h2.INITIAL_WINDOW_SIZE, 65_535)) * 2000),
    "empty-data": (_HEAD, h2.frame(h2.DATA, 0, 1) * 2000),
    "tiny-data": (_HEAD + _ONE_MB_MESSAGE, h2.frame(h2.DATA, 0, 1, b"x") * 2000),  # the message a byte a frame
}


def _flood(hostile_server: HostileServer, first: bytes, chunk: bytes) -> tuple[int, str]:
    """Send `first`, then `chunk` again and again up to LIMIT_BYTES, never reading: what went and how it stopped."""
    sock = hostile_server.connect("grpc")
    try:
        h2.open_connection(sock)
        sock.sendall(first)
        sent, why = h2.send_until_stopped(sock, chunk, LIMIT_BYTES, stall_s=10)
        if why != "closed":  # the server may have ended it with the last bytes that went
            reader = h2.FrameReader(sock)
            why = "closed" if reader.read_until_closed(10) else why
        return sent, why
    finally:
        sock.close()


@pytest.mark.parametrize("kind", list(FLOODS))
def test_a_flood_of_frames_ends_its_connection(hostile_server: HostileServer, kind: str) -> None:
    usual = hostile_server.usual()
    before = hostile_server.rss_bytes()
    first, chunk = FLOODS[kind]
    with hostile_server.normal_client() as during:
        outcomes = repeat_attack(during, lambda: _flood(hostile_server, first, chunk), max_attacks=10)
    after = hostile_server.settle_rss(before + 50 * MB)
    sent = max(s for s, _ in outcomes)
    print(
        f"{kind}: {len(outcomes)} attacks, at most {sent / MB:.1f} MB each, {[w for _, w in outcomes][:3]}; rss "
        f"{before / MB:.0f} -> {after / MB:.0f} MB; median ms usual {usual[0] * 1e3:.2f} / {usual[1] * 1e3:.2f}, "
        f"during {during.medians()[0] * 1e3:.2f} / {during.medians()[1] * 1e3:.2f}"
    )
    assert {why for _, why in outcomes} == {"closed"}
    assert sent < LIMIT_BYTES
    assert after < before + 50 * MB
    assert_normal_client_served(during, usual)
