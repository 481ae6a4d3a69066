"""The gRPC V2 protocol (Triton's `inference.GRPCInferenceService` messages) <-> numpy arrays and plain values.

Every check of a request's inputs and outputs is the one the REST door uses (protocols/v2.py); only the
protobuf framing is read and written here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2

from layerserve.errors import BadRequestError, PayloadTooLargeError
from layerserve.protocols import v2
from layerserve.serving.layers import LayerGraph
from layerserve.tensors import Array, check_batch_sizes, datatype_of, dtype_of, parse_shape

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


def _decode_inputs(
    request: service_pb2.ModelInferRequest, graph: LayerGraph, encoded_input: str | None
) -> dict[str, Array]:
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
        v2.check_input(tensor.name, tensor.datatype, shape, graph, encoded_input)
        if tensor.name in inputs:
            raise BadRequestError(f"{what} is given twice")
        inputs[tensor.name] = (
            v2.decode_binary(raw[index], tensor.datatype, shape, what) if raw else _from_contents(tensor, shape, what)
        )
    return inputs


def _timeout_ms(parameters: dict[str, Any]) -> int | None:
    """Our `timeout_ms`, or Triton's `timeout` (microseconds, as tritonclient sends it)."""
    timeout_ms = v2.timeout_ms_parameter(parameters)
    micros = parameters.get("timeout")
    if timeout_ms is None and micros is not None:
        if type(micros) is not int or micros < 1:
            raise BadRequestError(f"parameter timeout must be a positive integer (microseconds), got {micros!r}")
        timeout_ms = max(1, micros // 1000)
    return timeout_ms


def parse_model_infer(
    request: service_pb2.ModelInferRequest, graph: LayerGraph, encoded_input: str | None
) -> v2.InferRequest:
    """A ModelInferRequest checked against a version's graph, as the REST door's InferRequest.

    Inputs come as raw_input_contents (every one) or typed contents; BYTES raw data has 4-byte length prefixes.

    Raises:
        BadRequestError: naming the bad field, input or output and what was expected.
    """
    if not request.inputs:
        raise BadRequestError("'inputs' must be a non-empty list")
    inputs = _decode_inputs(request, graph, encoded_input)
    v2.check_model_inputs(inputs, graph)
    check_batch_sizes(inputs)
    outputs = [
        v2.requested_output(o.name, v2.check_parameters(parameters_of(o.parameters), f"output '{o.name}'"), graph)
        for o in request.outputs
    ]
    v2.check_unique_outputs(outputs)
    parameters = v2.check_parameters(parameters_of(request.parameters), "request")
    return v2.InferRequest(
        id=request.id or None,
        inputs=inputs,
        outputs=tuple(outputs),
        binary_output=True,
        timeout_ms=_timeout_ms(parameters),
        use_cache=parameters.get("cache", True) is not False,
    )


def encode_model_infer(
    model_name: str,
    model_version: int,
    request: v2.InferRequest,
    outputs: dict[str, Array],
    labels: list[str] | None = None,
    labelled_output: str | None = None,
    max_bytes: int | None = None,
) -> service_pb2.ModelInferResponse:
    """A ModelInferResponse: every output in `raw_output_contents`, in the order of the requested outputs.

    Raises:
        PayloadTooLargeError: the outputs hold more than `max_bytes` (the message size limit).
    """
    response = service_pb2.ModelInferResponse(
        model_name=model_name, model_version=str(model_version), id=request.id or ""
    )
    for wanted, array in v2.response_arrays(request, outputs, labels, labelled_output):
        datatype = datatype_of(array.dtype)
        response.outputs.add(name=wanted.name, datatype=datatype, shape=array.shape)
        response.raw_output_contents.append(
            v2.encode_bytes_elements(array)
            if datatype == "BYTES"
            else np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
        )
    size = sum(len(raw) for raw in response.raw_output_contents)
    if max_bytes is not None and size > max_bytes:
        raise PayloadTooLargeError(
            f"the answer holds {size} bytes of outputs, over the message size limit of {max_bytes} bytes "
            "(max_body_bytes): ask for fewer rows or outputs"
        )
    return response


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
    """Triton's `model_stats` entries (statistics.py's dicts) as a ModelStatisticsResponse."""
    return json_format.ParseDict({"model_stats": stats}, service_pb2.ModelStatisticsResponse())


def repository_index(rows: list[dict[str, str]], ready_only: bool) -> service_pb2.RepositoryIndexResponse:
    """The registry's index rows as a RepositoryIndexResponse (`ready_only`: READY versions only)."""
    return service_pb2.RepositoryIndexResponse(
        models=[
            service_pb2.RepositoryIndexResponse.ModelIndex(**row)
            for row in rows
            if not ready_only or row["state"] == "READY"
        ]
    )
