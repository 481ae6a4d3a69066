"""Hostile gRPC streams: a ModelStreamInfer client that announces a zero window and sends 150,000 requests, and a
reflection stream whose answers are never read. Each has its call refused (RST_STREAM ENHANCE_YOUR_CALM, which
gRPC clients see as RESOURCE_EXHAUSTED) after a bounded backlog; the server's memory comes back and a normal
client is served meanwhile."""

from __future__ import annotations

from grpc_reflection.v1alpha import reflection_pb2
from tritonclient.grpc import service_pb2

from tests.hostile import h2_frames as h2
from tests.hostile.harness import MB, HostileServer, assert_normal_client_served, repeat_attack

STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


def _infer_request() -> bytes:
    request = service_pb2.ModelInferRequest(model_name="mlp")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 10])
    tensor.contents.fp32_contents.extend([0.5] * 10)
    return request.SerializeToString()


def _flood_stream(hostile_server: HostileServer, path: str, message: bytes, count: int, window: int | None) -> int:
    """Open a stream on `path` and send it `count` copies of `message`, never reading the answers; the server's
    RST_STREAM code for it (None: it came not)."""
    sock = hostile_server.connect("grpc")
    try:
        h2.open_connection(sock, *([(h2.INITIAL_WINDOW_SIZE, window)] if window is not None else []))
        sock.sendall(h2.request_head(1, path))
        per_frame = h2.MAX_FRAME_BYTES // len(h2.grpc_message(message))
        chunk = h2.data(1, h2.grpc_message(message) * per_frame)
        frames = count // per_frame
        sent, why = h2.send_until_stopped(sock, chunk, frames * len(chunk), stall_s=10)
        reader = h2.FrameReader(sock)
        while reader.reset_code(1) is None and not reader.closed:
            if not reader.read(10):
                break
        print(f"{path}: sent {sent / MB:.1f} MB ({why}), reset {reader.reset_code(1)}")
        return reader.reset_code(1) or 0
    finally:
        sock.close()


def _report(before: int, after: int, usual: tuple[float, float], during: tuple[float, float], attacks: int) -> None:
    print(
        f"{attacks} attacks; rss {before / MB:.0f} -> {after / MB:.0f} MB; median ms usual http {usual[0] * 1e3:.2f}"
        f" grpc {usual[1] * 1e3:.2f}, during http {during[0] * 1e3:.2f} grpc {during[1] * 1e3:.2f}"
    )


def test_a_model_stream_with_a_zero_window_and_150000_requests_is_refused(hostile_server: HostileServer) -> None:
    usual = hostile_server.usual()
    before = hostile_server.rss_bytes()
    with hostile_server.normal_client() as during:
        codes = repeat_attack(
            during, lambda: _flood_stream(hostile_server, STREAM_INFER, _infer_request(), 150_000, window=0)
        )
    assert set(codes) == {h2.ENHANCE_YOUR_CALM}
    after = hostile_server.settle_rss(before + 50 * MB)
    _report(before, after, usual, during.medians(), len(codes))
    assert after < before + 50 * MB
    assert_normal_client_served(during, usual)
    with hostile_server.normal_client() as later:
        for _ in range(20):
            hostile_server.grpc_round_trip()
    assert_normal_client_served(later, usual)


def test_a_reflection_stream_whose_answers_are_not_read_is_refused(hostile_server: HostileServer) -> None:
    usual = hostile_server.usual()
    before = hostile_server.rss_bytes()
    message = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    with hostile_server.normal_client() as during:
        codes = repeat_attack(during, lambda: _flood_stream(hostile_server, REFLECTION, message, 20_000, window=None))
    assert set(codes) == {h2.ENHANCE_YOUR_CALM}
    after = hostile_server.settle_rss(before + 50 * MB)
    _report(before, after, usual, during.medians(), len(codes))
    assert after < before + 50 * MB
    assert_normal_client_served(during, usual)
