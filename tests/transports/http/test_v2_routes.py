"""The V2 routes against a real server: metadata, readiness, infer (JSON and binary), errors."""

from __future__ import annotations

import struct
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import tensorflow as tf

from tests.live_server import LiveServer
from tests.models import load_reference


def infer(server: LiveServer, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY))


def test_server_metadata_and_health(server: LiveServer) -> None:
    assert httpx.get(f"{server.url}/v2").json()["name"] == "layerserve"
    assert httpx.get(f"{server.url}/v2/health/live").json() == {"live": True}
    assert httpx.get(f"{server.url}/v2/health/ready").json() == {"ready": True}


def test_model_metadata_multi_input_output(server: LiveServer) -> None:
    meta = httpx.get(f"{server.url}/v2/models/multi").json()
    assert meta["inputs"] == [
        {"name": "features", "datatype": "FP32", "shape": [-1, 4]},
        {"name": "tokens", "datatype": "INT32", "shape": [-1, 3]},
    ]
    assert meta["outputs"] == [
        {"name": "regression", "datatype": "FP32", "shape": [-1, 2]},
        {"name": "probs", "datatype": "FP32", "shape": [-1, 5]},
    ]
    assert meta["platform"] == "keras_tensorflow"
    assert meta["engine"] == "onnx", meta["engine_reason"]
    assert "verified" in meta["engine_reason"]


def test_versions_listed_and_addressable(server: LiveServer) -> None:
    meta = httpx.get(f"{server.url}/v2/models/mlp").json()
    assert meta["versions"] == ["1", "2"]
    assert meta["version"] == "2"
    assert httpx.get(f"{server.url}/v2/models/mlp/versions/1").json()["version"] == "1"
    assert httpx.get(f"{server.url}/v2/models/mlp/versions/1/ready").status_code == 200


@pytest.mark.parametrize("version", [1, 2])
def test_infer_json_matches_keras(server: LiveServer, repository: Path, rng: np.random.Generator, version: int) -> None:
    x = rng.normal(size=(5, 10)).astype(np.float32)
    body = {"id": "req-7", "inputs": [{"name": "x", "shape": [5, 10], "datatype": "FP32", "data": x.tolist()}]}
    response = infer(server, f"/v2/models/mlp/versions/{version}/infer", body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["id"] == "req-7"
    assert answer["model_version"] == str(version)
    (output,) = answer["outputs"]
    assert output["name"] == "probs" and output["shape"] == [5, 3] and output["datatype"] == "FP32"
    expected = load_reference(repository, "mlp", version)(x).numpy()
    np.testing.assert_allclose(np.array(output["data"]).reshape(5, 3), expected, atol=1e-4)


def test_infer_without_version_uses_newest(server: LiveServer) -> None:
    body = {"inputs": [{"name": "x", "shape": [1, 10], "datatype": "FP32", "data": [0.0] * 10}]}
    assert infer(server, "/v2/models/mlp/infer", body).json()["model_version"] == "2"


def test_infer_multi_input_output_subset_and_flat_data(
    server: LiveServer, repository: Path, rng: np.random.Generator
) -> None:
    features = rng.normal(size=(3, 4)).astype(np.float32)
    tokens = rng.integers(0, 10, size=(3, 3)).astype(np.int32)
    body = {
        "inputs": [
            {"name": "tokens", "shape": [3, 3], "datatype": "INT32", "data": tokens.reshape(-1).tolist()},
            {"name": "features", "shape": [3, 4], "datatype": "FP32", "data": features.tolist()},
        ],
        "outputs": [{"name": "probs"}],
    }
    answer = infer(server, "/v2/models/multi/infer", body).json()
    assert [o["name"] for o in answer["outputs"]] == ["probs"]
    _, probs = load_reference(repository, "multi", 1)([features, tokens])
    np.testing.assert_allclose(np.array(answer["outputs"][0]["data"]).reshape(3, 5), probs.numpy(), atol=1e-4)


def _binary_body(header: dict[str, object], *tails: bytes) -> tuple[bytes, dict[str, str]]:
    raw = orjson.dumps(header)
    return raw + b"".join(tails), {"Inference-Header-Content-Length": str(len(raw))}


def _read_binary_response(response: httpx.Response) -> tuple[dict[str, object], bytes]:
    length = int(response.headers["Inference-Header-Content-Length"])
    return orjson.loads(response.content[:length]), response.content[length:]


def test_infer_binary_in_and_out(server: LiveServer, repository: Path, rng: np.random.Generator) -> None:
    features = rng.normal(size=(2, 4)).astype(np.float32)
    tokens = rng.integers(0, 10, size=(2, 3)).astype(np.int32)
    header = {
        "inputs": [
            {"name": "features", "shape": [2, 4], "datatype": "FP32", "parameters": {"binary_data_size": 32}},
            {"name": "tokens", "shape": [2, 3], "datatype": "INT32", "parameters": {"binary_data_size": 24}},
        ],
        "outputs": [{"name": "regression", "parameters": {"binary_data": True}}, {"name": "probs"}],
    }
    body, headers = _binary_body(header, features.tobytes(), tokens.tobytes())
    response = httpx.post(f"{server.url}/v2/models/multi/infer", content=body, headers=headers)
    assert response.status_code == 200, response.text
    answer, tail = _read_binary_response(response)
    regression_out, probs_out = answer["outputs"]  # type: ignore[misc]
    assert regression_out["parameters"]["binary_data_size"] == 16
    regression, probs = load_reference(repository, "multi", 1)([features, tokens])
    np.testing.assert_allclose(np.frombuffer(tail, np.float32).reshape(2, 2), regression.numpy(), atol=1e-4)
    np.testing.assert_allclose(np.array(probs_out["data"]).reshape(2, 5), probs.numpy(), atol=1e-4)


def test_binary_output_for_all_by_request_parameter(server: LiveServer) -> None:
    body = {
        "inputs": [{"name": "x", "shape": [1, 10], "datatype": "FP32", "data": [1.0] * 10}],
        "parameters": {"binary_data_output": True},
    }
    response = infer(server, "/v2/models/mlp/versions/1/infer", body)
    answer, tail = _read_binary_response(response)
    assert answer["outputs"][0]["parameters"] == {"binary_data_size": 12}  # type: ignore[index]
    assert np.frombuffer(tail, np.float32).sum() == pytest.approx(1.0, abs=1e-5)


def test_legacy_h5_and_saved_model_serve(server: LiveServer, repository: Path, rng: np.random.Generator) -> None:
    x = rng.normal(size=(2, 6)).astype(np.float32)
    meta = httpx.get(f"{server.url}/v2/models/legacy_h5").json()
    (spec,) = meta["inputs"]
    body = {"inputs": [{"name": spec["name"], "shape": [2, 6], "datatype": "FP32", "data": x.tolist()}]}
    answer = infer(server, "/v2/models/legacy_h5/infer", body).json()
    expected = load_reference(repository, "legacy_h5", 3)(x).numpy()
    np.testing.assert_allclose(np.array(answer["outputs"][0]["data"]).reshape(2, 2), expected, atol=1e-4)

    saved = httpx.get(f"{server.url}/v2/models/saved").json()
    assert saved["state"] == "READY", saved["reason"]
    assert [s["name"] for s in saved["inputs"]] == ["features", "tokens"]
    assert [s["name"] for s in saved["outputs"]] == ["output_0", "output_1"]
    features = rng.normal(size=(2, 4)).astype(np.float32)
    tokens = rng.integers(0, 10, size=(2, 3)).astype(np.int32)
    body = {
        "inputs": [
            {"name": "features", "shape": [2, 4], "datatype": "FP32", "data": features.tolist()},
            {"name": "tokens", "shape": [2, 3], "datatype": "INT32", "data": tokens.tolist()},
        ]
    }
    answer = infer(server, "/v2/models/saved/infer", body).json()
    signature = tf.saved_model.load(str(repository / "saved" / "1")).signatures["serving_default"]
    expected = signature(features=features, tokens=tokens)
    for output in answer["outputs"]:
        reference = expected[output["name"]].numpy()
        np.testing.assert_allclose(np.array(output["data"]).reshape(reference.shape), reference, atol=1e-4)


def test_keras_engine_config(server: LiveServer, repository: Path, rng: np.random.Generator) -> None:
    meta = httpx.get(f"{server.url}/v2/models/keras_engine").json()
    assert meta["engine"] == "keras"
    x = rng.normal(size=(4, 10)).astype(np.float32)
    body = {"inputs": [{"name": "x", "shape": [4, 10], "datatype": "FP32", "data": x.tolist()}]}
    answer = infer(server, "/v2/models/keras_engine/infer", body).json()
    expected = load_reference(repository, "keras_engine", 1)(x).numpy()
    np.testing.assert_allclose(np.array(answer["outputs"][0]["data"]).reshape(4, 3), expected, atol=1e-4)


def test_failed_models_show_reasons_and_others_serve(server: LiveServer) -> None:
    rows = {(r["name"], r["version"]): r for r in httpx.post(f"{server.url}/v2/repository/index").json()}
    assert rows[("mlp", "1")]["state"] == "READY"
    assert rows[("corrupt", "1")]["state"] == "FAILED"
    assert "model.keras" in rows[("corrupt", "1")]["reason"]
    assert rows[("unsafe_h5", "1")]["state"] == "FAILED"
    assert "Lambda" in rows[("unsafe_h5", "1")]["reason"]
    assert rows[("misconfigured", "")]["state"] == "UNAVAILABLE"
    assert "'max_batch_sise': unknown key" in rows[("misconfigured", "")]["reason"]
    meta = httpx.get(f"{server.url}/v2/models/corrupt").json()
    assert meta["state"] == "FAILED" and meta["reason"]
    not_ready = httpx.get(f"{server.url}/v2/models/corrupt/ready")
    assert not_ready.status_code == 503
    refused = infer(server, "/v2/models/corrupt/infer", {"inputs": []})
    assert refused.status_code == 503 and "FAILED" in refused.json()["error"]


BAD_REQUESTS = [
    ("/v2/models/nope/infer", {"inputs": []}, 404, "unknown model 'nope'"),
    ("/v2/models/mlp/versions/9/infer", {"inputs": []}, 404, "no loaded version 9"),
    ("/v2/models/mlp/versions/x/infer", {"inputs": []}, 400, "version must be a positive integer"),
    ("/v2/models/mlp/infer", {"inputs": []}, 400, "'inputs' must be a non-empty list"),
    ("/v2/models/mlp/infer", {"inputs": [{"name": "y", "shape": [1, 10], "datatype": "FP32", "data": [0] * 10}]},
     400, "unknown input 'y'; the model's inputs are: x"),
    ("/v2/models/mlp/infer", {"inputs": [{"name": "x", "shape": [1, 10], "datatype": "INT64", "data": [0] * 10}]},
     400, "input 'x': expected datatype FP32, got INT64"),
    ("/v2/models/mlp/infer", {"inputs": [{"name": "x", "shape": [1, 9], "datatype": "FP32", "data": [0] * 9}]},
     400, "input 'x': expected shape [-1, 10], got [1, 9]"),
    ("/v2/models/mlp/infer", {"inputs": [{"name": "x", "shape": [1, 10], "datatype": "FP32", "data": [0] * 9}]},
     400, "needs 10 elements, data has 9"),
    ("/v2/models/mlp/infer", {"inputs": [{"name": "x", "shape": [1, 10], "datatype": "FP32", "data": ["a"] * 10}]},
     400, "expected numbers for FP32"),
    ("/v2/models/multi/infer", {"inputs": [{"name": "tokens", "shape": [1, 3], "datatype": "INT32",
                                            "data": [1.5, 2, 3]}]}, 400, "expected integers for INT32"),
    ("/v2/models/multi/infer", {"inputs": [{"name": "tokens", "shape": [1, 3], "datatype": "INT32",
                                            "data": [1, True, 3]}]},
     400, "input 'tokens': expected integers for INT32, got true/false among them"),
    ("/v2/models/multi/infer", {"inputs": [{"name": "tokens", "shape": [1, 3], "datatype": "INT32",
                                            "data": [1, 2, 3]}]}, 400, "missing input(s): features"),
    ("/v2/models/mlp/infer", {"inputs": [{"name": "x", "shape": [1, 10], "datatype": "FP32", "data": [0] * 10}],
                              "outputs": [{"name": "nope"}]},
     400, "unknown output 'nope'; the model's outputs are: probs"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "message"), BAD_REQUESTS)
def test_bad_requests_get_clear_errors(
    server: LiveServer, path: str, body: dict[str, object], status: int, message: str
) -> None:
    response = infer(server, path, body)
    assert response.status_code == status
    assert message in response.json()["error"]
    assert httpx.get(f"{server.url}/v2/health/live").status_code == 200


def test_malformed_json_and_binary_header_errors(server: LiveServer) -> None:
    url = f"{server.url}/v2/models/mlp/infer"
    response = httpx.post(url, content=b"{not json")
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]
    response = httpx.post(url, content=b"{}", headers={"Inference-Header-Content-Length": "99"})
    assert response.status_code == 400 and "larger than the body" in response.json()["error"]
    header = {"inputs": [{"name": "x", "shape": [1, 10], "datatype": "FP32", "parameters": {"binary_data_size": 36}}]}
    body, headers = _binary_body(header, b"\0" * 36)
    response = httpx.post(url, content=body, headers=headers)
    assert response.status_code == 400 and "does not match shape [1, 10]" in response.json()["error"]


def test_body_over_the_limit_is_413(repository: Path, engine_cache: Path) -> None:
    from layerserve.settings import Settings
    from tests.live_server import start_server

    small = start_server(
        Settings(model_repository=repository / "mlp", engine_cache_dir=engine_cache, max_body_bytes=1000)
    )
    try:
        response = httpx.post(f"{small.url}/v2/models/1/infer", content=b"x" * 5000)
        assert response.status_code == 413
        assert "over the limit of 1000 bytes" in response.json()["error"]
        assert httpx.get(f"{small.url}/v2/health/live").status_code == 200
    finally:
        small.stop()


def test_unknown_route_is_json_404(server: LiveServer) -> None:
    response = httpx.get(f"{server.url}/v3/nothing")
    assert response.status_code == 404 and response.json() == {"error": "no route GET /v3/nothing"}


def test_bytes_length_prefix_is_checked(server: LiveServer) -> None:
    header = {"inputs": [{"name": "x", "shape": [1, 10], "datatype": "FP32", "parameters": {"binary_data_size": 8}}]}
    body, headers = _binary_body(header, struct.pack("<I", 100) + b"abcd")
    response = httpx.post(f"{server.url}/v2/models/mlp/infer", content=body, headers=headers)
    assert response.status_code == 400
