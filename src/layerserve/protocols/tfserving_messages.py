"""The TF Serving messages a warm-up file holds (PredictionLog and what it carries), declared here field for field as
in tensorflow_serving/apis/*.proto and tensorflow/core/{framework,example}/*.proto.

Built in a descriptor pool of their own: the serving process imports no TensorFlow (whose protos these are), and a
process that does (the tests, the preparer) keeps TensorFlow's own `tensorflow.TensorProto` in the default pool
without a clash. The wire format is all that matters: field numbers and types are TensorFlow's; a DataType is read
as its number, and messages layerserve never reads (a session run's, a response) as empty messages.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_Field = descriptor_pb2.FieldDescriptorProto
_PACKAGE = "layerserve.tfserving"

# name -> [(field, number, type or message name, is_repeated, oneof index or None)]
_MESSAGES: dict[str, list[tuple[str, int, int | str, bool, int | None]]] = {
    "TensorShapeProto.Dim": [("size", 1, _Field.TYPE_INT64, False, None), ("name", 2, _Field.TYPE_STRING, False, None)],
    "TensorShapeProto": [
        ("dim", 2, "TensorShapeProto.Dim", True, None),
        ("unknown_rank", 3, _Field.TYPE_BOOL, False, None),
    ],
    "TensorProto": [
        ("dtype", 1, _Field.TYPE_INT32, False, None),
        ("tensor_shape", 2, "TensorShapeProto", False, None),
        ("version_number", 3, _Field.TYPE_INT32, False, None),
        ("tensor_content", 4, _Field.TYPE_BYTES, False, None),
        ("float_val", 5, _Field.TYPE_FLOAT, True, None),
        ("double_val", 6, _Field.TYPE_DOUBLE, True, None),
        ("int_val", 7, _Field.TYPE_INT32, True, None),
        ("string_val", 8, _Field.TYPE_BYTES, True, None),
        ("scomplex_val", 9, _Field.TYPE_FLOAT, True, None),
        ("int64_val", 10, _Field.TYPE_INT64, True, None),
        ("bool_val", 11, _Field.TYPE_BOOL, True, None),
        ("dcomplex_val", 12, _Field.TYPE_DOUBLE, True, None),
        ("half_val", 13, _Field.TYPE_INT32, True, None),
        ("uint32_val", 16, _Field.TYPE_UINT32, True, None),
        ("uint64_val", 17, _Field.TYPE_UINT64, True, None),
        ("float8_val", 18, _Field.TYPE_BYTES, False, None),
    ],
    "Int64Value": [("value", 1, _Field.TYPE_INT64, False, None)],
    "ModelSpec": [
        ("name", 1, _Field.TYPE_STRING, False, None),
        ("version", 2, "Int64Value", False, None),
        ("signature_name", 3, _Field.TYPE_STRING, False, None),
        ("version_label", 4, _Field.TYPE_STRING, False, None),
    ],
    "PredictRequest.InputsEntry": [
        ("key", 1, _Field.TYPE_STRING, False, None),
        ("value", 2, "TensorProto", False, None),
    ],
    "PredictRequest": [
        ("model_spec", 1, "ModelSpec", False, None),
        ("inputs", 2, "PredictRequest.InputsEntry", True, None),
        ("output_filter", 3, _Field.TYPE_STRING, True, None),
    ],
    "BytesList": [("value", 1, _Field.TYPE_BYTES, True, None)],
    "FloatList": [("value", 1, _Field.TYPE_FLOAT, True, None)],
    "Int64List": [("value", 1, _Field.TYPE_INT64, True, None)],
    "Feature": [
        ("bytes_list", 1, "BytesList", False, 0),
        ("float_list", 2, "FloatList", False, 0),
        ("int64_list", 3, "Int64List", False, 0),
    ],
    "Features.FeatureEntry": [("key", 1, _Field.TYPE_STRING, False, None), ("value", 2, "Feature", False, None)],
    "Features": [("feature", 1, "Features.FeatureEntry", True, None)],
    "Example": [("features", 1, "Features", False, None)],
    "ExampleList": [("examples", 1, "Example", True, None)],
    "ExampleListWithContext": [("examples", 1, "Example", True, None), ("context", 2, "Example", False, None)],
    "Input": [
        ("example_list", 1, "ExampleList", False, 0),
        ("example_list_with_context", 2, "ExampleListWithContext", False, 0),
    ],
    "ClassificationRequest": [("model_spec", 1, "ModelSpec", False, None), ("input", 2, "Input", False, None)],
    "RegressionRequest": [("model_spec", 1, "ModelSpec", False, None), ("input", 2, "Input", False, None)],
    "InferenceTask": [("model_spec", 1, "ModelSpec", False, None), ("method_name", 2, _Field.TYPE_STRING, False, None)],
    "MultiInferenceRequest": [("tasks", 1, "InferenceTask", True, None), ("input", 2, "Input", False, None)],
    "ClassifyLog": [("request", 1, "ClassificationRequest", False, None)],
    "RegressLog": [("request", 1, "RegressionRequest", False, None)],
    "PredictLog": [("request", 1, "PredictRequest", False, None)],
    "PredictStreamedLog": [("request", 1, "PredictRequest", True, None)],
    "MultiInferenceLog": [("request", 1, "MultiInferenceRequest", False, None)],
    "SessionRunLog": [],
    "PredictionLog": [
        ("classify_log", 2, "ClassifyLog", False, 0),
        ("regress_log", 3, "RegressLog", False, 0),
        ("multi_inference_log", 4, "MultiInferenceLog", False, 0),
        ("session_run_log", 5, "SessionRunLog", False, 0),
        ("predict_log", 6, "PredictLog", False, 0),
        ("predict_streamed_log", 7, "PredictStreamedLog", False, 0),
    ],
}
_ONEOFS = {"Feature": "kind", "Input": "kind", "PredictionLog": "log_type"}


def _add_fields(message: descriptor_pb2.DescriptorProto, name: str) -> None:
    if name in _ONEOFS:
        message.oneof_decl.add(name=_ONEOFS[name])
    for field_name, number, kind, is_repeated, oneof in _MESSAGES[name]:
        field = message.field.add(name=field_name, number=number)
        field.label = _Field.LABEL_REPEATED if is_repeated else _Field.LABEL_OPTIONAL
        if isinstance(kind, str):
            field.type, field.type_name = _Field.TYPE_MESSAGE, f".{_PACKAGE}.{kind}"
        else:
            field.type = kind
        if oneof is not None:
            field.oneof_index = oneof


def _file() -> descriptor_pb2.FileDescriptorProto:
    """The one file that declares every message above (nested ones inside their parent)."""
    file = descriptor_pb2.FileDescriptorProto(name="layerserve/tfserving_warmup.proto", package=_PACKAGE)
    file.syntax = "proto3"
    for name in _MESSAGES:
        if "." in name:
            continue
        message = file.message_type.add(name=name)
        _add_fields(message, name)
        for nested in (n for n in _MESSAGES if n.startswith(f"{name}.")):
            inner = message.nested_type.add(name=nested.split(".", 1)[1])
            _add_fields(inner, nested)
            if nested.endswith("Entry"):
                inner.options.map_entry = True
    return file


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file())


def message_class(name: str) -> Any:
    """The message class of one of the declared messages (e.g. `PredictionLog`), from the private pool."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{_PACKAGE}.{name}"))


PredictionLog = message_class("PredictionLog")
TensorProto = message_class("TensorProto")
Example = message_class("Example")
