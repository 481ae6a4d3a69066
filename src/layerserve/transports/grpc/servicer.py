"""InferenceServicer: Triton's `inference.GRPCInferenceService`; each RPC parses, looks up, calls and encodes,
like the REST routes (protocols/grpc_v2.py does the protobuf)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import grpc
import orjson
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from layerserve import __version__
from layerserve.control import ControlPlane
from layerserve.dataplane import DataPlane, VersionView
from layerserve.errors import BadRequestError, NotFoundError, NotReadyError
from layerserve.messages import InferRequest
from layerserve.protocols import grpc_v2, triton, v2
from layerserve.protocols.v2 import parse_version_number
from layerserve.transports.grpc.calls import Access, CallGuard

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
_STREAM = "ModelStreamInfer"


@dataclass(frozen=True)
class ServingState:
    """What the RPCs use: the data and control planes, the server's readiness and the largest message (request or
    answer) in bytes."""

    data: DataPlane
    control: ControlPlane
    is_ready: Callable[[], bool]
    max_message_bytes: int


def _parse(message: bytes) -> pb.ModelInferRequest:
    try:
        return pb.ModelInferRequest.FromString(message)
    except DecodeError as error:
        raise BadRequestError(f"the message is not an inference.ModelInferRequest: {error}") from None


def _timeout_ms(requested_ms: int | None, context: Context) -> int | None:
    """The request's timeout: its parameter, cut short by the call's deadline."""
    remaining_s = context.time_remaining()
    if remaining_s is None:
        return requested_ms
    deadline_ms = max(1, int(remaining_s * 1000))
    return deadline_ms if requested_ms is None else min(requested_ms, deadline_ms)


class InferenceServicer:
    """The RPCs of GRPCInferenceService, each run by the CallGuard (tokens, holds, metrics, errors)."""

    def __init__(self, state: ServingState, guard: CallGuard) -> None:
        self._state = state
        self._guard = guard

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:  # noqa: N802
        """Live as long as it answers."""
        return await self._guard.run("ServerLive", Access.PUBLIC, context, self._live)

    async def _live(self) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:  # noqa: N802
        """Ready once every model has settled (in every worker), until shutdown begins."""
        return await self._guard.run("ServerReady", Access.PUBLIC, context, self._ready)

    async def _ready(self) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._state.is_ready())

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Context) -> pb.ModelReadyResponse:  # noqa: N802
        """Whether a version (the active one by default) serves; false for an unknown model or version."""

        async def ready() -> pb.ModelReadyResponse:
            number = parse_version_number(request.version)
            try:
                return pb.ModelReadyResponse(ready=self._state.data.model_ready(request.name, number))
            except (NotFoundError, NotReadyError):
                return pb.ModelReadyResponse(ready=False)

        return await self._guard.run("ModelReady", Access.API, context, ready)

    async def ServerMetadata(  # noqa: N802
        self, request: pb.ServerMetadataRequest, context: Context
    ) -> pb.ServerMetadataResponse:
        """Name, version and extensions."""

        async def metadata() -> pb.ServerMetadataResponse:
            return pb.ServerMetadataResponse(name="layerserve", version=__version__, extensions=triton.EXTENSIONS)

        return await self._guard.run("ServerMetadata", Access.API, context, metadata)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Context) -> pb.ModelMetadataResponse:  # noqa: N802
        """A version's inputs and outputs."""

        async def metadata() -> pb.ModelMetadataResponse:
            metadata = self._state.data.metadata(request.name, parse_version_number(request.version))
            return grpc_v2.model_metadata(v2.metadata_json(metadata))

        return await self._guard.run("ModelMetadata", Access.API, context, metadata)

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Context) -> pb.ModelConfigResponse:  # noqa: N802
        """Triton's model configuration of a version."""

        async def config() -> pb.ModelConfigResponse:
            metadata = self._state.data.metadata(request.name, parse_version_number(request.version))
            return grpc_v2.model_config(triton.model_config(metadata))

        return await self._guard.run("ModelConfig", Access.API, context, config)

    async def ModelStatistics(  # noqa: N802
        self, request: pb.ModelStatisticsRequest, context: Context
    ) -> pb.ModelStatisticsResponse:
        """Triton's statistics of one version, of a model's ready versions, or of every model's."""

        async def statistics() -> pb.ModelStatisticsResponse:
            number = parse_version_number(request.version)
            reports = self._state.data.statistics(request.name or None, number)
            return grpc_v2.model_statistics([r.statistics.to_dict(r.name, r.version) for r in reports])

        return await self._guard.run("ModelStatistics", Access.API, context, statistics)

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Context) -> pb.ModelInferResponse:  # noqa: N802
        """One inference."""
        return await self._guard.run("ModelInfer", Access.API, context, lambda: self._infer(request, context))

    async def ModelInferMessage(self, message: bytes, context: Context) -> pb.ModelInferResponse:  # noqa: N802
        """One inference from the request's serialized message (the gRPC door's ModelInfer): a message whose
        leading fields were seen before skips the protobuf parse and the checks (`grpc_v2.InferTemplates`)."""
        return await self._guard.run("ModelInfer", Access.API, context, lambda: self._infer_message(message, context))

    async def _infer_message(self, message: bytes, context: Context) -> pb.ModelInferResponse:
        layout = grpc_v2.read_layout(message)
        if layout is None:
            return await self._infer(_parse(message), context)
        async with self._state.data.open(layout.model, parse_version_number(layout.version)) as view:
            templates = view.parse_state(grpc_v2.InferTemplates)
            parsed = templates.apply(message, layout)
            if parsed is None:  # a message of a shape not seen before: parsed in full, kept as a template
                request = _parse(message)
                parsed = grpc_v2.parse_model_infer(request, view.check_declared)
                templates.keep(message, request, parsed)
            return await self._answer(view, parsed, context)

    async def _infer(self, request: pb.ModelInferRequest, context: Context) -> pb.ModelInferResponse:
        number = parse_version_number(request.model_version)
        async with self._state.data.open(request.model_name, number) as view:
            return await self._answer(view, grpc_v2.parse_model_infer(request, view.check_declared), context)

    async def _answer(self, view: VersionView, parsed: InferRequest, context: Context) -> pb.ModelInferResponse:
        timeout_ms = _timeout_ms(parsed.timeout_ms, context)
        if timeout_ms != parsed.timeout_ms:
            parsed = dataclasses.replace(parsed, timeout_ms=timeout_ms)
        answer = await view.infer(parsed)
        return grpc_v2.encode_model_infer(answer, self._state.max_message_bytes)

    async def ModelStreamInfer(  # noqa: N802
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Context
    ) -> None:
        """Inferences over one stream, answered as each is done (they are batched together like any others);
        an error answers its message with `error_message` and the stream goes on."""
        await self._guard.authorize(Access.API, context)
        lock, answering = asyncio.Lock(), set[asyncio.Task[None]]()

        async def answer(request: pb.ModelInferRequest) -> None:
            response, _, message = await self._guard.attempt(_STREAM, lambda: self._infer(request, context))
            reply = (
                pb.ModelStreamInferResponse(infer_response=response)
                if response is not None
                else pb.ModelStreamInferResponse(error_message=message)
            )
            async with lock:
                await context.write(reply)

        try:
            async for request in requests:
                task = asyncio.create_task(answer(request))
                answering.add(task)
                task.add_done_callback(answering.discard)
            await asyncio.gather(*answering)
        finally:
            for task in answering:
                task.cancel()

    async def RepositoryIndex(  # noqa: N802
        self, request: pb.RepositoryIndexRequest, context: Context
    ) -> pb.RepositoryIndexResponse:
        """Every version with its state and reason (`ready`: READY ones only)."""

        async def index() -> pb.RepositoryIndexResponse:
            return grpc_v2.repository_index(v2.index_json(self._state.data.index()), request.ready)

        return await self._guard.run("RepositoryIndex", Access.ADMIN, context, index)

    async def RepositoryModelLoad(  # noqa: N802
        self, request: pb.RepositoryModelLoadRequest, context: Context
    ) -> pb.RepositoryModelLoadResponse:
        """(Re)load a model from the repository, with parameter `config` replacing config.yaml keys."""

        async def load() -> pb.RepositoryModelLoadResponse:
            parameters = grpc_v2.parameters_of(request.parameters)
            body = orjson.dumps({"parameters": parameters}, default=repr)  # the REST door's one check of them
            await self._state.control.load(request.model_name, v2.parse_load_request(body))
            return pb.RepositoryModelLoadResponse()

        return await self._guard.run("RepositoryModelLoad", Access.ADMIN, context, load)

    async def RepositoryModelUnload(  # noqa: N802
        self, request: pb.RepositoryModelUnloadRequest, context: Context
    ) -> pb.RepositoryModelUnloadResponse:
        """Unload every version of a model (they finish their requests first)."""

        async def unload() -> pb.RepositoryModelUnloadResponse:
            await self._state.control.unload(request.model_name)
            return pb.RepositoryModelUnloadResponse()

        return await self._guard.run("RepositoryModelUnload", Access.ADMIN, context, unload)

    async def _unsupported(self, context: Context, what: str) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, what)

    async def SystemSharedMemoryStatus(self, request: Any, context: Context) -> Any:  # noqa: N802
        """UNIMPLEMENTED: shared memory is not supported."""
        return await self._unsupported(context, triton.SHARED_MEMORY_UNSUPPORTED)

    async def SystemSharedMemoryRegister(self, request: Any, context: Context) -> Any:  # noqa: N802
        """UNIMPLEMENTED: shared memory is not supported."""
        return await self._unsupported(context, triton.SHARED_MEMORY_UNSUPPORTED)

    async def SystemSharedMemoryUnregister(self, request: Any, context: Context) -> Any:  # noqa: N802
        """UNIMPLEMENTED: shared memory is not supported."""
        return await self._unsupported(context, triton.SHARED_MEMORY_UNSUPPORTED)

    async def CudaSharedMemoryStatus(self, request: Any, context: Context) -> Any:  # noqa: N802
        """UNIMPLEMENTED: shared memory is not supported."""
        return await self._unsupported(context, triton.SHARED_MEMORY_UNSUPPORTED)

    async def CudaSharedMemoryRegister(self, request: Any, context: Context) -> Any:  # noqa: N802
        """UNIMPLEMENTED: shared memory is not supported."""
        return await self._unsupported(context, triton.SHARED_MEMORY_UNSUPPORTED)

    async def CudaSharedMemoryUnregister(self, request: Any, context: Context) -> Any:  # noqa: N802
        """UNIMPLEMENTED: shared memory is not supported."""
        return await self._unsupported(context, triton.SHARED_MEMORY_UNSUPPORTED)

    async def TraceSetting(self, request: Any, context: Context) -> Any:  # noqa: N802
        """UNIMPLEMENTED: tracing is not supported."""
        return await self._unsupported(context, "tracing is not supported by layerserve; see /metrics and access_log")

    async def LogSettings(self, request: Any, context: Context) -> Any:  # noqa: N802
        """UNIMPLEMENTED over gRPC: the log settings are at REST GET|POST /v2/logging."""
        return await self._unsupported(context, "log settings are not served over gRPC; use REST GET|POST /v2/logging")
