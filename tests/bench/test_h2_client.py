"""The load generator's HTTP/2 gRPC client against real servers on loopback: the gRPC door's GrpcConnection and
grpcio's own grpc.aio server, each with handlers of bytes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
import zttp

from layerserve.bench.h2_client import ConnectionLostError, GoingAwayError, H2Connection
from layerserve.transports.grpc import wire
from layerserve.transports.grpc.connection import GrpcConnection

BIG = bytes(range(256)) * 4096  # 1 MiB
SERVERS = ("door", "grpcio")


async def _echo(message: bytes, context: Any) -> bytes:
    return message[::-1]


async def _big(message: bytes, context: Any) -> bytes:
    if message != BIG:
        await context.abort(grpc.StatusCode.DATA_LOSS, f"got {len(message)} other bytes")
    return message[::-1]


async def _invalid(message: bytes, context: Any) -> bytes:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no good")
    raise AssertionError("abort returned")


async def _invalid_after_an_answer(message: bytes, context: Any) -> None:
    await context.write(b"first")
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no good after all")


HANDLERS = {
    "/test.Echo/Echo": grpc.unary_unary_rpc_method_handler(_echo),
    "/test.Echo/Big": grpc.unary_unary_rpc_method_handler(_big),
    "/test.Echo/Invalid": grpc.unary_unary_rpc_method_handler(_invalid),
    "/test.Echo/InvalidAfterAnswer": grpc.unary_stream_rpc_method_handler(_invalid_after_an_answer),
}


class _ByPath(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpc ships no types
    def __init__(self, handlers: dict[str, Any]) -> None:
        self._handlers = handlers

    def service(self, handler_call_details: Any) -> Any:
        return self._handlers.get(handler_call_details.method)


@asynccontextmanager
async def _door(connections: set[GrpcConnection] | None = None, **more: Any) -> AsyncIterator[int]:
    """The gRPC door's connections with HANDLERS and `more` (path: handler) on a loopback port."""
    handlers = {path.encode(): handler for path, handler in {**HANDLERS, **more}.items()}
    kept = set() if connections is None else connections
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: GrpcConnection(handlers, 2 << 20, kept), "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for connection in list(kept):
            connection.close()
        await asyncio.sleep(0)  # the transports finish closing


@asynccontextmanager
async def _grpcio(options: tuple[tuple[str, Any], ...] = ()) -> AsyncIterator[int]:
    """grpcio's grpc.aio server with HANDLERS on a loopback port."""
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers([_ByPath(HANDLERS)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield port
    finally:
        await server.stop(None)


def _serving(name: str) -> Any:
    if name == "grpcio_64k_windows":  # no BDP probing: the windows stay at HTTP/2's 64 KiB
        return _grpcio((("grpc.http2.bdp_probe", 0),))
    return _door() if name == "door" else _grpcio()


@pytest.mark.parametrize("server", SERVERS)
def test_a_unary_call_answers_ok_again_and_again_on_one_connection(server: str) -> None:
    async def main() -> None:
        async with _serving(server) as port:
            client = await H2Connection.open("127.0.0.1", port, "/test.Echo/Echo")
            try:
                for _ in range(3):
                    assert await client.call(wire.frame(b"hello")) == 0
            finally:
                client.close()

    asyncio.run(main())


@pytest.mark.parametrize("server", [*SERVERS, "grpcio_64k_windows"])
def test_a_1_mib_request_and_its_1_mib_answer_flow_within_the_windows(server: str) -> None:
    async def main() -> None:
        async with _serving(server) as port:
            client = await H2Connection.open("127.0.0.1", port, "/test.Echo/Big")
            try:
                assert await client.call(wire.frame(BIG)) == 0  # _big checks every byte came
                window = client.settings.get(zttp.H2Settings.INITIAL_WINDOW_SIZE, 65_535)
                assert (window == 65_535) == (server != "grpcio")  # the door and grpcio without BDP probing: HTTP/2's
                assert await client.call(wire.frame(BIG)) == 0  # and the windows were given back
                assert await client.call(wire.frame(b"short")) == grpc.StatusCode.DATA_LOSS.value[0]
            finally:
                client.close()

    asyncio.run(main())


@pytest.mark.parametrize("server", SERVERS)
def test_a_status_other_than_ok_is_read_from_the_trailers(server: str) -> None:
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]

    async def main() -> None:
        async with _serving(server) as port:
            client = await H2Connection.open("127.0.0.1", port, "/test.Echo/Invalid")  # a trailers-only answer
            after_answer = await H2Connection.open("127.0.0.1", port, "/test.Echo/InvalidAfterAnswer")
            try:
                assert await client.call(wire.frame(b"x")) == invalid
                assert await after_answer.call(wire.frame(b"x")) == invalid  # headers, a message, then trailers
                assert await client.call(wire.frame(b"x")) == invalid
            finally:
                client.close()
                after_answer.close()

    asyncio.run(main())


def test_the_door_going_away_after_4000_streams_raises_going_away_for_the_next_call() -> None:
    async def main() -> None:
        async with _door() as port:
            client = await H2Connection.open("127.0.0.1", port, "/test.Echo/Echo")
            answered = 0
            try:
                with pytest.raises(GoingAwayError) as going_away:
                    while answered <= 4_000:
                        assert await client.call(wire.frame(b"hi")) == 0
                        answered += 1
                assert answered == 4_000 and going_away.value.code == 0  # every call it took was answered
            finally:
                client.close()
            client = await H2Connection.open("127.0.0.1", port, "/test.Echo/Echo")  # the retry, on a new one
            try:
                assert await client.call(wire.frame(b"hi")) == 0
            finally:
                client.close()

    asyncio.run(main())


def test_grpcio_going_away_raises_going_away_for_the_next_call() -> None:
    async def main() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([_ByPath(HANDLERS)])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = await H2Connection.open("127.0.0.1", port, "/test.Echo/Echo")
        try:
            assert await client.call(wire.frame(b"hi")) == 0
            await server.stop(None)  # GOAWAY (its last stream: our first call's), then the connection closes
            with pytest.raises(GoingAwayError):
                await client.call(wire.frame(b"hi"))
        finally:
            client.close()

    asyncio.run(main())


class _Refusing(asyncio.Protocol):
    """An HTTP/2 server (zttp's) that refuses every stream with REFUSED_STREAM, as one that is going away may."""

    def connection_made(self, transport: Any) -> None:
        self._transport = transport
        self._h2 = zttp.Connection(zttp.SERVER, protocol=zttp.HTTP2)
        self._h2.initiate_connection()

    def data_received(self, data: bytes) -> None:
        self._h2.receive_data(data)
        while (event := self._h2.next_event()) is not zttp.NEED_DATA and event is not zttp.CONNECTION_CLOSED:
            if isinstance(event, zttp.Request):
                self._h2.stream(event.stream_id).reset(zttp.H2ErrorCode.REFUSED_STREAM)
        self._transport.write(self._h2.data_to_send())


def test_a_refused_stream_raises_going_away() -> None:
    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(_Refusing, "127.0.0.1", 0)
        client = await H2Connection.open("127.0.0.1", server.sockets[0].getsockname()[1], "/test.Echo/Echo")
        try:
            with pytest.raises(GoingAwayError):
                await client.call(wire.frame(b"hi"))
        finally:
            client.close()
            server.close()

    asyncio.run(main())


def test_the_server_closing_during_a_call_raises_connection_lost() -> None:
    async def main() -> None:
        started, release = asyncio.Event(), asyncio.Event()

        async def slow(message: bytes, context: Any) -> bytes:
            started.set()
            await release.wait()
            return b"late"

        connections: set[GrpcConnection] = set()
        async with _door(connections, **{"/test.Echo/Slow": grpc.unary_unary_rpc_method_handler(slow)}) as port:
            client = await H2Connection.open("127.0.0.1", port, "/test.Echo/Slow")
            try:
                call = asyncio.ensure_future(client.call(wire.frame(b"hi")))
                await started.wait()
                (connection,) = connections
                connection.close()  # no GOAWAY: the socket closes
                with pytest.raises(ConnectionLostError):
                    await call
                with pytest.raises(ConnectionLostError):
                    await client.call(wire.frame(b"hi"))
            finally:
                release.set()
                client.close()

    asyncio.run(main())
