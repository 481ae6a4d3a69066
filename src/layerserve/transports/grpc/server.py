"""GrpcDoor: the grpc.aio server of one worker: GRPCInferenceService, the standard health service, reflection."""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tritonclient.grpc import service_pb2, service_pb2_grpc

from layerserve.settings import Settings
from layerserve.transports.grpc.calls import CallGuard
from layerserve.transports.grpc.servicer import InferenceServicer, ServingState

log = logging.getLogger(__name__)

SERVICE_NAME = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class GrpcDoor:
    """The gRPC server on `grpc_port`. Several workers bind the same port (SO_REUSEPORT, grpc's default on
    Linux) and the kernel spreads connections across them; a single worker binds it alone (SO_REUSEPORT
    off), so that a second server started on the same port fails to start instead of sharing it."""

    def __init__(self, settings: Settings, state: ServingState) -> None:
        self._settings = settings
        self._state = state
        self._server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 1 if settings.workers > 1 else 0),
                ("grpc.max_receive_message_length", settings.max_body_bytes),
                ("grpc.max_send_message_length", settings.max_body_bytes),
            ]
        )
        guard = CallGuard(settings.admin_token, settings.api_token, settings.access_log)
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(state, guard), self._server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self._server,
        )
        self._serving: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Listen on `host:grpc_port`; the health service says SERVING once the models have settled.

        Raises:
            RuntimeError: the port cannot be bound (the app then fails to start).
        """
        address = _address(self._settings.host, self._settings.grpc_port)
        self._server.add_insecure_port(address)
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._server.start()
        self._serving = asyncio.create_task(self._serve_when_settled())
        log.info("gRPC service on %s", address)

    async def _serve_when_settled(self) -> None:
        await self._state.registry.wait_settled()
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting calls (health turns NOT_SERVING), let those in flight finish within `grace_s`."""
        if self._serving is not None:
            self._serving.cancel()
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace_s)
