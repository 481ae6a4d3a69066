"""TF Serving's warm-up records (`PredictionLog`s) -> layerserve infer requests: a predict log's TensorProtos become
arrays; a classify, regress or multi-inference log's Examples become the inputs they name (as `:classify` reads
them); a session run or a streamed predict has no layerserve counterpart and is refused."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from layerserve.errors import BadRequestError
from layerserve.messages import InferRequest
from layerserve.protocols.tfserving import SIGNATURE_NAME
from layerserve.protocols.tfserving_examples import examples_arrays
from layerserve.protocols.tfserving_messages import PredictionLog
from layerserve.serving.layers import LayerGraph
from layerserve.tensors import Array

# DataType number -> (its name, numpy dtype, the TensorProto field holding its values one by one)
_DATA_TYPES: dict[int, tuple[str, str, str]] = {
    1: ("DT_FLOAT", "float32", "float_val"),
    2: ("DT_DOUBLE", "float64", "double_val"),
    3: ("DT_INT32", "int32", "int_val"),
    4: ("DT_UINT8", "uint8", "int_val"),
    5: ("DT_INT16", "int16", "int_val"),
    6: ("DT_INT8", "int8", "int_val"),
    7: ("DT_STRING", "object", "string_val"),
    9: ("DT_INT64", "int64", "int64_val"),
    10: ("DT_BOOL", "bool", "bool_val"),
    17: ("DT_UINT16", "uint16", "int_val"),
    19: ("DT_HALF", "float16", "half_val"),
    22: ("DT_UINT32", "uint32", "uint32_val"),
    23: ("DT_UINT64", "uint64", "uint64_val"),
}
_TASKS = ("classify", "regress")


def tensor_array(tensor: Any, what: str) -> Array:
    """A TensorProto as TensorFlow reads it: its `tensor_content` (little-endian bytes), else its typed values, the
    last value repeated to fill the shape (none: zeros); `half_val` holds FP16 bit patterns.

    Raises:
        BadRequestError: an unknown rank, a negative dimension, a datatype layerserve has no tensor of, or more
            or fewer bytes than the shape holds.
    """
    if tensor.tensor_shape.unknown_rank or any(dim.size < 0 for dim in tensor.tensor_shape.dim):
        raise BadRequestError(f"{what}: the tensor's shape must be fully known")
    shape = tuple(dim.size for dim in tensor.tensor_shape.dim)
    if tensor.dtype not in _DATA_TYPES:
        raise BadRequestError(f"{what}: datatype {tensor.dtype} is not one layerserve serves (numbers, bools, strings)")
    name, dtype, field = _DATA_TYPES[tensor.dtype]
    size = math.prod(shape)
    if tensor.tensor_content and dtype != "object":
        content = tensor.tensor_content
        if len(content) != size * np.dtype(dtype).itemsize:
            raise BadRequestError(
                f"{what}: {len(content)} bytes of tensor_content for a {name} tensor of {list(shape)}"
            )
        return np.frombuffer(content, np.dtype(dtype).newbyteorder("<")).astype(dtype).reshape(shape)
    values = list(getattr(tensor, field))
    if len(values) > size:
        raise BadRequestError(f"{what}: {len(values)} values for a tensor of shape {list(shape)}")
    if dtype == "float16":
        flat = np.array(values, np.uint16).view(np.float16)
    else:
        flat = np.array(values, dtype) if values else np.zeros(0, dtype)
    if size and len(flat) < size:
        flat = np.concatenate([flat, np.repeat(flat[-1:] if len(flat) else np.zeros(1, dtype), size - len(flat))])
        if dtype == "object" and not values:
            flat[:] = b""
    return flat.reshape(shape)


def _check_spec(spec: Any, what: str) -> None:
    name = spec.signature_name
    if name and name != SIGNATURE_NAME:
        raise BadRequestError(f'{what}: signature "{name}" not found; the model has one signature: "{SIGNATURE_NAME}"')


def _example_values(example: Any) -> dict[str, list[Any]]:
    """An Example's features by name, each a list of its values."""
    values = {}
    for name, feature in example.features.feature.items():
        kind = feature.WhichOneof("kind")
        values[name] = list(getattr(feature, kind).value) if kind else []
    return values


def _examples_inputs(request: Any, graph: LayerGraph, encoded_input: str | None, what: str) -> dict[str, Array]:
    """A classify, regress or multi-inference request's Examples (and context) as the inputs they name."""
    _check_spec(request.model_spec, what)
    kind = request.input.WhichOneof("kind")
    if kind is None:
        raise BadRequestError(f"{what}: the request has no examples")
    listed = getattr(request.input, kind)
    examples = [_example_values(example) for example in listed.examples]
    context = _example_values(listed.context) if kind == "example_list_with_context" else {}
    if not examples:
        raise BadRequestError(f"{what}: the request has no examples")
    return examples_arrays(examples, context, graph, encoded_input)


def infer_request(record: bytes, model: str, graph: LayerGraph, encoded_input: str | None, what: str) -> InferRequest:
    """One warm-up record (a serialized PredictionLog) as the infer request it makes for `model`; a model spec's
    name is not checked (a warm-up file may be copied from another model), its signature is.

    Raises:
        BadRequestError: not a PredictionLog, a log kind layerserve does not serve, or bad tensors (naming `what`).
    """
    try:
        log = PredictionLog.FromString(record)
    except DecodeError as error:
        raise BadRequestError(f"{what}: not a tensorflow.serving.PredictionLog ({error})") from None
    kind = log.WhichOneof("log_type")
    if kind == "predict_log":
        request = log.predict_log.request
        _check_spec(request.model_spec, what)
        inputs = {name: tensor_array(tensor, f"{what}, input '{name}'") for name, tensor in request.inputs.items()}
        return InferRequest(model, inputs, tuple(request.output_filter))
    if kind in ("classify_log", "regress_log"):
        return InferRequest(model, _examples_inputs(getattr(log, kind).request, graph, encoded_input, what))
    if kind == "multi_inference_log":
        request = log.multi_inference_log.request
        for task in request.tasks:
            if task.method_name.rsplit("/", 1)[-1] not in _TASKS:
                raise BadRequestError(f"{what}: multi-inference task '{task.method_name}': layerserve serves {_TASKS}")
        return InferRequest(model, _examples_inputs(request, graph, encoded_input, what))
    found = kind or "no request (an empty or unknown log)"
    raise BadRequestError(
        f"{what}: {found}: layerserve warms up on predict, classify, regress and multi_inference logs only"
    )
