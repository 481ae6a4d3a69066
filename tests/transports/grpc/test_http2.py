"""GrpcHttp2, the gRPC door's HTTP/2 core, with no socket: a zttp client connection makes the client's bytes, the
core's events and bytes to send are checked, and the client reads the answers (status trailers, resets, GOAWAY)."""

from __future__ import annotations

import gzip
from typing import Any

import grpc
import zttp

from layerserve.transports.grpc import wire
from layerserve.transports.grpc.http2 import (
    CallClosed,
    CallStarted,
    CompressedMessageReceived,
    ConnectionEnded,
    GrpcHttp2,
    MessageReceived,
    RequestEnded,
    WindowOpened,
)

PATH = b"/test.Echo/Echo"
GRPC = [(b"content-type", b"application/grpc"), (b"te", b"trailers")]


class Pair:
    """A client (zttp's client role) and the core under test, bytes passed between them by hand."""

    def __init__(self, max_message_bytes: int = 1 << 20, max_streams: int = 4_000) -> None:
        self.client = zttp.Connection(zttp.CLIENT, protocol=zttp.HTTP2)
        self.client.initiate_connection()
        self.core = GrpcHttp2(max_message_bytes, max_streams)

    def call(self, *messages: bytes, headers: list[tuple[bytes, bytes]] | None = None, end: bool = True) -> int:
        """Open a call with these (already framed) messages; its stream id."""
        stream = self.client.send_request(b"POST", PATH, b"2", [(b"host", b"x"), *(headers or GRPC)])
        for message in messages:
            stream.send_data(message)
        if end:
            stream.end_message()
        return stream.stream_id

    def to_core(self) -> list[Any]:
        """The client's bytes into the core: its events."""
        return self.core.receive_data(self.client.data_to_send())

    def to_client(self) -> list[Any]:
        """The core's bytes into the client: the client's events (SETTINGS and PINGs left out)."""
        self.client.receive_data(self.core.data_to_send())
        events = []
        while (event := self.client.next_event()) is not zttp.NEED_DATA:
            if not isinstance(event, (zttp.Settings, zttp.Ping)):
                events.append(event)
        return events


def _status(events: list[Any], stream_id: int) -> tuple[int, bytes]:
    """The grpc-status and grpc-message of a stream's answer (trailers, or a trailers-only head)."""
    for event in events:
        fields = None
        if isinstance(event, zttp.EndOfMessage) and event.stream_id == stream_id:
            fields = event.trailers
        elif isinstance(event, zttp.Response) and event.stream_id == stream_id:
            fields = list(event.headers)
        found = dict(fields or ())
        if b"grpc-status" in found:
            return int(found[b"grpc-status"]), found.get(b"grpc-message", b"")
    raise AssertionError(f"no status for stream {stream_id} in {events}")


def test_a_unary_call_is_started_its_message_read_and_its_answer_and_status_sent() -> None:
    pair = Pair()
    stream_id = pair.call(wire.frame(b"hello"), headers=[*GRPC, (b"grpc-timeout", b"250m"), (b"x-trace", b"7")])
    started, message, ended = pair.to_core()
    assert isinstance(started, CallStarted) and started.path == PATH and started.timeout_s == 0.25
    assert (b"x-trace", b"7") in started.headers
    assert message == MessageReceived(stream_id, b"hello") and ended == RequestEnded(stream_id)
    pair.core.send_message(stream_id, b"olleh")
    pair.core.end_call(stream_id, grpc.StatusCode.OK, "")
    events = pair.to_client()
    (response,) = [e for e in events if isinstance(e, zttp.Response)]
    assert response.status_code == 200 and dict(response.headers)[b"content-type"] == b"application/grpc"
    assert b"".join(e.data for e in events if isinstance(e, zttp.Data)) == wire.frame(b"olleh")
    assert _status(events, stream_id) == (0, b"") and pair.core.open_streams == 0


def test_a_message_in_pieces_and_several_messages_of_a_stream_come_out_whole() -> None:
    pair = Pair()
    framed = wire.frame(b"a" * 100) + wire.frame(b"b" * 10)
    stream_id = pair.call(framed[:3], end=False)
    assert [type(e) for e in pair.to_core()] == [CallStarted]
    pair.client.stream(stream_id).send_data(framed[3:50])
    assert pair.to_core() == []
    pair.client.stream(stream_id).send_data(framed[50:])
    pair.client.stream(stream_id).end_message()
    assert pair.to_core() == [
        MessageReceived(stream_id, b"a" * 100), MessageReceived(stream_id, b"b" * 10), RequestEnded(stream_id)
    ]  # fmt: skip


def test_a_compressed_message_comes_out_as_it_came_with_its_encoding() -> None:
    pair = Pair()  # the IO inflates it, off the event loop
    compressed = gzip.compress(b"x" * 1000)
    gzipped = b"\x01" + len(compressed).to_bytes(4, "big") + compressed
    stream_id = pair.call(gzipped, headers=[*GRPC, (b"grpc-encoding", b"gzip")])
    assert CompressedMessageReceived(stream_id, compressed, b"gzip") in pair.to_core()


def test_a_message_over_the_limit_ends_its_call_and_the_others_go_on() -> None:
    pair = Pair(max_message_bytes=1000)
    too_big = pair.call(wire.frame(b"x" * 1001)[:200], end=False)  # refused from its prefix, before its bytes
    fine = pair.call(wire.frame(b"ok"))
    events = pair.to_core()
    assert CallClosed(too_big) in events and MessageReceived(fine, b"ok") in events
    code, message = _status(pair.to_client(), too_big)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and b"larger than max (1001 vs. 1000)" in message


def test_a_request_ending_inside_a_message_and_a_bad_timeout_are_refused() -> None:
    pair = Pair()
    cut = pair.call(wire.frame(b"hello")[:6])
    bad_timeout = pair.call(wire.frame(b"x"), headers=[*GRPC, (b"grpc-timeout", b"soon")])
    events = pair.to_core()
    assert CallClosed(cut) in events and not any(getattr(e, "stream_id", 0) == bad_timeout for e in events)
    answers = pair.to_client()
    assert _status(answers, cut)[0] == grpc.StatusCode.INTERNAL.value[0]
    assert _status(answers, bad_timeout) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], b"invalid grpc-timeout 'soon'")


def test_a_request_that_is_not_grpc_gets_415() -> None:
    pair = Pair()
    stream_id = pair.call(b"{}", headers=[(b"content-type", b"application/json")])
    assert pair.to_core() == []
    (response,) = [e for e in pair.to_client() if isinstance(e, zttp.Response)]
    assert response.stream_id == stream_id and response.status_code == 415


def test_a_client_reset_closes_its_call() -> None:
    pair = Pair()
    stream_id = pair.call(wire.frame(b"x"), end=False)
    pair.to_core()
    pair.client.stream(stream_id).reset(8)  # CANCEL
    assert pair.to_core() == [CallClosed(stream_id)] and pair.core.open_streams == 0
    pair.to_client()  # what the core had to send until now (acknowledgements)
    pair.core.end_call(stream_id, grpc.StatusCode.OK, "")  # the handler's late answer: nothing is sent
    assert pair.core.data_to_send() == b""


def test_an_answer_before_the_request_ended_resets_the_stream_with_no_error() -> None:
    pair = Pair()
    stream_id = pair.call(wire.frame(b"x"), end=False)
    pair.to_core()
    pair.core.end_call(stream_id, grpc.StatusCode.INVALID_ARGUMENT, "refused early")
    events = pair.to_client()
    assert _status(events, stream_id) == (3, b"refused early")
    assert any(isinstance(e, zttp.RstStream) and e.error_code == 0 for e in events)  # the client may stop sending


def test_the_connection_goes_away_before_zttps_stream_limit_and_refuses_later_streams() -> None:
    pair = Pair(max_streams=3)
    ids = [pair.call(wire.frame(b"x")) for _ in range(3)]
    assert len([e for e in pair.to_core() if isinstance(e, CallStarted)]) == 3 and pair.core.going_away
    for stream_id in ids:
        pair.core.end_call(stream_id, grpc.StatusCode.OK, "")
    events = pair.to_client()
    (going_away,) = [e for e in events if isinstance(e, zttp.GoAway)]
    assert going_away.error_code == 0 and going_away.last_stream_id == ids[-1]  # every call taken is answered
    assert all(_status(events, stream_id)[0] == 0 for stream_id in ids)


def test_answers_beyond_the_clients_window_wait_for_it() -> None:
    pair = Pair()
    stream_id = pair.call(wire.frame(b"x"))
    pair.to_core()
    pair.core.send_message(stream_id, b"y" * 200_000)  # past HTTP/2's default 64 KiB window
    assert pair.core.pending_bytes(stream_id) > 0 and pair.core.has_pending_send()
    pair.to_client()
    pair.client.stream(stream_id)  # the client's reading of DATA gives credit back through WINDOW_UPDATEs
    assert any(isinstance(e, WindowOpened) for e in pair.to_core())


def test_an_http1_request_is_told_where_it_belongs() -> None:
    core = GrpcHttp2(1 << 20)
    (ended,) = core.receive_data(b"POST /v2/models/m/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
    assert isinstance(ended, ConnectionEnded) and "HTTP/1.1" in ended.reason
    assert core.data_to_send().startswith(b"HTTP/1.1 426 Upgrade Required\r\n")
    garbage = GrpcHttp2(1 << 20)
    garbage.receive_data(wire.HTTP2_PREFACE)
    assert isinstance(garbage.receive_data(b"\x00" * 64)[-1], ConnectionEnded)  # not frames: closed


def test_a_connection_of_frames_without_payload_is_told_to_calm_down() -> None:
    pair = Pair()
    pings = b"\x00\x00\x08\x06\x00\x00\x00\x00\x00" + b"12345678"  # PING frames (zttp's client has no way to send)
    events = pair.core.receive_data(pair.client.data_to_send() + pings * 20_000)  # 340 KB: under the allowance
    assert not any(isinstance(event, ConnectionEnded) for event in events)
    events = pair.core.receive_data(pings * 70_000)  # past 1 MiB of bytes that carry nothing
    assert isinstance(events[-1], ConnectionEnded) and "flood" in events[-1].reason
    goaways = [event for event in pair.to_client() if isinstance(event, zttp.GoAway)]
    assert goaways and goaways[-1].error_code == zttp.H2ErrorCode.ENHANCE_YOUR_CALM


def test_a_refused_call_is_reset_with_enhance_your_calm_and_its_parked_answers_dropped() -> None:
    pair = Pair()
    stream_id = pair.call(wire.frame(b"hello"), end=False)
    pair.to_core()
    pair.core.send_message(stream_id, b"x" * 200_000)  # beyond the client's window: parked
    assert pair.core.pending_bytes(stream_id) > 0
    pair.core.refuse_call(stream_id)
    assert not pair.core.has_pending_send() and pair.core.open_streams == 0
    resets = [event for event in pair.to_client() if isinstance(event, zttp.RstStream)]
    assert [reset.error_code for reset in resets] == [zttp.H2ErrorCode.ENHANCE_YOUR_CALM]
