"""GrpcDoor: the gRPC server of one process (GRPCInferenceService, the standard health service, reflection) on
HTTP/2 parsed by zttp (connection.py), hosting the handlers grpcio's registration functions make."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from layerserve.settings import Settings
from layerserve.transports.grpc.connection import GrpcConnection
from layerserve.transports.grpc.servicer import InferenceServicer
from layerserve.transports.ports import address
from layerserve.transports.tls import ServerTls, listen_options

log = logging.getLogger(__name__)

SERVICE_NAME = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name


class MethodTable:
    """The method handlers by path (`/package.Service/Method`), collected from grpcio's `add_*_to_server`
    functions, which are given this table as their server."""

    def __init__(self) -> None:
        self.handlers: dict[bytes, Any] = {}

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        """Keep a service's handlers under their paths."""
        for method, handler in handlers.items():
            self.handlers[f"/{service}/{method}".encode()] = handler

    def add_generic_rpc_handlers(self, generic_handlers: Any) -> None:
        """Ignored: the same handlers come through `add_registered_method_handlers`."""


class GrpcDoor:
    """The gRPC server on `grpc_port`, or on the socket the workers of one server share."""

    def __init__(
        self, settings: Settings, servicer: InferenceServicer, settled: Callable[[], Awaitable[None]],
        tls: ServerTls | None = None, inflater: Executor | None = None,
    ) -> None:  # fmt: skip
        self._settings = settings
        self._tls = tls
        self._settled = settled
        table = MethodTable()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, table)
        # ModelInfer takes the message's bytes: a request seen before skips the protobuf parse (InferTemplates).
        table.handlers[f"/{SERVICE_NAME}/ModelInfer".encode()] = grpc.unary_unary_rpc_method_handler(
            servicer.ModelInferMessage, response_serializer=service_pb2.ModelInferResponse.SerializeToString
        )
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, table)
        names = [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(reflection.aio.ReflectionServicer(names), table)
        self._handlers = table.handlers
        self._connections: set[GrpcConnection] = set()
        self._server: asyncio.Server | None = None
        self._serving: asyncio.Task[None] | None = None
        self._inflater = inflater  # where compressed messages inflate (the server's one thread for both doors)

    @property
    def handlers(self) -> dict[bytes, Any]:
        """The method handlers by path (`/package.Service/Method`): GRPCInferenceService, health, reflection."""
        return self._handlers

    async def start(self, sockets: list[socket.socket] | None = None) -> None:
        """Listen on `sockets` (bound already: several workers share them), else on `host:grpc_port`; the health
        service says SERVING once the models have settled.

        Raises:
            RuntimeError: the port cannot be bound (the app then fails to start).
        """
        settings = self._settings
        where = address(settings.host, settings.grpc_port)
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        loop = asyncio.get_running_loop()

        def connection() -> GrpcConnection:
            return GrpcConnection(
                self._handlers, settings.max_body_bytes, self._connections, loop, settings.grpc_idle_timeout_s,
                self._inflater,
            )  # fmt: skip

        options = listen_options(self._tls, settings.header_timeout_s)
        try:
            if sockets is not None:
                self._server = await loop.create_server(connection, sock=sockets[0], **options)
            else:
                self._server = await loop.create_server(connection, settings.host, settings.grpc_port, **options)
        except OSError as error:
            raise RuntimeError(f"Failed to bind the gRPC port {where}: {error.strerror or error}") from error
        self._serving = asyncio.create_task(self._serve_when_settled())
        log.info("gRPC service on %s%s", where, " (TLS)" if self._tls else "")

    async def _serve_when_settled(self) -> None:
        await self._settled()
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting calls (health turns NOT_SERVING, GOAWAY on every connection), let those in flight
        finish within `grace_s`, then cancel what is left and close the connections."""
        if self._serving is not None:
            self._serving.cancel()
        await self._health.enter_graceful_shutdown()
        if self._server is None:
            return
        self._server.close()
        for connection in list(self._connections):
            connection.go_away()
        connections = list(self._connections)
        if connections:
            waiting = [asyncio.ensure_future(connection.idle()) for connection in connections]
            _, late = await asyncio.wait(waiting, timeout=grace_s)
            for waiter in late:
                waiter.cancel()
            if late:
                for connection in connections:
                    connection.cancel_calls()
                await asyncio.sleep(0.1)  # the cancelled handlers answer UNAVAILABLE
        for connection in list(self._connections):
            connection.close()
