"""GrpcConnection over a real loopback socket, with handlers of bytes: windows, big messages, many streams."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import zttp

from layerserve.bench.h2_client import GoingAwayError, H2Connection
from layerserve.transports.grpc import wire
from layerserve.transports.grpc.connection import GrpcConnection

ECHO = "/test.Echo/Echo"
MAX_BYTES = 2 << 20


async def _echo(message: bytes, context: Any) -> bytes:
    await asyncio.sleep(0)
    return message[::-1]


_SERVED: dict[asyncio.Server, set[GrpcConnection]] = {}


async def _serve(connections: set[GrpcConnection] | None = None, **more: Any) -> asyncio.Server:
    """The echo handler and `more` (path: an RpcMethodHandler) on a loopback port (stopped by `_stop`)."""
    handlers = {ECHO.encode(): grpc.unary_unary_rpc_method_handler(_echo)}
    handlers.update({path.encode(): handler for path, handler in more.items()})
    loop = asyncio.get_running_loop()
    kept = set() if connections is None else connections
    server = await loop.create_server(lambda: GrpcConnection(handlers, MAX_BYTES, kept), "127.0.0.1", 0)
    _SERVED[server] = kept
    return server


async def _stop(server: asyncio.Server) -> None:
    """Stop listening and close the connections still open (before the test's loop ends)."""
    server.close()
    for connection in list(_SERVED.pop(server)):
        connection.close()
    await asyncio.sleep(0)  # the transports finish closing


def test_a_whole_message_fits_the_announced_window_and_big_answers_flow() -> None:
    async def main() -> None:
        server = await _serve()
        port = server.sockets[0].getsockname()[1]
        client = await H2Connection.open("127.0.0.1", port, ECHO)
        try:
            message = bytes(range(256)) * 4096  # 1 MiB each way
            assert await client.call(wire.frame(message)) == 0
            # zttp's 64 KiB default was raised for the whole message (and zttp took the extra SETTINGS ACK).
            assert client.settings[zttp.H2Settings.INITIAL_WINDOW_SIZE] >= len(message) + wire.PREFIX_BYTES
            assert await client.call(wire.frame(b"again")) == 0  # the connection still serves
        finally:
            client.close()
            await _stop(server)

    asyncio.run(main())


def test_many_calls_on_one_connection_each_get_their_own_answer() -> None:
    async def main() -> None:
        server = await _serve()
        port = server.sockets[0].getsockname()[1]
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                echo = channel.unary_unary(ECHO)
                messages = [f"call {i}".encode() * (i + 1) for i in range(64)]
                answers = await asyncio.gather(*(echo(m) for m in messages))
                assert answers == [m[::-1] for m in messages]
                too_big = echo(b"x" * (MAX_BYTES + 1))
                try:
                    await too_big
                except grpc.aio.AioRpcError as error:
                    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                else:
                    raise AssertionError("a message over the limit was answered")
                assert await echo(b"ok") == b"ko"
        finally:
            await _stop(server)

    asyncio.run(main())


def test_a_long_lived_connection_goes_away_gracefully_before_zttps_stream_limit() -> None:
    # zttp ends a connection at its 4,096th stream ("flood", ENHANCE_YOUR_CALM): the connection goes away first,
    # with every call it took answered, and the client's next call is sent again on a new connection.
    async def main() -> None:
        server = await _serve()
        port = server.sockets[0].getsockname()[1]
        client = await H2Connection.open("127.0.0.1", port, ECHO)
        answered, reconnects = 0, 0
        try:
            while answered < 4_500:
                try:
                    assert await client.call(wire.frame(b"hi")) == 0
                    answered += 1
                except GoingAwayError as going_away:
                    assert going_away.code == 0, going_away  # NO_ERROR, not zttp's ENHANCE_YOUR_CALM (11)
                    client.close()
                    client = await H2Connection.open("127.0.0.1", port, ECHO)
                    reconnects += 1
            assert reconnects == 1 and answered == 4_500
        finally:
            client.close()
            await _stop(server)

    asyncio.run(main())


def test_a_unary_request_of_more_than_one_message_is_refused() -> None:
    async def main() -> None:
        server = await _serve()
        client = await H2Connection.open("127.0.0.1", server.sockets[0].getsockname()[1], ECHO)
        try:
            assert await client.call(wire.frame(b"one") + wire.frame(b"two")) == grpc.StatusCode.INTERNAL.value[0]
            assert await client.call(wire.frame(b"one")) == 0
        finally:
            client.close()
            await _stop(server)

    asyncio.run(main())


def test_going_away_lets_the_call_in_flight_answer_then_closes() -> None:
    async def main() -> None:
        release, started = asyncio.Event(), asyncio.Event()

        async def slow(message: bytes, context: Any) -> bytes:
            started.set()
            await release.wait()
            return b"done"

        connections: set[GrpcConnection] = set()
        server = await _serve(connections, **{"/test.Echo/Slow": grpc.unary_unary_rpc_method_handler(slow)})
        port = server.sockets[0].getsockname()[1]
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = asyncio.ensure_future(channel.unary_unary("/test.Echo/Slow")(b"x"))
                await started.wait()
                (connection,) = connections
                connection.go_away()
                idle = asyncio.ensure_future(connection.idle())
                await asyncio.sleep(0.05)
                assert not idle.done() and not call.done()  # the call in flight goes on
                release.set()
                assert await call == b"done"
                await asyncio.wait_for(idle, 5)
                for _ in range(100):  # the connection closes once its last call has answered
                    if not connections:
                        break
                    await asyncio.sleep(0.01)
                assert not connections
        finally:
            await _stop(server)

    asyncio.run(main())


def test_a_streaming_answer_waits_for_the_client_s_window() -> None:
    async def main() -> None:
        parked: list[int] = []

        async def many(message: bytes, context: Any) -> None:
            for index in range(12):
                await context.write(bytes([index]) * (1 << 20))
                parked.append(context._connection.stream(context.stream_id).pending_bytes or 0)

        server = await _serve(**{"/test.Echo/Many": grpc.unary_stream_rpc_method_handler(many)})
        try:
            options = [("grpc.max_receive_message_length", MAX_BYTES)]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.sockets[0].getsockname()[1]}", options) as chan:
                answers = []
                async for answer in chan.unary_stream("/test.Echo/Many")(b""):
                    answers.append(answer)
                    await asyncio.sleep(0.02)  # a slow reader
            assert [a[:1] for a in answers] == [bytes([i]) for i in range(12)]
            assert all(len(a) == 1 << 20 for a in answers)
            assert max(parked) <= (2 << 20) + 64  # the handler waited instead of parking all 12 MiB
        finally:
            await _stop(server)

    asyncio.run(main())


def test_an_http1_request_is_told_where_it_belongs() -> None:
    async def main() -> None:
        server = await _serve()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
            writer.write(b"POST /v2/models/m/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
            answer = await asyncio.wait_for(reader.read(), 5)  # then the server closes the connection
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 426 ")
            assert "gRPC port" in json.loads(body)["error"]
            writer.close()
        finally:
            await _stop(server)

    asyncio.run(main())
