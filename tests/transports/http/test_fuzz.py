"""Fuzzing: schemathesis over every route of /openapi.json, with every check, against a live server of one worker
and one of two (no 5xx but 503; a third of the JSON bodies gzip-compressed), and hypothesis round trips of the
V2 tensor codecs, JSON and binary, for every datatype and random shapes."""

from __future__ import annotations

import gzip
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from schemathesis.checks import CHECKS, load_all_checks, not_a_server_error, positive_data_acceptance
from starlette.routing import Route

from layerserve.lifecycle.model import Signature
from layerserve.messages import InferResponse
from layerserve.protocols.v2 import encode_infer_response, parse_infer_request
from layerserve.serving.layers import LayerGraph
from layerserve.serving.request_checks import RequestChecks
from layerserve.settings import Settings
from layerserve.tensors import DATATYPE_TO_DTYPE, TensorSpec
from layerserve.transports.http.openapi import document
from tests.live_server import free_port, server_log, start_server, start_server_process, wait_process_ready
from tests.models import build_mlp, save_model

SCHEMA = schemathesis.openapi.from_dict(document())


@pytest.fixture(scope="module", params=["one worker", "two workers"])
def fuzz_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server of its own (fuzzed management routes must not disturb the other tests' repository): one worker
    in this process, or `serve --workers 2` in a subprocess."""
    root = tmp_path_factory.mktemp("fuzz")
    save_model(build_mlp(1), root / "repo" / "mlp" / "1", "model.keras")
    if request.param == "one worker":
        live = start_server(
            Settings(model_repository=root / "repo", engine_cache_dir=root / "cache", reload_interval_s=0)
        )
        yield live.url
        live.stop()
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_server_process(root / "repo", root / "cache", port, "--workers", "2", "--reload-interval-s", "0")
    try:
        wait_process_ready(url, process, server_log(root / "repo"))
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0


# Every check schemathesis has, but two that do not fit a model server, replaced by what does:
# - positive_data_acceptance: a body the document allows can still not fit the model's signature (an input
#   name or shape the model does not have): a 400 naming it is the right answer.
# - not_a_server_error: a 503 (no version to serve, a full queue) is a designed answer; any other 5xx is a bug.
load_all_checks()
CHECKS_IN_FORCE = [check for check in CHECKS.get_all() if check not in (positive_data_acceptance, not_a_server_error)]


def _send_gzipped(case: Any, url: str) -> httpx.Response:
    """The case's JSON body sent gzip-compressed (`Content-Encoding: gzip`)."""
    kwargs = case.as_transport_kwargs(base_url=url)
    headers = {**kwargs.get("headers", {}), "Content-Type": "application/json", "Content-Encoding": "gzip"}
    body = gzip.compress(json.dumps(kwargs["json"]).encode())
    return httpx.request(kwargs["method"], kwargs["url"], params=kwargs.get("params"), headers=headers, content=body)


def test_openapi_lists_every_route(fuzz_url: str) -> None:
    from layerserve.server import Server

    documented = set(document()["paths"])
    app = Server(Settings(model_repository=Path("/nonexistent"))).app
    routes = {route.path for route in app.routes if isinstance(route, Route)}
    assert routes == documented
    served = httpx.get(f"{fuzz_url}/openapi.json").json()
    assert served["openapi"].startswith("3.") and set(served["paths"]) == documented
    assert "swagger-ui" in httpx.get(f"{fuzz_url}/docs").text


@SCHEMA.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case: Any, fuzz_url: str) -> None:
    parameters = case.path_parameters or {}
    # Half the cases aim at the real model (and version), so that the fuzzed bodies reach its parsers.
    if len(str(parameters.get("model", ""))) % 2 == 0 and "model" in parameters:
        parameters["model"] = "mlp"
        if "version" in parameters and len(str(parameters["version"])) % 2 == 0:
            parameters["version"] = "1"
    # A third of the JSON bodies come gzip-compressed; the others go through every check.
    is_json = case.media_type == "application/json" and isinstance(case.body, (dict, list))
    if is_json and len(json.dumps(case.body)) % 3 == 0:
        response = _send_gzipped(case, fuzz_url)
        case.validate_response(response, checks=CHECKS_IN_FORCE)
    else:
        response = case.call_and_validate(base_url=fuzz_url, timeout=60, checks=CHECKS_IN_FORCE)
    status = response.status_code
    assert status < 500 or status == 503, f"{case.method} {case.formatted_path} -> {status}: {response.text[:500]}"
    if status >= 400:
        assert "error" in response.json(), response.text[:500]


# --- Codec round trips ----------------------------------------------------------------------------------

# A batch of at least one row (the server's rule), then up to 3 dimensions that may be empty.
_SHAPES = st.tuples(st.integers(1, 5), st.lists(st.integers(0, 5), max_size=3)).map(lambda t: (t[0], *t[1]))


def _graph(datatype: str, shape: tuple[int, ...]) -> LayerGraph:
    spec = TensorSpec("t", datatype, (-1, *shape[1:]))
    return LayerGraph(Signature((spec,), (spec,)))


def _arrays(datatype: str) -> st.SearchStrategy[np.ndarray]:
    if datatype == "BYTES":
        return _SHAPES.flatmap(
            lambda shape: st.lists(st.binary(max_size=8), min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))
            .map(lambda items, shape=shape: np.array([*items, b""], dtype=object)[:-1].reshape(shape))
        )  # fmt: skip
    dtype = DATATYPE_TO_DTYPE[datatype]
    elements = hnp.from_dtype(dtype, allow_nan=False, allow_infinity=False) if dtype.kind == "f" else None
    return hnp.arrays(dtype, _SHAPES, elements=elements)


def _round_trip(array: np.ndarray, datatype: str, binary: bool) -> np.ndarray:
    graph = _graph(datatype, array.shape)
    shape = list(array.shape)
    if binary:
        from layerserve.protocols.v2 import encode_bytes_elements

        raw = (
            encode_bytes_elements(array)
            if datatype == "BYTES"
            else array.astype(array.dtype.newbyteorder("<")).tobytes()
        )
        header = orjson.dumps({"inputs": [{"name": "t", "shape": shape, "datatype": datatype,
                                           "parameters": {"binary_data_size": len(raw)}}]})  # fmt: skip
        request = parse_infer_request(header + raw, str(len(header)), "m")
    else:
        data = [e.decode("utf-8") for e in array.reshape(-1)] if datatype == "BYTES" else array.reshape(-1).tolist()
        body = orjson.dumps({"inputs": [{"name": "t", "shape": shape, "datatype": datatype, "data": data}]})
        request = parse_infer_request(body, None, "m")
    decoded = RequestChecks(graph).inputs(request.inputs, request.base64_inputs)["t"]
    body, header_length = encode_infer_response(request, InferResponse("m", 1, {"t": decoded}))
    answer = json.loads(body[: header_length or len(body)])
    assert answer["outputs"][0]["shape"] == shape and answer["outputs"][0]["datatype"] == datatype
    return decoded


@pytest.mark.parametrize("datatype", [d for d in DATATYPE_TO_DTYPE if d != "BYTES"])
@pytest.mark.parametrize("binary", [False, True])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_numeric_round_trips(datatype: str, binary: bool, data: st.DataObject) -> None:
    array = data.draw(_arrays(datatype))
    decoded = _round_trip(array, datatype, binary)
    assert decoded.dtype == array.dtype and decoded.shape == array.shape
    np.testing.assert_array_equal(decoded, array)


@pytest.mark.parametrize("binary", [False, True])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_bytes_round_trips(binary: bool, data: st.DataObject) -> None:
    array = data.draw(_arrays("BYTES"))
    if not binary:  # JSON carries text: strings of code points, here one per byte
        array = (
            np.vectorize(lambda b: b.decode("latin-1").encode("utf-8"), otypes=[object])(array) if array.size else array
        )
    decoded = _round_trip(array, "BYTES", binary)
    assert decoded.shape == array.shape
    assert [bytes(e) for e in decoded.reshape(-1)] == [bytes(e) for e in array.reshape(-1)]
