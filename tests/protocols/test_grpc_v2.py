"""Triton's gRPC messages <-> arrays: raw and typed contents, BYTES, parameters, and the REST door's checks."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from layerserve.dataplane import answer_outputs
from layerserve.errors import BadRequestError, PayloadTooLargeError
from layerserve.lifecycle.model import Signature
from layerserve.messages import InferRequest, InferResponse
from layerserve.protocols import grpc_v2
from layerserve.serving.layers import LayerGraph
from layerserve.serving.request_checks import RequestChecks
from layerserve.tensors import TensorSpec

GRAPH = LayerGraph(
    Signature(
        (TensorSpec("a", "INT8", (-1, 2)), TensorSpec("b", "FP32", (-1, 2))),
        (TensorSpec("out", "FP32", (-1, 3)),),
    )
)
TEXTS = LayerGraph(Signature((TensorSpec("tokens", "INT32", (-1, 4)),), (TensorSpec("out", "FP32", (-1, 2)),)))


def _checked(request: service_pb2.ModelInferRequest, graph: LayerGraph) -> InferRequest:
    """Parse as the servicer does, then check as the data plane does."""
    checks = RequestChecks(graph, "tokens" if graph is TEXTS else None)
    parsed = grpc_v2.parse_model_infer(request, checks.declared)
    checks.inputs(parsed.inputs, parsed.base64_inputs)
    checks.outputs(tuple(o.name for o in parsed.requested))
    return parsed


def _request(**fields: object) -> service_pb2.ModelInferRequest:
    return service_pb2.ModelInferRequest(model_name="m", **fields)  # type: ignore[arg-type]


def test_raw_and_typed_contents_decode_to_the_same_arrays() -> None:
    a, b = np.array([[1, -2], [3, 4]], np.int8), np.array([[0.5, 1.5], [2.5, 3.5]], np.float32)
    raw = _request(raw_input_contents=[a.tobytes(), b.tobytes()])
    raw.inputs.add(name="a", datatype="INT8", shape=[2, 2])
    raw.inputs.add(name="b", datatype="FP32", shape=[2, 2])
    typed = _request(id="r")
    typed.inputs.add(name="a", datatype="INT8", shape=[2, 2]).contents.int_contents.extend(a.ravel().tolist())
    typed.inputs.add(name="b", datatype="FP32", shape=[2, 2]).contents.fp32_contents.extend(b.ravel().tolist())
    for request in (raw, typed):
        parsed = _checked(request, GRAPH)
        np.testing.assert_array_equal(parsed.inputs["a"], a)
        np.testing.assert_array_equal(parsed.inputs["b"], b)
        assert parsed.inputs["a"].dtype == np.int8 and parsed.inputs["b"].dtype == np.float32
    assert _checked(typed, GRAPH).id == "r"


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda r: r.inputs.add(name="a", datatype="INT8", shape=[1, 2]).contents.int_contents.extend([1, 300]),
            "out of the range of INT8",
        ),
        (
            lambda r: r.inputs.add(name="a", datatype="INT8", shape=[1, 2]).contents.int_contents.extend([1]),
            "holds 1 elements, shape [1, 2] has 2",
        ),
        (lambda r: r.inputs.add(name="a", datatype="FP32", shape=[1, 2]), "expected datatype INT8, got FP32"),
        (lambda r: r.inputs.add(name="a", datatype="INT8", shape=[1, 3]), "expected shape [-1, 2], got [1, 3]"),
        (lambda r: r.inputs.add(name="zz", datatype="INT8", shape=[1, 2]), "unknown input 'zz'"),
        (lambda r: r.inputs.add(name="a", datatype="NOPE", shape=[1, 2]), "unknown datatype 'NOPE'"),
        (
            lambda r: r.inputs.add(name="b", datatype="FP32", shape=[1, 2]).contents.fp32_contents.extend([1, 2]),
            "missing input(s): a",
        ),
    ],
)
def test_bad_inputs_get_the_rest_door_s_messages(build: object, message: str) -> None:
    request = _request()
    build(request)  # type: ignore[operator]
    with pytest.raises(BadRequestError, match=re.escape(message)):
        _checked(request, GRAPH)


def test_raw_contents_must_cover_every_input_and_match_sizes() -> None:
    request = _request(raw_input_contents=[b"\x00\x01"])
    request.inputs.add(name="a", datatype="INT8", shape=[1, 2])
    request.inputs.add(name="b", datatype="FP32", shape=[1, 2])
    with pytest.raises(BadRequestError, match="raw_input_contents holds 1 tensors for 2 inputs"):
        _checked(request, GRAPH)
    short = _request(raw_input_contents=[b"\x00"])
    short.inputs.add(name="a", datatype="INT8", shape=[1, 2])
    with pytest.raises(BadRequestError, match="does not match shape"):
        _checked(short, GRAPH)


def test_bytes_texts_parameters_and_outputs() -> None:
    texts = [b"hello", "h\u00e9".encode()]
    request = _request(raw_input_contents=[b"".join(len(t).to_bytes(4, "little") + t for t in texts)])
    request.inputs.add(name="tokens", datatype="BYTES", shape=[2])
    request.outputs.add(name="out").parameters["classification"].int64_param = 1
    request.parameters["timeout"].int64_param = 2_500_000  # Triton's microseconds
    request.parameters["cache"].bool_param = False
    request.outputs[0].parameters["binary_data"].string_param = "no"  # every gRPC output is raw bytes: ignored
    parsed = _checked(request, TEXTS)
    assert list(parsed.inputs["tokens"]) == texts
    assert parsed.timeout_ms == 2500 and parsed.use_cache is False
    request.parameters["cache"].string_param = "false"
    with pytest.raises(BadRequestError, match="parameter cache must be true or false, got 'false'"):
        _checked(request, TEXTS)
    request.parameters["cache"].bool_param = False
    assert parsed.requested[0].name == "out" and parsed.requested[0].classification == 1
    assert parsed.requested[0].binary is None
    request.parameters["timeout_ms"].int64_param = 40
    assert _checked(request, TEXTS).timeout_ms == 40
    request.inputs[0].parameters["shared_memory_region"].string_param = "r"
    with pytest.raises(BadRequestError, match="shared memory"):
        _checked(request, TEXTS)


def test_answers_in_requested_order_with_classification_and_a_size_limit() -> None:
    request = _request(raw_input_contents=[np.zeros((1, 2), np.int8).tobytes(), np.zeros((1, 2), "<f4").tobytes()])
    request.inputs.add(name="a", datatype="INT8", shape=[1, 2])
    request.inputs.add(name="b", datatype="FP32", shape=[1, 2])
    request.outputs.add(name="b")
    request.outputs.add(name="out").parameters["classification"].int64_param = 2
    parsed = _checked(request, GRAPH)
    scores = np.array([[0.1, 0.7, 0.2]], np.float32)
    outputs = {"out": scores, "b": np.array([[1.0, 2.0]], np.float32)}
    answer = grpc_v2.encode_model_infer(
        InferResponse("m", 3, answer_outputs(parsed.requested, outputs, ["x", "y", "z"], "out"))
    )
    assert answer.model_version == "3" and [o.name for o in answer.outputs] == ["b", "out"]
    assert [o.datatype for o in answer.outputs] == ["FP32", "BYTES"] and list(answer.outputs[1].shape) == [1, 2]
    np.testing.assert_array_equal(np.frombuffer(answer.raw_output_contents[0], "<f4"), [1.0, 2.0])
    first = answer.raw_output_contents[1]
    size = int.from_bytes(first[:4], "little")
    assert first[4 : 4 + size].decode() == "0.700000:1:y"
    with pytest.raises(PayloadTooLargeError, match="over the message size limit of 8 bytes"):
        grpc_v2.encode_model_infer(InferResponse("m", 3, outputs), max_bytes=8)


def _raw_request(a: np.ndarray, b: np.ndarray, **fields: object) -> tuple[service_pb2.ModelInferRequest, bytes]:
    request = _request(
        model_version="1",
        inputs=[
            service_pb2.ModelInferRequest.InferInputTensor(name="a", datatype="INT8", shape=list(a.shape)),
            service_pb2.ModelInferRequest.InferInputTensor(name="b", datatype="FP32", shape=list(b.shape)),
        ],
        outputs=[service_pb2.ModelInferRequest.InferRequestedOutputTensor(name="out")],
        raw_input_contents=[a.tobytes(), b.tobytes()],
        **fields,
    )
    request.parameters["timeout_ms"].int64_param = 50
    return request, request.SerializeToString()


def test_a_message_seen_before_skips_the_parse_and_gives_the_same_request() -> None:
    templates = grpc_v2.InferTemplates()
    rng = np.random.default_rng(0)
    found = []
    for _ in range(3):
        a, b = rng.integers(-5, 5, size=(2, 2)).astype(np.int8), rng.normal(size=(2, 2)).astype(np.float32)
        request, message = _raw_request(a, b)
        layout = grpc_v2.read_layout(message)
        assert layout is not None and (layout.model, layout.version) == ("m", "1")
        parsed = templates.apply(message, layout)
        found.append(parsed is not None)
        if parsed is None:
            templates.keep(message, request, _checked(request, GRAPH))
            continue
        reference = _checked(request, GRAPH)
        assert dataclasses.replace(reference, inputs=parsed.inputs) == parsed
        for name, array in (("a", a), ("b", b)):
            np.testing.assert_array_equal(parsed.inputs[name], array)
            assert parsed.inputs[name].dtype == array.dtype and parsed.inputs[name].shape == array.shape
    assert found == [False, True, True]


def _applied(templates: grpc_v2.InferTemplates, message: bytes) -> object:
    layout = grpc_v2.read_layout(message)
    return None if layout is None else templates.apply(message, layout)


def test_messages_that_cannot_be_templates_are_parsed_in_full() -> None:
    templates = grpc_v2.InferTemplates()
    a, b = np.zeros((1, 2), np.int8), np.zeros((1, 2), np.float32)
    with_id, message = _raw_request(a, b, id="r1")
    templates.keep(message, with_id, _checked(with_id, GRAPH))
    assert _applied(templates, message) is None  # an id: the answer carries it, so each request is parsed
    contents = service_pb2.InferTensorContents(int_contents=[1] * 4)
    tensor = service_pb2.ModelInferRequest.InferInputTensor(name="tokens", datatype="INT32", shape=[1, 4])
    tensor.contents.CopyFrom(contents)
    typed = _request(inputs=[tensor])
    templates.keep(typed.SerializeToString(), typed, _checked(typed, TEXTS))
    assert _applied(templates, typed.SerializeToString()) is None  # typed contents
    request, message = _raw_request(a, b)
    templates.keep(message, request, _checked(request, GRAPH))
    assert _applied(templates, message) is not None
    # The same leading fields with raw contents of other sizes: no request from the template.
    request.raw_input_contents[1] = np.zeros(3, np.float32).tobytes()
    assert _applied(templates, request.SerializeToString()) is None
    # A field after the raw contents, or a truncated message: no layout, parsed in full.
    assert grpc_v2.read_layout(message + b"\x0a\x01m") is None and grpc_v2.read_layout(message[:-1]) is None
