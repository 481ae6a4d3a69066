"""Idle gRPC connections: 200 that said their preface and make no call, and 20 that never say it. Those are sent
GOAWAY and closed after the idle timeout (3 s here, up to twice it), these closed after it; the server's memory comes
back and a normal client is served meanwhile."""

from __future__ import annotations

import time

from tests.hostile import h2_frames as h2
from tests.hostile.harness import MB, HostileServer, assert_normal_client_served

SERVER_FLAGS = ("--grpc-idle-timeout-s", "3")  # also the preface timeout, being shorter than 10 s


def test_idle_connections_and_those_without_a_preface_are_closed(hostile_server: HostileServer) -> None:
    usual = hostile_server.usual()
    before = hostile_server.rss_bytes()
    with hostile_server.normal_client() as during:
        idle = []
        for _ in range(200):  # each says its preface at once: on a loaded machine 200 connections take seconds
            idle.append(hostile_server.connect("grpc"))
            h2.open_connection(idle[-1])
        silent = [hostile_server.connect("grpc") for _ in range(20)]
        readers = [h2.FrameReader(sock) for sock in idle + silent]
        deadline = time.monotonic() + 30
        for reader in readers:
            reader.read_until_closed(max(0.1, deadline - time.monotonic()))
            reader.sock.close()
    after = hostile_server.settle_rss(before + 50 * MB)
    medians = during.medians()
    print(
        f"rss {before / MB:.0f} -> {after / MB:.0f} MB; median ms usual {usual[0] * 1e3:.2f} / {usual[1] * 1e3:.2f}, "
        f"during {medians[0] * 1e3:.2f} / {medians[1] * 1e3:.2f} ({len(during.grpc)} calls)"
    )
    assert all(reader.closed for reader in readers), [reader.closed for reader in readers].count(False)
    codes = [reader.goaway_code() for reader in readers[:200]]
    assert codes == [0] * 200, codes  # GOAWAY NO_ERROR: clients reconnect when they need
    assert after < before + 50 * MB
    assert_normal_client_served(during, usual)
