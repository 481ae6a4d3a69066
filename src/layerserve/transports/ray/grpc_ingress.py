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
from typing import Any, NoReturn

import grpc
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from layerserve.transports.grpc.servicer import InferenceServicer
from layerserve.transports.ray.group_router import forward
from layerserve.transports.ray.options import RayOptions

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

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
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


class CapturedCall:
    """A call's context as a group's replica sees it: the ingress's metadata in, status and details out."""

    def __init__(self, metadata: Any) -> None:
        self._metadata = metadata
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def invocation_metadata(self) -> Any:
        """The metadata the ingress received."""
        return self._metadata

    def set_code(self, code: grpc.StatusCode) -> None:
        """Record the status."""
        self.code = code

    def set_details(self, details: str) -> None:
        """Record the status message."""
        self.details = details

    def set_trailing_metadata(self, metadata: Any) -> None:
        """Ignored: the ingress names the replica."""


async def run_captured(servicer: InferenceServicer, name: str, request: Any, metadata: Any, identity: str) -> Any:
    """Run one RPC in a group's replica: (answer or None, status or None, details, the replica)."""
    call = CapturedCall(metadata)
    try:
        answer = await getattr(servicer, name)(request, RayContext(call, identity))
    except RpcAbortedError:
        answer = None
    return answer, call.code, call.details, identity


_MODEL_FIELD = {
    "ModelReady": "name", "ModelMetadata": "name", "ModelInfer": "model_name", "ModelConfig": "name",
    "ModelStatistics": "name", "RepositoryModelLoad": "model_name", "RepositoryModelUnload": "model_name",
}  # fmt: skip
_MERGED = {"RepositoryIndex": "models", "ModelStatistics": "model_stats"}  # when they name no model


def _unary(name: str) -> Callable[..., Coroutine[Any, Any, Any]]:
    async def method(self: GrpcMethods, request: Any, grpc_context: Any) -> Any:
        options, handles = self._grpc_groups
        model = getattr(request, _MODEL_FIELD[name]) if name in _MODEL_FIELD else ""
        group = options.group_of(model) if model and options is not None else None
        if group is not None:
            try:
                answer, code, details, replica = await forward(
                    handles, group, "handle_grpc", name, request, grpc_context.invocation_metadata(), model=model
                )
            except Exception as error:  # both attempts lost their replica
                lost = f"no replica of group {group!r} answered ({error!r}); try again"
                await RayContext(grpc_context, self._grpc_identity).abort(grpc.StatusCode.UNAVAILABLE, lost)
            grpc_context.set_trailing_metadata([("layerserve-replica", replica)])
            if code is not None and code != grpc.StatusCode.OK:
                await RayContext(grpc_context, replica).abort(code, details)
            return answer
        answer = await getattr(self._grpc_servicer(), name)(request, RayContext(grpc_context, self._grpc_identity))
        if name in _MERGED and not model:
            for other in handles:
                theirs, code, details, _ = await forward(
                    handles, other, "handle_grpc", name, request, grpc_context.invocation_metadata()
                )
                if code is not None and code != grpc.StatusCode.OK:
                    await RayContext(grpc_context, self._grpc_identity).abort(code, f"group {other}: {details}")
                getattr(answer, _MERGED[name]).extend(getattr(theirs, _MERGED[name]))
        return answer

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"GRPCInferenceService/{name} (see InferenceServicer.{name})."
    return method


class GrpcMethods:
    """Mixin of the ingress deployment: one method per RPC; `_grpc_servicer` and `_grpc_identity` come from the
    class it is mixed into."""

    _grpc_identity = ""
    _grpc_groups: tuple[RayOptions | None, dict[str, Any]] = (None, {})  # the groups, and their handles

    def _grpc_servicer(self) -> InferenceServicer:
        raise NotImplementedError

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], grpc_context: Any) -> AsyncIterator[Any]:  # noqa: N802
        """GRPCInferenceService/ModelStreamInfer: each answer yielded as it is done (the models of this replica's
        group only: a stream is not split over groups)."""
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
