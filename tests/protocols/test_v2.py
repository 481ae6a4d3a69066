"""V2 request parsing and response encoding, JSON and binary, for every datatype."""

from __future__ import annotations

import struct

import numpy as np
import orjson
import pytest

from layerserve.errors import BadRequestError
from layerserve.lifecycle.model import Signature
from layerserve.messages import InferRequest, InferResponse
from layerserve.protocols.v2 import encode_infer_response, parse_infer_request
from layerserve.serving.layers import LayerGraph
from layerserve.serving.request_checks import RequestChecks
from layerserve.tensors import DATATYPE_TO_DTYPE, TensorSpec

NUMERIC = [name for name in DATATYPE_TO_DTYPE if name != "BYTES"]


def _signature(datatype: str) -> LayerGraph:
    return LayerGraph(Signature((TensorSpec("t", datatype, (-1, 3)),), (TensorSpec("t", datatype, (-1, 3)),)))


def _checked(body: bytes, header_length: str | None, graph: LayerGraph) -> InferRequest:
    """Parse as the route does, then check as the data plane does."""
    checks = RequestChecks(graph)
    request = parse_infer_request(body, header_length, "m", 1, checks.declared)
    checks.inputs(request.inputs, request.base64_inputs)
    checks.outputs(request.requested)
    return request


def _sample(datatype: str) -> np.ndarray:
    if datatype == "BYTES":
        return np.array([[b"a", "é".encode(), b""], [b"xyz", b"1", b"2"]], dtype=object)
    if datatype == "BOOL":
        return np.array([[True, False, True], [False, False, True]])
    return np.arange(6).reshape(2, 3).astype(DATATYPE_TO_DTYPE[datatype])


def _bytes_payload(array: np.ndarray) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in array.reshape(-1))


@pytest.mark.parametrize("datatype", list(DATATYPE_TO_DTYPE))
def test_json_round_trip(datatype: str) -> None:
    array = _sample(datatype)
    data = [e.decode() for e in array.reshape(-1)] if datatype == "BYTES" else array.tolist()
    body = orjson.dumps({"inputs": [{"name": "t", "shape": [2, 3], "datatype": datatype, "data": data}]})
    parsed = _checked(body, None, _signature(datatype))
    np.testing.assert_array_equal(parsed.inputs["t"], array)
    content, header_length = encode_infer_response(parsed, InferResponse("m", 1, {"t": parsed.inputs["t"]}))
    assert header_length is None
    (output,) = orjson.loads(content)["outputs"]
    assert output["datatype"] == datatype and output["shape"] == [2, 3]
    assert output["data"] == (data if datatype == "BYTES" else array.reshape(-1).tolist())


@pytest.mark.parametrize("datatype", list(DATATYPE_TO_DTYPE))
def test_binary_round_trip(datatype: str) -> None:
    array = _sample(datatype)
    raw = _bytes_payload(array) if datatype == "BYTES" else array.astype(array.dtype.newbyteorder("<")).tobytes()
    header = orjson.dumps(
        {
            "inputs": [
                {"name": "t", "shape": [2, 3], "datatype": datatype, "parameters": {"binary_data_size": len(raw)}}
            ],
            "parameters": {"binary_data_output": True},
        }
    )
    parsed = _checked(header + raw, str(len(header)), _signature(datatype))
    np.testing.assert_array_equal(parsed.inputs["t"], array)
    content, header_length = encode_infer_response(parsed, InferResponse("m", 1, {"t": parsed.inputs["t"]}))
    assert header_length is not None
    assert content[header_length:] == raw
    assert orjson.loads(content[:header_length])["outputs"][0]["parameters"] == {"binary_data_size": len(raw)}


def test_errors_name_the_problem() -> None:
    signature = _signature("FP32")

    def parse(body: object, header: str | None = None, tail: bytes = b"") -> None:
        _checked(orjson.dumps(body) + tail, header, signature)

    good = {"name": "t", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}
    with pytest.raises(BadRequestError, match="given twice"):
        parse({"inputs": [good, good]})
    with pytest.raises(BadRequestError, match="unknown datatype 'FLOAT'"):
        parse({"inputs": [{**good, "datatype": "FLOAT"}]})
    with pytest.raises(BadRequestError, match="must be a JSON object"):
        parse([1, 2])
    with pytest.raises(BadRequestError, match="output names must be unique"):
        parse({"inputs": [good], "outputs": [{"name": "t"}, {"name": "t"}]})
    with pytest.raises(BadRequestError, match="non-negative integer"):
        parse({"inputs": [good]}, "-4")
    bytes_signature = _signature("BYTES")
    header = orjson.dumps(
        {"inputs": [{"name": "t", "shape": [1, 3], "datatype": "BYTES", "parameters": {"binary_data_size": 8}}]}
    )
    with pytest.raises(BadRequestError, match="runs past the end"):
        _checked(header + struct.pack("<I", 99) + b"abcd", str(len(header)), bytes_signature)
    with pytest.raises(BadRequestError, match="runs past the binary data"):
        _checked(header + b"abc", str(len(header)), bytes_signature)
