"""The gRPC V2 protocol (Triton's `inference.GRPCInferenceService` messages) <-> numpy arrays and plain values.

Only the protobuf framing is read and written here: requests become the data plane's InferRequest (which it checks
against the version it leases), its InferResponse becomes a ModelInferResponse.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2

from layerserve.errors import BadRequestError, PayloadTooLargeError
from layerserve.messages import InferRequest, InferResponse, RequestedOutput
from layerserve.protocols import v2
from layerserve.protocols.templates import TemplateCache
from layerserve.tensors import Array, datatype_of, dtype_of, parse_shape

# The typed `contents` field of each datatype (FP16 and BF16 travel only as raw contents).
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


class _Parameter(Protocol):
    def WhichOneof(self, group: str, /) -> str | None: ...  # noqa: N802  (protobuf's name)


def parameters_of(parameters: Mapping[str, _Parameter]) -> dict[str, Any]:
    """A protobuf parameter map (InferParameter or ModelRepositoryParameter values) as plain Python values."""
    values: dict[str, Any] = {}
    if not parameters:  # the common case, on every tensor of every request
        return values
    for key, parameter in parameters.items():
        choice = parameter.WhichOneof("parameter_choice")
        values[key] = None if choice is None else getattr(parameter, choice)
    return values


def _from_contents(tensor: service_pb2.ModelInferRequest.InferInputTensor, shape: tuple[int, ...], what: str) -> Array:
    """An input given as typed `contents` (instead of raw_input_contents)."""
    field = _CONTENTS.get(tensor.datatype)
    if field is None:
        raise BadRequestError(f"{what}: {tensor.datatype} data must be sent as raw_input_contents")
    values = getattr(tensor.contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise BadRequestError(f"{what}: contents.{field} holds {len(values)} elements, shape {list(shape)} has {count}")
    dtype = dtype_of(tensor.datatype, what)
    if tensor.datatype == "BYTES":
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array.reshape(shape)
    wide = np.array(values, dtype=np.float64 if dtype.kind == "f" else None)
    if dtype.kind in "iu" and wide.size and (wide.min() < np.iinfo(dtype).min or wide.max() > np.iinfo(dtype).max):
        raise BadRequestError(f"{what}: contents.{field} holds values out of the range of {tensor.datatype}")
    return wide.astype(dtype).reshape(shape)


def _decode_inputs(request: service_pb2.ModelInferRequest, check: v2.CheckDeclared | None) -> dict[str, Array]:
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise BadRequestError(
            f"raw_input_contents holds {len(raw)} tensors for {len(request.inputs)} inputs: send every input raw, "
            "or none"
        )
    inputs: dict[str, Array] = {}
    for index, tensor in enumerate(request.inputs):
        what = f"input '{tensor.name}'"
        v2.check_parameters(parameters_of(tensor.parameters), what)
        shape = parse_shape(list(tensor.shape), what)
        dtype_of(tensor.datatype, what)
        if check is not None:
            check(tensor.name, tensor.datatype, shape)
        if tensor.name in inputs:
            raise BadRequestError(f"{what} is given twice")
        inputs[tensor.name] = (
            v2.decode_binary(raw[index], tensor.datatype, shape, what) if raw else _from_contents(tensor, shape, what)
        )
    return inputs


def _output_parameters(parameters: Mapping[str, _Parameter], what: str) -> dict[str, Any]:
    """An output's parameters, less `binary_data`: every gRPC output is sent as raw bytes, so the flag means
    nothing here (and is not checked)."""
    checked = v2.check_parameters(parameters_of(parameters), what)
    checked.pop("binary_data", None)
    return checked


def _timeout_ms(parameters: dict[str, Any]) -> int | None:
    """Our `timeout_ms`, or Triton's `timeout` (microseconds, as tritonclient sends it)."""
    timeout_ms = v2.timeout_ms_parameter(parameters)
    micros = parameters.get("timeout")
    if timeout_ms is None and micros is not None:
        if type(micros) is not int or micros < 1:
            raise BadRequestError(f"parameter timeout must be a positive integer (microseconds), got {micros!r}")
        timeout_ms = max(1, micros // 1000)
    return timeout_ms


def parse_model_infer(request: service_pb2.ModelInferRequest, check: v2.CheckDeclared | None = None) -> InferRequest:
    """A ModelInferRequest as the data plane's InferRequest (which the data plane checks against its version;
    `check` sees each input's name, datatype and shape before its data is read).

    Inputs come as raw_input_contents (every one) or typed contents; BYTES raw data has 4-byte length prefixes.

    Raises:
        BadRequestError: naming the bad field, input or output and what was expected.
    """
    if not request.inputs:
        raise BadRequestError("'inputs' must be a non-empty list")
    inputs = _decode_inputs(request, check)
    outputs = tuple(
        v2.requested_output(o.name, _output_parameters(o.parameters, f"output '{o.name}'")) for o in request.outputs
    )
    parameters = v2.check_parameters(parameters_of(request.parameters), "request")
    return InferRequest(
        model=request.model_name,
        inputs=inputs,
        outputs=outputs,
        version=v2.parse_version_number(request.model_version),
        id=request.id or None,
        timeout_ms=_timeout_ms(parameters),
        use_cache=v2.bool_parameter(parameters, "cache") is not False,
        binary_output=True,
    )


_MODEL_NAME_TAG, _MODEL_VERSION_TAG = 0x0A, 0x12  # ModelInferRequest fields 1 and 2 (length-delimited)
_RAW_INPUT_TAG = 0x3A  # ModelInferRequest field 7, raw_input_contents (length-delimited); the last field


@dataclass(frozen=True, slots=True)
class MessageLayout:
    """A serialized ModelInferRequest read without protobuf: the model and version it names, where its raw contents
    begin (what comes before is the part a template is kept under) and each one's (start, end)."""

    model: str
    version: str
    prefix_end: int
    spans: list[tuple[int, int]]


def read_layout(message: bytes) -> MessageLayout | None:
    """The layout of a ModelInferRequest whose raw_input_contents come last, after top-level fields that are all
    length-delimited with one-byte tags (as protobuf serializers write it); else None (parse it in full)."""
    position, size, first, spans = 0, len(message), -1, []
    model = version = b""
    while position < size:
        tag = message[position]
        if tag & 0x87 != 2:  # a multi-byte tag, or not length-delimited
            return None
        start, length, shift = position, 0, 0
        position += 1
        while True:
            if position >= size or shift > 28:
                return None
            byte = message[position]
            position += 1
            length |= (byte & 0x7F) << shift
            if byte < 0x80:
                break
            shift += 7
        if tag == _RAW_INPUT_TAG:
            if first < 0:
                first = start
            spans.append((position, position + length))
        elif first >= 0:
            return None
        elif tag == _MODEL_NAME_TAG:
            model = message[position : position + length]
        elif tag == _MODEL_VERSION_TAG:
            version = message[position : position + length]
        position += length
    if first < 0 or position != size or not model:
        return None
    try:
        return MessageLayout(model.decode(), version.decode(), first, spans)
    except UnicodeDecodeError:
        return None


@dataclass(frozen=True, slots=True)
class _InferTemplate:
    """A ModelInferRequest less its raw contents, parsed and checked once: the model and version it names, each
    input's name, dtype, shape, element count and byte size, and the rest of the request."""

    model: str
    version: int | None
    inputs: tuple[tuple[str, np.dtype[Any], tuple[int, ...], int, int], ...]
    outputs: tuple[RequestedOutput, ...]
    timeout_ms: int | None
    use_cache: bool

    def apply(self, message: bytes, spans: list[tuple[int, int]]) -> InferRequest | None:
        """The request whose raw contents are at `spans` of `message`; None when their sizes differ."""
        if len(spans) != len(self.inputs):
            return None
        inputs = {}
        for (name, dtype, shape, count, nbytes), (start, end) in zip(self.inputs, spans, strict=True):
            if end - start != nbytes:
                return None
            inputs[name] = np.frombuffer(message, dtype, count, start).reshape(shape)
        return InferRequest(self.model, inputs, self.outputs, self.version, None, self.timeout_ms, self.use_cache, True)


class InferTemplates:
    """One version's ModelInferRequests parsed as bytes, skipping the protobuf parse and the checks for a request
    whose fields before its raw contents were seen before (the gRPC door's counterpart of `v2.HeaderTemplates`; a
    VersionView keeps one per version).

    Clients send the same fields (model, inputs' names, datatypes and shapes, outputs, parameters) for every
    request of one shape; only the raw contents differ. A request with raw contents of numbers only (no typed
    contents, no BYTES) and no `id` becomes a template; the next request with the same leading bytes takes its
    arrays straight from the message.
    """

    def __init__(self, size: int = 256, max_prefix_bytes: int = 8192) -> None:
        self._templates: TemplateCache[_InferTemplate] = TemplateCache(size)
        self._max_prefix_bytes = max_prefix_bytes

    def apply(self, message: bytes, layout: MessageLayout) -> InferRequest | None:
        """The request of a message whose leading fields were seen before, or None (parse it in full)."""
        template = self._templates.get(message[: layout.prefix_end])
        return None if template is None else template.apply(message, layout.spans)

    def keep(self, message: bytes, request: service_pb2.ModelInferRequest, parsed: InferRequest) -> None:
        """Keep the template of `message` (parsed in full, and checked for this version) when it can have one."""
        if request.id or not request.raw_input_contents or not v2.LITTLE_ENDIAN:
            return
        layout = read_layout(message)
        if layout is None or layout.prefix_end > self._max_prefix_bytes:
            return
        inputs = []
        for name, array in parsed.inputs.items():
            if array.dtype.kind not in "biuf":
                return
            inputs.append((name, array.dtype, tuple(array.shape), array.size, array.nbytes))
        outputs = tuple(o for o in parsed.outputs if isinstance(o, RequestedOutput))
        if len(outputs) != len(parsed.outputs):
            return
        template = _InferTemplate(
            parsed.model, parsed.version, tuple(inputs), outputs, parsed.timeout_ms, parsed.use_cache
        )
        self._templates.put(message[: layout.prefix_end], template)


def encode_model_infer(response: InferResponse, max_bytes: int | None = None) -> service_pb2.ModelInferResponse:
    """A ModelInferResponse: every output in `raw_output_contents`, in the order of the requested outputs.

    Raises:
        PayloadTooLargeError: the outputs hold more than `max_bytes` (the message size limit).
    """
    answer = service_pb2.ModelInferResponse(
        model_name=response.model, model_version=str(response.version), id=response.id or ""
    )
    for name, array in response.outputs.items():
        answer.outputs.add(name=name, datatype=datatype_of(array.dtype), shape=array.shape)
        answer.raw_output_contents.append(v2.tensor_bytes(array))
    size = sum(len(raw) for raw in answer.raw_output_contents)
    if max_bytes is not None and size > max_bytes:
        raise PayloadTooLargeError(
            f"the answer holds {size} bytes of outputs, over the message size limit of {max_bytes} bytes "
            "(max_body_bytes): ask for fewer rows or outputs"
        )
    return answer


def model_metadata(metadata: dict[str, Any]) -> service_pb2.ModelMetadataResponse:
    """The V2 metadata of a version (as the REST door answers it) as a ModelMetadataResponse."""
    return service_pb2.ModelMetadataResponse(
        name=metadata["name"],
        versions=metadata["versions"],
        platform=metadata["platform"],
        inputs=[service_pb2.ModelMetadataResponse.TensorMetadata(**spec) for spec in metadata["inputs"]],
        outputs=[service_pb2.ModelMetadataResponse.TensorMetadata(**spec) for spec in metadata["outputs"]],
    )


def model_config(config: dict[str, Any]) -> service_pb2.ModelConfigResponse:
    """Triton's model configuration (protocols/triton.py's dict) as a ModelConfigResponse."""
    return service_pb2.ModelConfigResponse(config=json_format.ParseDict(config, model_config_pb2.ModelConfig()))


def model_statistics(stats: list[dict[str, Any]]) -> service_pb2.ModelStatisticsResponse:
    """Triton's `model_stats` entries (statistics.py's dicts) as a ModelStatisticsResponse (a pipeline's `steps`,
    which Triton's message has no field for, are left to the HTTP door)."""
    response = service_pb2.ModelStatisticsResponse()
    return json_format.ParseDict({"model_stats": stats}, response, ignore_unknown_fields=True)


def repository_index(rows: list[dict[str, str]], ready_only: bool) -> service_pb2.RepositoryIndexResponse:
    """The registry's index rows as a RepositoryIndexResponse (`ready_only`: READY versions only)."""
    return service_pb2.RepositoryIndexResponse(
        models=[
            service_pb2.RepositoryIndexResponse.ModelIndex(**row)
            for row in rows
            if not ready_only or row["state"] == "READY"
        ]
    )
