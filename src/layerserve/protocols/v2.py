"""Open Inference Protocol (V2) JSON and the binary tensor data extension <-> numpy arrays."""

from __future__ import annotations

import base64
import binascii
import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from layerserve.errors import BadRequestError
from layerserve.features.labels import top_k
from layerserve.serving.layers import LayerGraph
from layerserve.tensors import (
    Array,
    TensorSpec,
    array_from_json,
    check_against_spec,
    check_batch_sizes,
    datatype_of,
    dtype_of,
    parse_shape,
    reshape_checked,
)

HEADER_LENGTH = "inference-header-content-length"
_U32 = struct.Struct("<I")


@dataclass(frozen=True)
class RequestedOutput:
    """An output the client asked for: as binary data (None: request default), as top-k classes."""

    name: str
    binary: bool | None
    classification: int | None = None


@dataclass(frozen=True)
class InferRequest:
    """A parsed infer request: validated input arrays by name and the outputs to return."""

    id: str | None
    inputs: dict[str, Array]
    outputs: tuple[RequestedOutput, ...]
    binary_output: bool
    timeout_ms: int | None = None
    use_cache: bool = True


def parse_version_number(raw: str | None) -> int | None:
    """A version given as text (a path's `{version}`, a gRPC `model_version`): None if absent or empty.

    Raises:
        BadRequestError: the version is not a positive integer.
    """
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise BadRequestError(f"version must be a positive integer, got {raw!r}")
    return int(raw)


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """Split a body into its JSON header and binary tail per `Inference-Header-Content-Length`.

    Raises:
        BadRequestError: the header is not an integer within the body's length.
    """
    if header_length is None:
        return body, b""
    if not (header_length.strip().isascii() and header_length.strip().isdigit()):
        raise BadRequestError(f"Inference-Header-Content-Length must be a non-negative integer, got {header_length!r}")
    length = int(header_length)
    if length > len(body):
        raise BadRequestError(f"Inference-Header-Content-Length {length} is larger than the body ({len(body)} bytes)")
    return body[:length], body[length:]


MAX_JSON_DEPTH = 100


def _json_depth(value: Any) -> int:
    """How deeply lists and objects nest in a parsed JSON value."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (list, dict)))
    return deepest


def load_json_object(raw: bytes, what: str) -> dict[str, Any]:
    """Parse a JSON object nested at most MAX_JSON_DEPTH deep.

    Raises:
        BadRequestError: invalid JSON, nested too deep, or not an object.
    """
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        if "recursion" in str(error).lower():
            raise BadRequestError(f"{what} nests JSON too deep (more than {MAX_JSON_DEPTH} levels)") from None
        raise BadRequestError(f"{what} is not valid JSON: {error}") from None
    # Fewer brackets than the limit cannot nest past it; only bodies with many are walked.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _json_depth(value) > MAX_JSON_DEPTH:
        raise BadRequestError(f"{what} nests JSON too deep (more than {MAX_JSON_DEPTH} levels)")
    if not isinstance(value, dict):
        raise BadRequestError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _parameters(item: dict[str, Any], what: str) -> dict[str, Any]:
    parameters = item.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise BadRequestError(f"{what}: parameters must be an object")
    return check_parameters(parameters, what)


def check_parameters(parameters: dict[str, Any], what: str) -> dict[str, Any]:
    """The parameters of a request, an input or an output, refused where they name shared memory.

    Raises:
        BadRequestError: a shared-memory parameter.
    """
    if "shared_memory_region" in parameters:
        raise BadRequestError(
            f"{what}: shared memory (shared_memory_region) is not supported by layerserve; "
            "send tensors in the request body (binary tensor data)"
        )
    return parameters


def _decode_bytes_elements(raw: bytes, count: int, what: str) -> Array:
    elements: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise BadRequestError(f"{what}: truncated BYTES length prefix at offset {offset}")
        (size,) = _U32.unpack_from(raw, offset)
        offset += 4
        if offset + size > len(raw):
            raise BadRequestError(f"{what}: BYTES element of {size} bytes runs past the end of its data")
        elements.append(raw[offset : offset + size])
        offset += size
    if len(elements) != count:
        raise BadRequestError(f"{what}: binary data holds {len(elements)} BYTES elements, shape needs {count}")
    array = np.empty(count, dtype=object)
    array[:] = elements
    return array


def decode_binary(raw: bytes, datatype: str, shape: tuple[int, ...], what: str) -> Array:
    """One tensor's binary data (little-endian values, or length-prefixed BYTES elements) as an array.

    Raises:
        BadRequestError: the data does not hold the shape's elements.
    """
    count = int(np.prod(shape))
    dtype = dtype_of(datatype, what)
    if datatype == "BYTES":
        return _decode_bytes_elements(raw, count, what).reshape(shape)
    if len(raw) != count * dtype.itemsize:
        raise BadRequestError(
            f"{what}: binary_data_size {len(raw)} does not match shape {list(shape)} of {datatype} "
            f"({count * dtype.itemsize} bytes expected)"
        )
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype, copy=False).reshape(shape)


def _decode_input(
    item: Any, binary: bytes, offset: int, graph: LayerGraph, encoded_input: str | None
) -> tuple[str, Array, int]:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise BadRequestError("each entry of 'inputs' must be an object with a string 'name'")
    name = item["name"]
    what = f"input '{name}'"
    parameters = _parameters(item, what)
    shape = parse_shape(item.get("shape"), what)
    datatype = item.get("datatype")
    dtype = dtype_of(datatype, what)
    spec = check_input(name, str(datatype), shape, graph, encoded_input)
    size = parameters.get("binary_data_size")
    if size is not None:
        if type(size) is not int or size < 0 or offset + size > len(binary):
            raise BadRequestError(f"{what}: binary_data_size {size!r} runs past the binary data")
        return name, decode_binary(binary[offset : offset + size], str(datatype), shape, what), offset + size
    if "data" not in item:
        raise BadRequestError(f"{what}: needs 'data' or a binary_data_size parameter")
    array = reshape_checked(array_from_json(item["data"], dtype, what), shape, what)
    if name == encoded_input and datatype == "BYTES" and spec.datatype != "INT32":
        array = _base64_elements(array, what)  # images; texts (INT32 token inputs) come as plain strings
    return name, array, offset


def check_input(
    name: str, datatype: str, shape: tuple[int, ...], graph: LayerGraph, encoded_input: str | None
) -> TensorSpec:
    """Check one named input (a model input or a cut layer) against the version's graph; returns its spec.

    `encoded_input` (an image or text model's input) may also come as BYTES of shape [N] or [N, 1].

    Raises:
        BadRequestError: no input or layer of that name, or the datatype or shape does not fit.
    """
    what = f"input '{name}'"
    spec = graph.spec(name, "input")
    if name == encoded_input and datatype == "BYTES":
        if len(shape) not in (1, 2) or shape[0] < 1 or math.prod(shape) != shape[0]:
            raise BadRequestError(f"{what}: encoded images need shape [N] or [N, 1], got {list(shape)}")
    else:
        check_against_spec(spec, datatype, shape)
    return spec


def _base64_elements(array: Array, what: str) -> Array:
    """JSON cannot carry raw bytes: encoded images in JSON data are base64 strings."""
    decoded = np.empty(array.shape, dtype=object)
    try:
        for index, element in np.ndenumerate(array):
            decoded[index] = base64.b64decode(element, validate=True)
    except binascii.Error:
        raise BadRequestError(f"{what}: encoded images in JSON data must be base64 strings") from None
    return decoded


def _requested_outputs(raw: Any, graph: LayerGraph) -> tuple[RequestedOutput, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise BadRequestError("'outputs' must be a list of objects with a 'name'")
    requested = []
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise BadRequestError("each entry of 'outputs' must be an object with a string 'name'")
        requested.append(requested_output(item["name"], _parameters(item, f"output '{item['name']}'"), graph))
    check_unique_outputs(requested)
    return tuple(requested)


def requested_output(name: str, parameters: dict[str, Any], graph: LayerGraph) -> RequestedOutput:
    """One requested output (a model output or any layer) with its binary_data and classification parameters.

    Raises:
        BadRequestError: no output or layer of that name, or classification is not a positive integer.
    """
    graph.spec(name, "output")
    binary = parameters.get("binary_data")
    classes = parameters.get("classification")
    if classes is not None and (type(classes) is not int or classes < 1):
        raise BadRequestError(f"output '{name}': classification must be a positive integer")
    return RequestedOutput(name, None if binary is None else bool(binary), classes)


def check_unique_outputs(requested: list[RequestedOutput]) -> None:
    """Raises BadRequestError when an output is requested twice."""
    names = [output.name for output in requested]
    if len(set(names)) != len(names):
        raise BadRequestError(f"output names must be unique, got {names}")


def parse_infer_request(
    body: bytes, header_length: str | None, graph: LayerGraph, encoded_input: str | None = None
) -> InferRequest:
    """Parse and validate a V2 infer request (JSON, or JSON + binary tensor data) against a version's graph.

    Inputs and outputs may name any layer (cuts and layer outputs); with only model inputs, all are needed.
    `encoded_input` (an image model's input) may also come as BYTES: encoded images, base64 in JSON.

    Raises:
        BadRequestError: naming the bad field or input and what was expected.
    """
    header, binary = split_body(body, header_length)
    request = load_json_object(header, "the request body")
    raw_inputs = request.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise BadRequestError("'inputs' must be a non-empty list")
    inputs: dict[str, Array] = {}
    offset = 0
    for item in raw_inputs:
        name, array, offset = _decode_input(item, binary, offset, graph, encoded_input)
        if name in inputs:
            raise BadRequestError(f"input '{name}' is given twice")
        inputs[name] = array
    check_model_inputs(inputs, graph)
    check_batch_sizes(inputs)
    request_id = request.get("id")
    parameters = _parameters(request, "request")
    return InferRequest(
        id=None if request_id is None else str(request_id),
        inputs=inputs,
        outputs=_requested_outputs(request.get("outputs"), graph),
        binary_output=bool(parameters.get("binary_data_output", False)),
        timeout_ms=timeout_ms_parameter(parameters),
        use_cache=parameters.get("cache", True) is not False,
    )


def timeout_ms_parameter(parameters: dict[str, Any]) -> int | None:
    """The request parameter `timeout_ms`, if given.

    Raises:
        BadRequestError: not a positive integer.
    """
    timeout = parameters.get("timeout_ms")
    if timeout is not None and (type(timeout) is not int or timeout < 1):
        raise BadRequestError(f"parameter timeout_ms must be a positive integer (milliseconds), got {timeout!r}")
    return timeout


def check_model_inputs(inputs: dict[str, Array], graph: LayerGraph) -> None:
    """A request that names only model inputs must give all of them (cuts are checked by the graph).

    Raises:
        BadRequestError: naming the missing inputs.
    """
    model_inputs = [spec.name for spec in graph.signature.inputs]
    if set(inputs) <= set(model_inputs):
        missing = [name for name in model_inputs if name not in inputs]
        if missing:
            raise BadRequestError(f"missing input(s): {', '.join(missing)}")


def encode_bytes_elements(array: Array) -> bytes:
    """BYTES elements as binary data: each a 4-byte little-endian length and its bytes."""
    parts = []
    for element in array.reshape(-1):
        raw = element if isinstance(element, bytes) else str(element).encode("utf-8")
        parts.append(_U32.pack(len(raw)))
        parts.append(raw)
    return b"".join(parts)


def _json_data(array: Array) -> Any:
    if array.dtype.kind in "OSU":
        return [e.decode("utf-8", "replace") if isinstance(e, bytes) else str(e) for e in array.reshape(-1)]
    return np.ascontiguousarray(array.reshape(-1))


def classification_strings(scores: Array, labels: list[str] | None, k: int) -> Array:
    """The classification extension's BYTES tensor: per row, the k best as `score:index[:label]` (a label only
    where `labels` names that index)."""
    count = len(labels) if labels else 0
    rows = []
    for row in top_k(scores, labels, k):
        rows.append([f"{c['score']:f}:{c['index']}" + (f":{c['label']}" if c["index"] < count else "") for c in row])
    strings = np.empty((len(rows), len(rows[0]) if rows else 0), dtype=object)
    strings[:] = [[text.encode("utf-8") for text in row] for row in rows]
    return strings


def response_arrays(
    request: InferRequest, outputs: dict[str, Array], labels: list[str] | None, labelled_output: str | None
) -> list[tuple[RequestedOutput, Array]]:
    """The arrays to answer, in the order of the requested outputs (all outputs if none was named), each
    requested classification made into its BYTES tensor."""
    requested = request.outputs or tuple(RequestedOutput(name, None) for name in outputs)
    answer = []
    for wanted in requested:
        array = outputs[wanted.name]
        if wanted.classification is not None:
            own_labels = labels if wanted.name == labelled_output else None
            array = classification_strings(array, own_labels, wanted.classification)
        answer.append((wanted, array))
    return answer


def encode_infer_response(
    model_name: str,
    model_version: int,
    request: InferRequest,
    outputs: dict[str, Array],
    labels: list[str] | None = None,
    labelled_output: str | None = None,
) -> tuple[bytes, int | None]:
    """Encode a V2 response; returns the body and the JSON header's length when binary data follows.

    `labels` name the classes of `labelled_output` only (the model's classify output): the classification of
    any other output or layer is Triton's plain `score:index`.
    """
    entries, tails = [], []
    for wanted, array in response_arrays(request, outputs, labels, labelled_output):
        entry: dict[str, Any] = {
            "name": wanted.name,
            "datatype": datatype_of(array.dtype),
            "shape": list(array.shape),
        }
        if request.binary_output if wanted.binary is None else wanted.binary:
            raw = (
                encode_bytes_elements(array)
                if entry["datatype"] == "BYTES"
                else np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
            )
            entry["parameters"] = {"binary_data_size": len(raw)}
            tails.append(raw)
        else:
            entry["data"] = _json_data(array)
        entries.append(entry)
    response: dict[str, Any] = {
        "model_name": model_name,
        "model_version": str(model_version),
        "outputs": entries,
    }
    if request.id is not None:
        response["id"] = request.id
    header = orjson.dumps(response, option=orjson.OPT_SERIALIZE_NUMPY)
    if not tails:
        return header, None
    return header + b"".join(tails), len(header)
