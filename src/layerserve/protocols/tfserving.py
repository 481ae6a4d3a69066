"""TF Serving REST: `instances` (row) and `inputs` (columnar) requests <-> numpy arrays."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from layerserve.errors import BadRequestError
from layerserve.lifecycle.model import Signature
from layerserve.protocols.v2 import load_json_object
from layerserve.serving.layers import LayerGraph
from layerserve.tensors import Array, TensorSpec, array_from_json

_TF_DTYPES = {
    "BOOL": "DT_BOOL",
    "UINT8": "DT_UINT8",
    "UINT16": "DT_UINT16",
    "UINT32": "DT_UINT32",
    "UINT64": "DT_UINT64",
    "INT8": "DT_INT8",
    "INT16": "DT_INT16",
    "INT32": "DT_INT32",
    "INT64": "DT_INT64",
    "FP16": "DT_HALF",
    "FP32": "DT_FLOAT",
    "FP64": "DT_DOUBLE",
    "BYTES": "DT_STRING",
}


SIGNATURE_NAME = "serving_default"


def check_signature_name(request: dict[str, Any]) -> None:
    """`signature_name`, when given, must be the one signature a Keras model has: `serving_default`.

    Raises:
        BadRequestError: another signature name (TF Serving's message, with the one there is).
    """
    name = request.get("signature_name")
    if name is None or name == SIGNATURE_NAME:
        return
    if not isinstance(name, str):
        raise BadRequestError(f"'signature_name' must be a string, got {type(name).__name__}")
    raise BadRequestError(
        f'Serving signature name: "{name}" not found in signature def; the model has one signature: "{SIGNATURE_NAME}"'
    )


@dataclass(frozen=True)
class PredictRequest:
    """A parsed `:predict` body: input arrays by name, the outputs asked for, and the answer's format."""

    inputs: dict[str, Array]
    outputs: tuple[str, ...]
    is_row_format: bool


def decode_b64(value: Any, what: str) -> Any:
    """Replace every `{"b64": "..."}` in nested lists with its bytes.

    Raises:
        BadRequestError: another kind of object, or invalid base64.
    """
    if isinstance(value, list):
        return [decode_b64(item, what) for item in value]
    if isinstance(value, dict):
        if set(value) != {"b64"} or not isinstance(value["b64"], str):
            raise BadRequestError(f'{what}: objects in tensor data must be {{"b64": "..."}}')
        try:
            return base64.b64decode(value["b64"], validate=True)
        except binascii.Error as error:
            raise BadRequestError(f"{what}: invalid base64: {error}") from None
    return value


def _is_encoded(value: Any) -> bool:
    """Whether tensor data is a list of strings or bytes (texts, or images after base64 decoding)."""
    return isinstance(value, list) and bool(value) and all(isinstance(item, (str, bytes)) for item in value)


def _to_array(value: Any, spec: TensorSpec, may_be_encoded: bool = False) -> Array:
    what = f"input '{spec.name}'"
    value = decode_b64(value, what)
    if may_be_encoded and _is_encoded(value):
        return bytes_array(value, what)  # UTF-8 texts of a text model, or encoded images of an image model
    if spec.datatype == "BYTES":
        array = bytes_array(value, what)
    else:
        try:
            shaped = np.asarray(value)
        except (ValueError, TypeError):
            raise BadRequestError(f"{what}: data must be a (nested) list of numbers of one shape") from None
        array = array_from_json(value, spec.dtype, what).reshape(shaped.shape)
    return array


def bytes_array(value: Any, what: str) -> Array:
    """Strings (UTF-8 encoded) and bytes in nested lists -> an object array of bytes of their shape.

    Raises:
        BadRequestError: another kind of value, or ragged lists.
    """

    def walk(item: Any) -> Any:
        if isinstance(item, list):
            return [walk(i) for i in item]
        if isinstance(item, str):
            return item.encode("utf-8")
        if isinstance(item, bytes):
            return item
        raise BadRequestError(f'{what}: expected strings or {{"b64": ...}}, got {type(item).__name__}')

    nested = walk(value)
    try:
        return np.array(nested, dtype=object)
    except ValueError:
        raise BadRequestError(f"{what}: string data must be lists of one shape") from None


def _rows_to_columns(instances: list[Any], signature: Signature) -> dict[str, list[Any]]:
    model_inputs = [spec.name for spec in signature.inputs]
    first = instances[0]
    named = isinstance(first, dict) and set(first) != {"b64"}
    if len(model_inputs) > 1 and not named:
        raise BadRequestError(f"each instance must be an object with the inputs {', '.join(model_inputs)}")
    names = list(first) if named else model_inputs[:1]
    columns: dict[str, list[Any]] = {name: [] for name in names}
    for row in instances:
        values = row if named and isinstance(row, dict) else {names[0]: row}
        for name in names:
            if name not in values:
                raise BadRequestError(f"an instance lacks input '{name}'")
            columns[name].append(values[name])
        if len(values) != len(names):
            raise BadRequestError(f"every instance must name the same inputs: {', '.join(names)}")
    return columns


def _output_filter(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(name, str) for name in raw) or len(set(raw)) != len(raw):
        raise BadRequestError("'output_filter' must be a list of distinct output or layer names")
    return tuple(raw)


def parse_predict_request(body: bytes, graph: LayerGraph, encoded_input: str | None = None) -> PredictRequest:
    """Parse a `:predict` body with `instances` or `inputs`, the optional `output_filter` of names and
    `signature_name`.

    Instances and columns may name layers (cuts); a single-input model also takes bare values.
    `encoded_input` (the input of a text or image model) may also come as strings: texts, or
    `{"b64": ...}` images.

    Raises:
        BadRequestError: naming the bad field or input and what was expected.
    """
    request = load_json_object(body, "the request body")
    check_signature_name(request)
    if ("instances" in request) == ("inputs" in request):
        raise BadRequestError("the body needs exactly one of 'instances' (row format) or 'inputs' (columnar)")
    signature = graph.signature
    if "instances" in request:
        instances = request["instances"]
        if not isinstance(instances, list) or not instances:
            raise BadRequestError("'instances' must be a non-empty list")
        columns: dict[str, Any] = _rows_to_columns(instances, signature)
    else:
        columns = request["inputs"]
        single = len(signature.inputs) == 1
        if single and not (isinstance(columns, dict) and set(columns) != {"b64"}):
            columns = {signature.inputs[0].name: columns}
        if not isinstance(columns, dict):
            names = ", ".join(spec.name for spec in signature.inputs)
            raise BadRequestError(f"'inputs' must be an object with the inputs {names}")
    arrays = {
        name: _to_array(value, graph.spec(name, "input"), name == encoded_input) for name, value in columns.items()
    }
    outputs = _output_filter(request.get("output_filter"))
    return PredictRequest(arrays, outputs, is_row_format="instances" in request)


def _jsonable(array: Array) -> Any:
    if array.dtype.kind in "OSU":
        return [_jsonable_bytes(item) for item in array] if array.ndim else _jsonable_bytes(array.item())
    return array


def _jsonable_bytes(item: Any) -> Any:
    if isinstance(item, np.ndarray):
        return _jsonable(item)
    if isinstance(item, bytes):
        try:
            return item.decode("utf-8")
        except UnicodeDecodeError:
            return {"b64": base64.b64encode(item).decode("ascii")}
    return item


def encode_predict_response(request: PredictRequest, outputs: dict[str, Array]) -> bytes:
    """`{"predictions": ...}` for row requests, `{"outputs": ...}` for columnar ones."""
    if request.is_row_format:
        if len(outputs) == 1:
            body: dict[str, Any] = {"predictions": _jsonable(next(iter(outputs.values())))}
        else:
            rows = len(next(iter(outputs.values())))
            body = {"predictions": [{n: _jsonable(a[i]) for n, a in outputs.items()} for i in range(rows)]}
    elif len(outputs) == 1:
        body = {"outputs": _jsonable(next(iter(outputs.values())))}
    else:
        body = {"outputs": {name: _jsonable(array) for name, array in outputs.items()}}
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def _tensor_info(spec: TensorSpec) -> dict[str, Any]:
    return {
        "dtype": _TF_DTYPES[spec.datatype],
        "tensor_shape": {"dim": [{"size": str(d), "name": ""} for d in spec.shape], "unknown_rank": False},
        "name": spec.name,
    }


def signature_def(signature: Signature) -> dict[str, Any]:
    """The `serving_default` signature_def of the metadata answer."""
    return {
        "inputs": {spec.name: _tensor_info(spec) for spec in signature.inputs},
        "outputs": {spec.name: _tensor_info(spec) for spec in signature.outputs},
        "method_name": "tensorflow/serving/predict",
    }
