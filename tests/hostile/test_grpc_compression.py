"""Hostile compressed gRPC messages: two connections sending gzip bombs (65 KB that inflate past the 64 MiB
message limit) call after call. Each call is refused RESOURCE_EXHAUSTED; the inflating happens on a thread of its
own, so the loop and a normal client go on; the server's memory comes back."""

from __future__ import annotations

import gzip
import threading

import grpc
import zttp

from tests.hostile.harness import MB, HostileServer, assert_normal_client_served

INFER = b"/inference.GRPCInferenceService/ModelInfer"
BOMB = gzip.compress(b"\0" * (65 * MB), compresslevel=9)  # ~65 KB
CALLS = 8  # per connection


def _bomb_calls(hostile_server: HostileServer, statuses: list[int]) -> None:
    """CALLS bombs on one connection, one after the other, each answer's grpc-status kept."""
    sock = hostile_server.connect("grpc", timeout_s=60)
    client = zttp.Connection(zttp.CLIENT, protocol=zttp.HTTP2)
    client.initiate_connection()
    headers = [(b"host", b"localhost"), (b"content-type", b"application/grpc"), (b"te", b"trailers")]
    try:
        for _ in range(CALLS):
            stream = client.send_request(b"POST", INFER, b"2", [*headers, (b"grpc-encoding", b"gzip")])
            stream.send_data(b"\x01" + len(BOMB).to_bytes(4, "big") + BOMB)
            stream.end_message()
            status = None
            while status is None:
                sock.sendall(client.data_to_send())
                chunk = sock.recv(1 << 16)
                assert chunk, "the server closed the connection"
                client.receive_data(chunk)
                while (event := client.next_event()) is not zttp.NEED_DATA:
                    fields = event.trailers if isinstance(event, zttp.EndOfMessage) else None
                    if isinstance(event, zttp.Response):
                        fields = list(event.headers)
                    if isinstance(event, zttp.RstStream):
                        status = -event.error_code
                    if fields and event.stream_id == stream.stream_id and b"grpc-status" in dict(fields):
                        status = int(dict(fields)[b"grpc-status"])
            statuses.append(status)
    finally:
        sock.close()


def test_gzip_bombs_from_two_connections_are_refused_off_the_loop(hostile_server: HostileServer) -> None:
    usual = hostile_server.usual()
    before = hostile_server.rss_bytes()
    statuses: list[int] = []
    with hostile_server.normal_client() as during:
        attackers = [threading.Thread(target=_bomb_calls, args=(hostile_server, statuses)) for _ in range(2)]
        for attacker in attackers:
            attacker.start()
        for attacker in attackers:
            attacker.join(timeout=120)
    after = hostile_server.settle_rss(before + 50 * MB)
    medians = during.medians()
    print(
        f"{len(statuses)} bombs; rss {before / MB:.0f} -> {after / MB:.0f} MB; median ms usual {usual[0] * 1e3:.2f} / "
        f"{usual[1] * 1e3:.2f}, during {medians[0] * 1e3:.2f} / {medians[1] * 1e3:.2f} ({len(during.grpc)} calls)"
    )
    assert statuses == [grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]] * (2 * CALLS)
    assert after < before + 50 * MB
    assert_normal_client_served(during, usual)
