"""GrpcMethods: Triton's GRPCInferenceService as methods of the Ray Serve ingress, for Ray Serve's gRPC proxy.

Ray's gRPC proxy (`serve.start(grpc_options={"grpc_servicer_functions": [SERVICER_FUNCTION]})`) calls the
ingress deployment's method of each RPC's name with the request message and Ray's gRPC context. Each method
runs the RPC of the same InferenceServicer the gRPC door uses, over RayContext: `abort` sets the status on
Ray's context (which the proxy answers with), every answer carries `layerserve-replica` as trailing metadata.
ModelStreamInfer is a bidirectional stream: Ray hands the requests as an async iterator and sends what the
method yields.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from layerserve.transports.grpc.servicer import InferenceServicer

SERVICER_FUNCTION = "layerserve.transports.ray.grpc_ingress.add_servicer_to_server"

# Ray pickles each request message between its proxy and the replica; tritonclient's messages are built under
# the module names of the .proto files, which pickle must find: this module (imported by both) names them.
sys.modules.setdefault("grpc_service_pb2", service_pb2)
sys.modules.setdefault("model_config_pb2", model_config_pb2)


def add_servicer_to_server(servicer: Any, server: Any) -> None:
    """GRPCInferenceService for Ray Serve's gRPC proxy (`grpc_servicer_functions`): tritonclient's function,
    from a module that makes its messages picklable first."""
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)


UNARY_RPCS = (
    "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer", "ModelConfig",
    "ModelStatistics", "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload",
    "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
    "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister", "TraceSetting",
    "LogSettings",
)  # fmt: skip


class RpcAbortedError(Exception):
    """An RPC ended with a status other than OK (set on Ray's context, which the proxy answers with)."""


class RayContext:
    """What InferenceServicer asks of a grpc.aio context, over Ray Serve's RayServegRPCContext."""

    def __init__(self, context: Any, replica: str, write: Callable[[Any], Coroutine[Any, Any, None]] | None = None):
        self._context = context
        self._write = write
        context.set_trailing_metadata([("layerserve-replica", replica)])

    def invocation_metadata(self) -> Any:
        """The call's metadata (the token is read from it)."""
        return self._context.invocation_metadata()

    def time_remaining(self) -> float | None:
        """None: Ray's proxy does not pass the call's deadline on (its own request timeout applies)."""
        return None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        """End the call with `code` and `details`.

        Raises:
            RpcAbortedError: always.
        """
        self._context.set_code(code)
        self._context.set_details(details)
        raise RpcAbortedError(details)

    async def write(self, message: Any) -> None:
        """Send one message of a stream."""
        assert self._write is not None, "write on a unary call"
        await self._write(message)


def _unary(name: str) -> Callable[..., Coroutine[Any, Any, Any]]:
    async def method(self: GrpcMethods, request: Any, grpc_context: Any) -> Any:
        rpc = getattr(self._grpc_servicer(), name)
        return await rpc(request, RayContext(grpc_context, self._grpc_identity))

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"GRPCInferenceService/{name} (see InferenceServicer.{name})."
    return method


class GrpcMethods:
    """Mixin of the ingress deployment: one method per RPC; `_grpc_servicer` and `_grpc_identity` come from the
    class it is mixed into."""

    _grpc_identity = ""

    def _grpc_servicer(self) -> InferenceServicer:
        raise NotImplementedError

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], grpc_context: Any) -> AsyncIterator[Any]:  # noqa: N802
        """GRPCInferenceService/ModelStreamInfer: each answer yielded as it is done."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        done = object()
        context = RayContext(grpc_context, self._grpc_identity, queue.put)

        async def serve() -> None:
            try:
                await self._grpc_servicer().ModelStreamInfer(requests, context)
            finally:
                queue.put_nowait(done)

        serving = asyncio.create_task(serve())
        try:
            while (message := await queue.get()) is not done:
                yield message
            await serving  # its error (an abort) ends the stream with its status
        finally:
            serving.cancel()


for _name in UNARY_RPCS:
    setattr(GrpcMethods, _name, _unary(_name))
