"""V2 request parsing and response encoding, JSON and binary, for every datatype."""

from __future__ import annotations

import struct

import numpy as np
import orjson
import pytest

from layerserve.errors import BadRequestError
from layerserve.lifecycle.model import Signature
from layerserve.messages import InferRequest, InferResponse
from layerserve.protocols.v2 import HeaderTemplates, encode_infer_response, parse_infer_request
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
    checks.outputs(tuple(o.name for o in request.requested))
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
    with pytest.raises(BadRequestError, match="parameter cache must be true or false, got 'no'"):
        parse({"inputs": [good], "parameters": {"cache": "no"}})
    with pytest.raises(BadRequestError, match="parameter binary_data_output must be true or false, got 0"):
        parse({"inputs": [good], "parameters": {"binary_data_output": 0}})
    with pytest.raises(BadRequestError, match="output 't': parameter binary_data must be true or false, got 'false'"):
        parse({"inputs": [good], "outputs": [{"name": "t", "parameters": {"binary_data": "false"}}]})
    bytes_signature = _signature("BYTES")
    header = orjson.dumps(
        {"inputs": [{"name": "t", "shape": [1, 3], "datatype": "BYTES", "parameters": {"binary_data_size": 8}}]}
    )
    with pytest.raises(BadRequestError, match="runs past the end"):
        _checked(header + struct.pack("<I", 99) + b"abcd", str(len(header)), bytes_signature)
    with pytest.raises(BadRequestError, match="runs past the binary data"):
        _checked(header + b"abc", str(len(header)), bytes_signature)


def _binary_request(x: np.ndarray, extra: dict[str, object] | None = None) -> tuple[bytes, str]:
    tensor = {"name": "x", "shape": list(x.shape), "datatype": "FP32", "parameters": {"binary_data_size": x.nbytes}}
    header = orjson.dumps({"inputs": [tensor], "outputs": [{"name": "y", "parameters": {"classification": 2}}],
                           "parameters": {"timeout_ms": 50, "cache": False}, **(extra or {})})  # fmt: skip
    return header + x.tobytes(), str(len(header))


class _CountingCheck:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, name: str, datatype: str, shape: tuple[int, ...]) -> None:
        self.calls += 1


def test_a_header_seen_before_is_parsed_once_and_gives_the_same_request() -> None:
    templates, check = HeaderTemplates(), _CountingCheck()
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng.normal(size=(2, 4)).astype(np.float32)
        body, length = _binary_request(x)
        parsed = templates.parse(body, length, "m", 2, check)
        reference = parse_infer_request(body, length, "m", 2)
        np.testing.assert_array_equal(parsed.inputs["x"], x)
        assert parsed.inputs["x"].dtype == np.float32 and parsed.inputs["x"].shape == (2, 4)
        assert (parsed.model, parsed.version, parsed.requested, parsed.timeout_ms, parsed.use_cache) == (
            reference.model, reference.version, reference.requested, reference.timeout_ms, reference.use_cache
        )  # fmt: skip
    assert check.calls == 1  # the header was parsed and checked by the first request only


def test_binary_inputs_are_views_of_the_body_not_copies() -> None:
    # A 600 KB image tensor copied out of its body cost about 0.1 ms of a request at concurrency 1.
    x = np.arange(4 * 224 * 3, dtype=np.float32).reshape(4, 224, 3)
    body, length = _binary_request(x)
    whole = np.frombuffer(body, np.uint8)
    templates = HeaderTemplates()
    # Parsed in full, then in full and kept as a template, then from the template.
    for parsed in (
        parse_infer_request(body, length),
        templates.parse(body, length, "m", 1, _CountingCheck()),
        templates.parse(body, length, "m", 1, _CountingCheck()),
    ):
        np.testing.assert_array_equal(parsed.inputs["x"], x)
        assert np.shares_memory(parsed.inputs["x"], whole) and not parsed.inputs["x"].flags.writeable


def test_another_version_a_short_body_an_id_or_json_data_are_parsed_in_full() -> None:
    templates, check = HeaderTemplates(), _CountingCheck()
    x = np.ones((1, 4), np.float32)
    body, length = _binary_request(x)
    templates.parse(body, length, "m", 1, check)
    HeaderTemplates().parse(body, length, "m", 1, check)  # another version has templates of its own: its own checks
    assert check.calls == 2
    with pytest.raises(BadRequestError, match="binary_data_size 16 runs past the binary data"):
        templates.parse(body[:-4], length, "m", 1, check)  # the same header, data missing: the parse's error
    with_id, id_length = _binary_request(x, {"id": "r1"})
    templates.parse(with_id, id_length, "m", 1, check)
    templates.parse(with_id, id_length, "m", 1, check)
    json_data = orjson.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]})
    for value in (1, 2):  # a header that is the whole body: never a binary template, each request its own data
        body = json_data.replace(b"[1,2,3,4]", f"[{value},2,3,4]".encode())
        assert templates.parse(body, str(len(body)), "m", 1, check).inputs["x"][0, 0] == value
    assert check.calls == 2 + 1 + 2 + 2


def test_templates_are_bounded() -> None:
    templates, check = HeaderTemplates(size=2), _CountingCheck()
    bodies = [_binary_request(np.zeros((rows, 4), np.float32)) for rows in (1, 2, 3)]
    for body, length in bodies:
        templates.parse(body, length, "m", 1, check)
    templates.parse(*bodies[0], "m", 1, check)  # the oldest was dropped: parsed again
    templates.parse(*bodies[2], "m", 1, check)  # still kept
    assert check.calls == 4


def _json_request(data: object, datatype: str = "INT32", shape: list[int] | None = None, **extra: object) -> bytes:
    """A V2 JSON request as tritonclient writes it (json.dumps: a space after each comma and colon)."""
    import json

    tensor = {"name": "x", "shape": shape or [1, 4], "datatype": datatype, "data": data}
    return json.dumps(
        {"inputs": [tensor], "outputs": [{"name": "y"}], "parameters": {"timeout_ms": 50}, **extra}
    ).encode()


@pytest.mark.parametrize(
    ("datatype", "rows"),
    [("INT32", [[3, -7, 0, 2**31 - 1], [5, 6, 7, 8]]), ("UINT64", [[0, 2**64 - 1, 1, 2], [4, 3, 2, 1]]),
     ("FP32", [[1.5, -2e-3, 7, 1E+2], [0.1, 0.2, -0.0, 3]]), ("FP16", [[1, 2.5, 3, 4], [5, 6, 7, 8.25]])],
)  # fmt: skip
def test_a_json_request_seen_before_reads_only_its_data_and_gives_the_same_request(
    datatype: str, rows: list[list[float]]
) -> None:
    templates, check = HeaderTemplates(), _CountingCheck()
    for values in rows:
        body = _json_request(values, datatype)
        parsed = templates.parse(body, None, "m", 2, check)
        reference = parse_infer_request(body, None, "m", 2)
        np.testing.assert_array_equal(parsed.inputs["x"], reference.inputs["x"])
        assert parsed.inputs["x"].dtype == reference.inputs["x"].dtype and parsed.inputs["x"].shape == (1, 4)
        assert (parsed.model, parsed.version, parsed.requested, parsed.timeout_ms, parsed.id) == (
            "m", 2, reference.requested, 50, None
        )  # fmt: skip
    assert check.calls == 1  # the second request was read from the first's template


@pytest.mark.parametrize(
    ("data", "error"),
    [("[1.5, 2, 3, 4]", "expected integers for INT32, got floating-point numbers"),
     ("[1, 2, 3, 2147483648]", "values out of range for INT32"),
     ("[1, 2, 3]", r"shape \[1, 4\] needs 4 elements, data has 3"),
     ('[1, 2, 3, "4"]', "expected integers for INT32, got strings"),
     ("[1, 2, 3, true]", "expected integers for INT32, got true/false among them"),
     ("[1, 2, 3, 4,]", "not valid JSON"),
     ("[1, 2, 3, -]", "not valid JSON"),
     ("[1e2, 2, 3, 4]", "expected integers for INT32, got floating-point numbers")],
)  # fmt: skip
def test_json_data_a_template_cannot_read_gets_the_full_parse_and_its_error(data: str, error: str) -> None:
    templates, check = HeaderTemplates(), _CountingCheck()
    templates.parse(_json_request([1, 2, 3, 4]), None, "m", 1, check)
    with pytest.raises(BadRequestError, match=error):
        templates.parse(_json_request([9, 9, 9, 9]).replace(b"[9, 9, 9, 9]", data.encode()), None, "m", 1, check)
    calls = check.calls
    again = templates.parse(_json_request([4, 3, 2, 1]), None, "m", 1, check)
    assert again.inputs["x"].tolist() == [[4, 3, 2, 1]]
    assert check.calls == calls  # the template is still kept: a good request after the bad one reads it


def test_json_requests_that_cannot_be_templates_are_parsed_in_full() -> None:
    templates, check = HeaderTemplates(), _CountingCheck()
    nested = _json_request([[1, 2], [3, 4]], shape=[2, 2])
    with_id = _json_request([1, 2, 3, 4], id="r1")
    two_inputs = orjson.dumps({"inputs": [{"name": n, "shape": [1], "datatype": "INT32", "data": [1]} for n in "ab"]})
    texts = _json_request(["a", "b", "c", "d"], "BYTES")
    # The key is written with an escape; the word "data" before a flat list is an output parameter's.
    lookalike = (
        b'{"inputs":[{"name":"x","shape":[1,4],"datatype":"INT32","\\u0064ata":[1,2,3,4]}],'
        b'"outputs":[{"name":"y","parameters":{"data":[7,8,9,10]}}]}'
    )
    for body in (nested, with_id, two_inputs, texts, lookalike):
        for _ in range(2):
            templates.parse(body, None, "m", 1, check)
    assert check.calls == 2 * (1 + 1 + 2 + 1 + 1)
    changed = lookalike.replace(b"[1,2,3,4]", b"[5,6,7,8]")
    assert templates.parse(changed, None, "m", 1, check).inputs["x"].tolist() == [[5, 6, 7, 8]]
    assert templates.parse(nested, None, "m", 1, check).inputs["x"].tolist() == [[1, 2], [3, 4]]
    HeaderTemplates().parse(_json_request([1, 2, 3, 4]), None, "m", 1, check)
    HeaderTemplates().parse(_json_request([1, 2, 3, 4]), None, "m", 1, check)  # each version: its own checks
    assert check.calls == 12 + 2 + 2


@pytest.mark.parametrize("body", [b"", b" \r\n"])
def test_an_empty_body_is_named_empty(body: bytes) -> None:
    # orjson's own message for it was "Input is a zero-length, empty document".
    with pytest.raises(BadRequestError, match=r"^the request body is empty: expected a JSON object$"):
        parse_infer_request(body, None, "m", 1)
