"""InferenceServicer: Triton's `inference.GRPCInferenceService`; each RPC parses, looks up, calls and encodes,
like the REST routes (protocols/grpc_v2.py does the protobuf)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

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
from layerserve.tracing import span
from layerserve.transports.grpc.context import CallContext, authorization, metadata_value
from layerserve.transports.policy import Access, Exchange, Refusal, RequestPolicy, grpc_access, grpc_code_name

SERVICE_PATH = "/inference.GRPCInferenceService"
_STREAM = "ModelStreamInfer"
STREAM_IN_FLIGHT = 4  # a ModelStreamInfer stream's messages being answered at once
Answer = TypeVar("Answer")


@dataclass(frozen=True)
class ServingState:
    """What the RPCs use: the data and control planes, the server's readiness and the request policy (whose
    `max_body_bytes` is also the largest message, request or answer)."""

    data: DataPlane
    control: ControlPlane
    is_ready: Callable[[], bool]
    policy: RequestPolicy


def _parse(message: bytes) -> pb.ModelInferRequest:
    try:
        return pb.ModelInferRequest.FromString(message)
    except DecodeError as error:
        raise BadRequestError(f"the message is not an inference.ModelInferRequest: {error}") from None


class InferenceServicer:
    """The RPCs of GRPCInferenceService, each run under the request policy (tokens, metrics and the access log,
    errors as status codes), the versions they use leased through the data plane."""

    def __init__(self, state: ServingState) -> None:
        self._state = state
        self._policy = state.policy

    async def _run(
        self, method: str, context: CallContext, handler: Callable[..., Awaitable[Answer]], *args: Any
    ) -> Answer:
        """One RPC under the policy; a refusal ends the call with its status."""
        exchange = _exchange(method, grpc_access(method), context, self._policy)
        answer = await self._policy.run(exchange, handler, *args)
        if isinstance(answer, Refusal):
            await context.abort(grpc.StatusCode[grpc_code_name(answer.status)], answer.message)
        return answer

    async def ServerLive(self, request: pb.ServerLiveRequest, context: CallContext) -> pb.ServerLiveResponse:  # noqa: N802
        """Live as long as it answers."""
        return await self._run("ServerLive", context, self._live)

    async def _live(self) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: CallContext) -> pb.ServerReadyResponse:  # noqa: N802
        """Ready once every model has settled (in every worker), until shutdown begins."""
        return await self._run("ServerReady", context, self._ready)

    async def _ready(self) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._state.is_ready())

    async def ModelReady(self, request: pb.ModelReadyRequest, context: CallContext) -> pb.ModelReadyResponse:  # noqa: N802
        """Whether a version (the active one by default) serves; false for an unknown model or version."""
        return await self._run("ModelReady", context, self._model_ready, request)

    async def _model_ready(self, request: pb.ModelReadyRequest) -> pb.ModelReadyResponse:
        number = parse_version_number(request.version)
        try:
            return pb.ModelReadyResponse(ready=self._state.data.model_ready(request.name, number))
        except (NotFoundError, NotReadyError):
            return pb.ModelReadyResponse(ready=False)

    async def ServerMetadata(  # noqa: N802
        self, request: pb.ServerMetadataRequest, context: CallContext
    ) -> pb.ServerMetadataResponse:
        """Name, version and extensions."""
        return await self._run("ServerMetadata", context, self._server_metadata)

    async def _server_metadata(self) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="layerserve", version=__version__, extensions=triton.EXTENSIONS)

    async def ModelMetadata(  # noqa: N802
        self, request: pb.ModelMetadataRequest, context: CallContext
    ) -> pb.ModelMetadataResponse:
        """A version's inputs and outputs."""
        return await self._run("ModelMetadata", context, self._model_metadata, request)

    async def _model_metadata(self, request: pb.ModelMetadataRequest) -> pb.ModelMetadataResponse:
        metadata = await self._state.data.metadata(request.name, parse_version_number(request.version))
        return grpc_v2.model_metadata(v2.metadata_json(metadata))

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: CallContext) -> pb.ModelConfigResponse:  # noqa: N802
        """Triton's model configuration of a version."""
        return await self._run("ModelConfig", context, self._model_config, request)

    async def _model_config(self, request: pb.ModelConfigRequest) -> pb.ModelConfigResponse:
        metadata = await self._state.data.metadata(request.name, parse_version_number(request.version))
        return grpc_v2.model_config(triton.model_config(metadata))

    async def ModelStatistics(  # noqa: N802
        self, request: pb.ModelStatisticsRequest, context: CallContext
    ) -> pb.ModelStatisticsResponse:
        """Triton's statistics of one version, of a model's ready versions, or of every model's."""
        return await self._run("ModelStatistics", context, self._statistics, request)

    async def _statistics(self, request: pb.ModelStatisticsRequest) -> pb.ModelStatisticsResponse:
        number = parse_version_number(request.version)
        reports = self._state.data.statistics(request.name or None, number)
        return grpc_v2.model_statistics([r.statistics.to_dict(r.name, r.version) for r in reports])

    async def ModelInfer(self, request: pb.ModelInferRequest, context: CallContext) -> pb.ModelInferResponse:  # noqa: N802
        """One inference."""
        return await self._run("ModelInfer", context, self._infer, request, context)

    async def ModelInferMessage(self, message: bytes, context: CallContext) -> pb.ModelInferResponse:  # noqa: N802
        """One inference from the request's serialized message (the gRPC door's ModelInfer): a message whose
        leading fields were seen before for its version skips the protobuf parse and the checks
        (`grpc_v2.InferTemplates`)."""
        return await self._run("ModelInfer", context, self._infer_message, message, context)

    async def _infer_message(self, message: bytes, context: CallContext) -> pb.ModelInferResponse:
        layout = grpc_v2.read_layout(message)
        if layout is None:
            return await self._infer_parsed(_parse(message), context)
        async with self._state.data.open(layout.model, parse_version_number(layout.version)) as view:
            with span("decode"):
                templates = view.parse_state(grpc_v2.InferTemplates)
                parsed = templates.apply(message, layout)
                if parsed is None:  # a message of a shape not seen before: parsed in full, kept as a template
                    request = _parse(message)
                    parsed = grpc_v2.parse_model_infer(request, view.check_declared)
                    templates.keep(message, request, parsed)
            return await self._answer(view, parsed, context)

    async def _infer(self, request: pb.ModelInferRequest, context: CallContext) -> pb.ModelInferResponse:
        """A message its host parsed (the door's own are bytes, their size checked as they came)."""
        self._policy.check_size(request.ByteSize(), "the request message")
        return await self._infer_parsed(request, context)

    async def _infer_parsed(self, request: pb.ModelInferRequest, context: CallContext) -> pb.ModelInferResponse:
        number = parse_version_number(request.model_version)
        async with self._state.data.open(request.model_name, number) as view:
            with span("decode"):
                parsed = grpc_v2.parse_model_infer(request, view.check_declared)
            return await self._answer(view, parsed, context)

    async def _answer(self, view: VersionView, parsed: InferRequest, context: CallContext) -> pb.ModelInferResponse:
        timeout_ms = self._policy.deadline_ms(parsed.timeout_ms, context.time_remaining())
        if timeout_ms != parsed.timeout_ms:
            parsed = dataclasses.replace(parsed, timeout_ms=timeout_ms)
        answer = await view.infer(parsed)
        with span("encode"):
            return grpc_v2.encode_model_infer(answer, self._policy.max_body_bytes)

    async def ModelStreamInfer(  # noqa: N802
        self, requests: AsyncIterator[pb.ModelInferRequest], context: CallContext
    ) -> None:
        """Inferences over one stream, answered in order, STREAM_IN_FLIGHT at a time (they are batched together
        like any others; the stream's next messages wait meanwhile); an error answers its message with
        `error_message` and the stream goes on. The token is checked once, for the stream; each message is recorded
        as a request of its own."""
        refused = self._policy.authorize(Access.API, authorization(context), is_grpc=True)
        if refused is not None:
            await context.abort(grpc.StatusCode[grpc_code_name(refused.status)], refused.message)
        answering: asyncio.Queue[asyncio.Task[pb.ModelStreamInferResponse] | None] = asyncio.Queue(STREAM_IN_FLIGHT)
        tasks = set[asyncio.Task[pb.ModelStreamInferResponse]]()

        async def write_answers() -> None:
            while (task := await answering.get()) is not None:
                await context.write(await task)

        writer = asyncio.create_task(write_answers())
        try:
            async for request in requests:
                task = asyncio.create_task(self._stream_answer(request, context))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                await _put_while(answering, task, writer)
            await _put_while(answering, None, writer)
            await writer
        finally:
            writer.cancel()
            for task in tasks:
                task.cancel()

    async def _stream_answer(self, request: pb.ModelInferRequest, context: CallContext) -> pb.ModelStreamInferResponse:
        exchange = _exchange(_STREAM, Access.PUBLIC, context, self._policy)  # the stream's token was checked
        response = await self._policy.run(exchange, self._infer, request, context)
        if isinstance(response, Refusal):
            return pb.ModelStreamInferResponse(error_message=response.message)
        return pb.ModelStreamInferResponse(infer_response=response)

    async def RepositoryIndex(  # noqa: N802
        self, request: pb.RepositoryIndexRequest, context: CallContext
    ) -> pb.RepositoryIndexResponse:
        """Every version with its state and reason (`ready`: READY ones only)."""
        return await self._run("RepositoryIndex", context, self._index, request)

    async def _index(self, request: pb.RepositoryIndexRequest) -> pb.RepositoryIndexResponse:
        return grpc_v2.repository_index(v2.index_json(self._state.data.index()), request.ready)

    async def RepositoryModelLoad(  # noqa: N802
        self, request: pb.RepositoryModelLoadRequest, context: CallContext
    ) -> pb.RepositoryModelLoadResponse:
        """(Re)load a model from the repository, with parameter `config` replacing config.yaml keys."""
        return await self._run("RepositoryModelLoad", context, self._load, request)

    async def _load(self, request: pb.RepositoryModelLoadRequest) -> pb.RepositoryModelLoadResponse:
        parameters = grpc_v2.parameters_of(request.parameters)
        body = orjson.dumps({"parameters": parameters}, default=repr)  # the REST door's one check of them
        await self._state.control.load(request.model_name, v2.parse_load_request(body))
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(  # noqa: N802
        self, request: pb.RepositoryModelUnloadRequest, context: CallContext
    ) -> pb.RepositoryModelUnloadResponse:
        """Unload every version of a model (they finish their requests first)."""
        return await self._run("RepositoryModelUnload", context, self._unload, request)

    async def _unload(self, request: pb.RepositoryModelUnloadRequest) -> pb.RepositoryModelUnloadResponse:
        await self._state.control.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    async def _unsupported(self, context: CallContext, what: str) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, what)

    async def SystemSharedMemoryStatus(self, request: Any, context: CallContext) -> Any:  # noqa: N802
        """UNIMPLEMENTED: shared memory is not supported."""
        return await self._unsupported(context, triton.SHARED_MEMORY_UNSUPPORTED)

    async def SystemSharedMemoryRegister(self, request: Any, context: CallContext) -> Any:  # noqa: N802
        """UNIMPLEMENTED: shared memory is not supported."""
        return await self._unsupported(context, triton.SHARED_MEMORY_UNSUPPORTED)

    async def SystemSharedMemoryUnregister(self, request: Any, context: CallContext) -> Any:  # noqa: N802
        """UNIMPLEMENTED: shared memory is not supported."""
        return await self._unsupported(context, triton.SHARED_MEMORY_UNSUPPORTED)

    async def CudaSharedMemoryStatus(self, request: Any, context: CallContext) -> Any:  # noqa: N802
        """UNIMPLEMENTED: shared memory is not supported."""
        return await self._unsupported(context, triton.SHARED_MEMORY_UNSUPPORTED)

    async def CudaSharedMemoryRegister(self, request: Any, context: CallContext) -> Any:  # noqa: N802
        """UNIMPLEMENTED: shared memory is not supported."""
        return await self._unsupported(context, triton.SHARED_MEMORY_UNSUPPORTED)

    async def CudaSharedMemoryUnregister(self, request: Any, context: CallContext) -> Any:  # noqa: N802
        """UNIMPLEMENTED: shared memory is not supported."""
        return await self._unsupported(context, triton.SHARED_MEMORY_UNSUPPORTED)

    async def TraceSetting(self, request: Any, context: CallContext) -> Any:  # noqa: N802
        """UNIMPLEMENTED: Triton's trace settings are not supported (traces are OpenTelemetry's: otlp_endpoint)."""
        return await self._unsupported(context, triton.TRACE_SETTINGS_UNSUPPORTED)

    async def LogSettings(self, request: Any, context: CallContext) -> Any:  # noqa: N802
        """UNIMPLEMENTED over gRPC: the log settings are at REST GET|POST /v2/logging."""
        return await self._unsupported(context, "log settings are not served over gRPC; use REST GET|POST /v2/logging")


def _exchange(method: str, access: Access, context: CallContext, policy: RequestPolicy) -> Exchange:
    """The policy's exchange of one RPC (or stream message)."""
    token = authorization(context) if policy.needs_tokens and access is not Access.PUBLIC else None
    traceparent = metadata_value(context, "traceparent") if policy.tracing is not None else None
    return Exchange("GRPC", f"{SERVICE_PATH}/{method}", f"grpc.{method}", access, token, True, traceparent)


async def _put_while(queue: asyncio.Queue[Any], item: Any, writer: asyncio.Task[None]) -> None:
    """Put `item` once there is room; the writer's error (the client is gone, an answer too large) ends the wait."""
    if not queue.full():
        queue.put_nowait(item)
        return
    putting = asyncio.ensure_future(queue.put(item))
    await asyncio.wait((putting, writer), return_when=asyncio.FIRST_COMPLETED)
    if not putting.done():
        putting.cancel()
        await writer  # raises its error
