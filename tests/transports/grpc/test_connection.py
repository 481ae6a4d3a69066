"""GrpcConnection over a real loopback socket, with handlers of bytes: windows, big messages, many streams."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from layerserve.bench.h2_client import H2Connection
from layerserve.transports.grpc import wire
from layerserve.transports.grpc.connection import GrpcConnection

ECHO = "/test.Echo/Echo"
MAX_BYTES = 2 << 20


async def _echo(message: bytes, context: Any) -> bytes:
    await asyncio.sleep(0)
    return message[::-1]


async def _serve() -> asyncio.Server:
    handlers = {ECHO.encode(): grpc.unary_unary_rpc_method_handler(_echo)}
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: GrpcConnection(handlers, MAX_BYTES, set()), "127.0.0.1", 0)


def test_a_whole_message_fits_the_announced_window_and_big_answers_flow() -> None:
    async def main() -> None:
        server = await _serve()
        port = server.sockets[0].getsockname()[1]
        client = await H2Connection.open("127.0.0.1", port, ECHO)
        try:
            message = bytes(range(256)) * 4096  # 1 MiB each way
            assert await client.call(wire.frame(message)) == 0
            # zttp's 64 KiB default was raised for the whole message (and zttp took the extra SETTINGS ACK).
            assert client._initial_window >= len(message) + wire.PREFIX_BYTES
            assert await client.call(wire.frame(b"again")) == 0  # the connection still serves
        finally:
            client.close()
            server.close()

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
            server.close()

    asyncio.run(main())
