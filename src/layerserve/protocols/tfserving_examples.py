"""TF Serving `:classify` and `:regress`: lists of Examples (features named as the model's inputs) <-> arrays."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson

from layerserve.errors import BadRequestError
from layerserve.features.labels import top_k
from layerserve.lifecycle.model import Signature
from layerserve.protocols.tfserving import bytes_array, check_signature_name, decode_b64
from layerserve.protocols.v2 import load_json_object
from layerserve.serving.layers import LayerGraph
from layerserve.tensors import Array, TensorSpec, array_from_json

_REGRESSION_SHAPES = ((-1,), (-1, 1))


def parse_examples_request(body: bytes, graph: LayerGraph, encoded_input: str | None = None) -> dict[str, Array]:
    """Parse a `:classify` or `:regress` body: `examples` (objects of features), the optional `context`
    (features shared by every example) and `signature_name`, into one array per input.

    A feature is a model input by name: a value or a (nested) list per example. `encoded_input` (the
    input of a text or image model) may also take one string or `{"b64": ...}` per example.

    Raises:
        BadRequestError: naming the bad field, example or feature and what was expected.
    """
    request = load_json_object(body, "the request body")
    check_signature_name(request)
    examples = request.get("examples")
    if not isinstance(examples, list) or not examples or not all(isinstance(e, dict) for e in examples):
        raise BadRequestError("'examples' must be a non-empty list of objects: {\"<input name>\": <value or list>}")
    context = request.get("context", {})
    if not isinstance(context, dict):
        raise BadRequestError("'context' must be an object of the features every example shares")
    return examples_arrays(examples, context, graph, encoded_input)


def examples_arrays(
    examples: list[dict[str, Any]], context: dict[str, Any], graph: LayerGraph, encoded_input: str | None = None
) -> dict[str, Array]:
    """Examples (feature name -> value) and the context they share as one array per input (see
    parse_examples_request).

    Raises:
        BadRequestError: naming the bad example or feature and what was expected.
    """
    return {
        name: _feature_array(values, graph.spec(name, "input"), name == encoded_input)
        for name, values in _feature_columns(examples, context).items()
    }


def _feature_columns(examples: list[dict[str, Any]], context: dict[str, Any]) -> dict[str, list[Any]]:
    """Feature name -> its value in each example (a context feature repeated for every example)."""
    names = list(examples[0])
    for index, example in enumerate(examples):
        shared = sorted(set(example) & set(context))
        if shared:
            raise BadRequestError(
                f"example {index}: feature(s) {', '.join(shared)} also in 'context'; "
                "a context feature must not appear in the examples"
            )
        if set(example) != set(names):
            raise BadRequestError(
                f"example {index} has the features [{', '.join(sorted(example))}], example 0 has "
                f"[{', '.join(sorted(names))}]; every example needs the same features"
            )
    columns = {name: [example[name] for example in examples] for name in names}
    columns.update({name: [value] * len(examples) for name, value in context.items()})
    return columns


def _feature_array(values: list[Any], spec: TensorSpec, may_be_encoded: bool) -> Array:
    """One feature's values, one per example, stacked into the input's array."""
    what = f"feature '{spec.name}'"
    decoded = [decode_b64(value, what) for value in values]
    if may_be_encoded:
        items = [v[0] if isinstance(v, list) and len(v) == 1 else v for v in decoded]
        if all(isinstance(item, (str, bytes)) for item in items):
            return bytes_array(items, what)  # a text or an encoded image per example, decoded by the version
    rows = [_feature_row(value, spec, f"{what} of example {index}") for index, value in enumerate(decoded)]
    try:
        array = np.stack(rows)
    except ValueError:
        shapes = sorted({str(list(row.shape)) for row in rows})
        raise BadRequestError(f"{what}: the examples disagree on its shape: {', '.join(shapes)}") from None
    return array


def _feature_row(value: Any, spec: TensorSpec, what: str) -> Array:
    """One example's value of a feature, shaped as one row of the input (a flat list fills a fixed shape)."""
    if spec.datatype == "BYTES":
        flat = bytes_array(value if isinstance(value, list) else [value], what).reshape(-1)
    else:
        flat = array_from_json(value, spec.dtype, what)
    row_shape = spec.shape[1:]
    if -1 in row_shape:
        return flat.reshape(np.shape(value))
    expected = math.prod(row_shape)
    if flat.size != expected:
        raise BadRequestError(
            f"{what}: expected {expected} value(s), one row of the input's shape {list(spec.shape)}, got {flat.size}"
        )
    return flat.reshape(row_shape)


def encode_classifications(scores: Array, labels: list[str] | None) -> bytes:
    """`{"results": [[[label, score], ...], ...]}`: every class of each example, best first; a model
    without labels names its classes by index ("0", "1", ...)."""
    classes = math.prod(scores.shape[1:])
    ranked = top_k(scores, labels, classes)
    return orjson.dumps({"results": [[[c["label"], c["score"]] for c in row] for row in ranked]})


def regression_output(signature: Signature) -> str:
    """The output `:regress` answers: the model's only output, one scalar per example.

    Raises:
        BadRequestError: the model is not a regression model; the message names its outputs.
    """
    outputs = signature.outputs
    if len(outputs) == 1 and outputs[0].shape in _REGRESSION_SHAPES:
        return outputs[0].name
    found = ", ".join(f"'{spec.name}' {list(spec.shape)}" for spec in outputs)
    raise BadRequestError(
        "the model is not a regression model: :regress needs one output with one scalar per example "
        f"(shape [-1] or [-1, 1]), got {len(outputs)} output(s): {found}"
    )


def encode_regressions(values: Array) -> bytes:
    """`{"results": [value, ...]}`, one number per example."""
    return orjson.dumps({"results": values.reshape(-1).astype(np.float64).tolist()})
