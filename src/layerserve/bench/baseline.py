"""The bare baselines of `layerserve bench`: the same HTTP stack (the HTTP door's own connections on uvloop and
httptools, Starlette) answering every POST with a constant, and the same gRPC stack (the gRPC door's connections on
uvloop) answering every ModelInfer with a constant, to show what the stack alone costs."""

from __future__ import annotations

import socket
from multiprocessing.context import SpawnProcess

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

_CONSTANT = b'{"model_name":"bare","model_version":"1","outputs":[]}'


async def _constant(request: Request) -> Response:
    await request.body()
    return Response(_CONSTANT, media_type="application/json")


def bare_app() -> Starlette:
    """Every POST under /v2/models/ answers the same small JSON body after reading the request."""
    return Starlette(routes=[Route("/v2/models/{rest:path}", _constant, methods=["POST"])])


def _serve(port: int) -> None:
    import asyncio

    import uvloop

    from layerserve.settings import Settings
    from layerserve.transports.http.door import limits_of
    from layerserve.transports.http.protocol import DoorState, HttpProtocol

    async def main() -> None:
        state = DoorState(bare_app(), None, limits_of(Settings(model_repository=".")))
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: HttpProtocol(state, loop), "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(main())


def _serve_grpc(port: int) -> None:
    import grpc
    import uvloop
    from tritonclient.grpc import service_pb2

    constant: bytes = service_pb2.ModelInferResponse(model_name="bare", model_version="1").SerializeToString()

    async def model_infer(request: bytes, context: object) -> bytes:  # the request as bytes: nothing parsed
        return constant

    async def main() -> None:
        import asyncio

        from layerserve.transports.grpc.connection import GrpcConnection

        handler = grpc.unary_unary_rpc_method_handler(model_infer)  # no (de)serializers: bytes in, bytes out
        handlers = {b"/inference.GRPCInferenceService/ModelInfer": handler}
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: GrpcConnection(handlers, 1 << 26, set()), "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(main())


def start_bare_server(protocol: str = "http") -> tuple[SpawnProcess, int]:
    """Start the bare HTTP (or `grpc`) server in a fresh process on a free port; returns once it accepts
    connections."""
    import multiprocessing
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    serve = _serve_grpc if protocol == "grpc" else _serve
    process = multiprocessing.get_context("spawn").Process(target=serve, args=(port,), daemon=True)
    process.start()
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process, port
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("the bare baseline server did not start")
