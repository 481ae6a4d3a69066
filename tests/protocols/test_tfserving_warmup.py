"""TF Serving warm-up records -> infer requests: tensors made by TensorFlow's own make_tensor_proto and Examples by
tf.train.Example, wrapped in PredictionLogs encoded here from the field numbers of TF Serving's .proto files."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.example import example_pb2, feature_pb2
from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2

from layerserve.errors import BadRequestError
from layerserve.lifecycle.model import Signature
from layerserve.protocols.tfserving_messages import message_class
from layerserve.protocols.tfserving_warmup import infer_request, tensor_array
from layerserve.serving.layers import LayerGraph
from layerserve.tensors import TensorSpec

GRAPH = LayerGraph(
    Signature((TensorSpec("x", "FP32", (-1, 4)), TensorSpec("n", "INT64", (-1,))), (TensorSpec("y", "FP32", (-1, 2)),))
)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (protobuf's wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def predict_log(inputs: dict[str, Any], outputs: tuple[str, ...] = (), signature: str = "") -> bytes:
    """PredictionLog{predict_log=6: PredictLog{request=1: PredictRequest{model_spec=1, inputs=2, output_filter=3}}}."""
    spec = field(1, b"some_model") + (field(3, signature.encode()) if signature else b"")
    request = field(1, spec)
    for name, value in inputs.items():
        tensor = tf.make_tensor_proto(value).SerializeToString()
        request += field(2, field(1, name.encode()) + field(2, tensor))
    request += b"".join(field(3, name.encode()) for name in outputs)
    return field(6, field(1, request))


def _feature(values: list[Any]) -> Any:
    if all(type(value) is int for value in values):
        return feature_pb2.Feature(int64_list=feature_pb2.Int64List(value=values))
    return feature_pb2.Feature(float_list=feature_pb2.FloatList(value=values))


def examples_log(kind: int, examples: list[dict[str, list[Any]]]) -> bytes:
    """PredictionLog{classify_log=2 or regress_log=3: {request=1: {model_spec=1, input=2: Input{example_list=1}}}}."""
    listed = b""
    for example in examples:
        features = {name: _feature(values) for name, values in example.items()}
        listed += field(1, example_pb2.Example(features=feature_pb2.Features(feature=features)).SerializeToString())
    return field(kind, field(1, field(1, field(1, b"m")) + field(2, field(1, listed))))


@pytest.mark.parametrize(
    "value",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
        np.array([[1.5, -2.25]], np.float64),
        np.array([[-3, 4]], np.int8),
        np.array([[200, 3]], np.uint8),
        np.array([1, 2**40], np.int64),
        np.array([[True, False]]),
        np.array([0.5, 65504, -1], np.float16),
        np.array([[b"ab", b""], [b"\xff", b"c"]], dtype=object),
        np.zeros((0, 4), np.float32),
    ],
)
def test_tensors_equal_the_arrays_tensorflow_made_them_of(value: Any) -> None:
    tensor = message_class("TensorProto").FromString(tf.make_tensor_proto(value).SerializeToString())
    decoded = tensor_array(tensor, "input")
    assert decoded.dtype == value.dtype and decoded.shape == value.shape
    assert decoded.tolist() == value.tolist()


def test_typed_values_fill_their_shape_as_tensorflow_does() -> None:
    filled = tf.make_tensor_proto(2.5, shape=[2, 3])  # one float_val, repeated by TensorFlow's reader
    tensor = message_class("TensorProto").FromString(filled.SerializeToString())
    assert tensor_array(tensor, "x").tolist() == tf.make_ndarray(filled).tolist()
    half = tensor_pb2.TensorProto(dtype=tf.float16.as_datatype_enum)
    half.tensor_shape.CopyFrom(tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=3)]))
    half.half_val.extend(np.array([1.5, -2, 0.25], np.float16).view(np.uint16).tolist())
    decoded = tensor_array(message_class("TensorProto").FromString(half.SerializeToString()), "x")
    assert decoded.tolist() == tf.make_ndarray(half).tolist() == [1.5, -2, 0.25]
    ints = tensor_pb2.TensorProto(dtype=tf.int32.as_datatype_enum, int_val=[7, 8])
    ints.tensor_shape.dim.add(size=4)
    decoded = tensor_array(message_class("TensorProto").FromString(ints.SerializeToString()), "x")
    assert decoded.tolist() == tf.make_ndarray(ints).tolist() == [7, 8, 8, 8]


def test_tensors_layerserve_has_no_type_for_are_refused() -> None:
    complex_tensor = message_class("TensorProto").FromString(
        tf.make_tensor_proto(np.array([1j], np.complex64)).SerializeToString()
    )
    with pytest.raises(BadRequestError, match="record 3, input 'z': datatype 8 is not one"):
        tensor_array(complex_tensor, "record 3, input 'z'")


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        ("TensorProto", tensor_pb2.TensorProto),
        ("TensorShapeProto", tensor_shape_pb2.TensorShapeProto),
        ("Example", example_pb2.Example),
        ("Feature", feature_pb2.Feature),
        ("Features", feature_pb2.Features),
    ],
)
def test_declared_fields_match_tensorflows_own(ours: str, theirs: Any) -> None:
    declared = message_class(ours).DESCRIPTOR.fields
    reference = theirs.DESCRIPTOR.fields_by_name
    for own in declared:
        assert own.number == reference[own.name].number, own.name
        assert own.is_repeated == reference[own.name].is_repeated, own.name
        if reference[own.name].enum_type is None:  # a DataType is read as its number
            assert own.type == reference[own.name].type, own.name


def test_a_predict_log_is_its_inputs_and_output_filter() -> None:
    x, n = np.ones((2, 4), np.float32), np.array([3, 4], np.int64)
    request = infer_request(predict_log({"x": x, "n": n}, ("y",), "serving_default"), "m", GRAPH, None, "record 0")
    assert request.model == "m" and [o.name for o in request.requested] == ["y"]
    assert request.inputs["x"].tolist() == x.tolist() and request.inputs["n"].tolist() == n.tolist()


def test_classify_and_regress_logs_give_the_inputs_their_examples_name() -> None:
    examples = [{"x": [1.0, 2.0, 3.0, 4.0], "n": [5]}, {"x": [0.5] * 4, "n": [6]}]
    for kind in (2, 3):
        request = infer_request(examples_log(kind, examples), "m", GRAPH, None, "record 0")
        assert request.inputs["x"].tolist() == [[1, 2, 3, 4], [0.5] * 4]
        assert request.inputs["n"].tolist() == [5, 6] and request.inputs["n"].dtype == np.int64


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (field(5, b""), "record 7: session_run_log: layerserve warms up on predict"),
        (field(7, b""), "record 7: predict_streamed_log"),
        (b"", "record 7: no request"),
        (b"\xff\xff\xff", "record 7: not a tensorflow.serving.PredictionLog"),
        (predict_log({"x": np.ones((1, 4), np.float32)}, (), "other"), 'record 7: signature "other" not found'),
    ],
)
def test_logs_layerserve_cannot_run_are_refused_naming_the_record(record: bytes, message: str) -> None:
    with pytest.raises(BadRequestError, match=message):
        infer_request(record, "m", GRAPH, None, "record 7")
