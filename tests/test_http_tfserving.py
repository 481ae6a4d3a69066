"""TF Serving REST routes against a real server."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import orjson

from tests.conftest import load_reference
from tests.live_server import LiveServer


def predict(server: LiveServer, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=orjson.dumps(body))


def test_status_and_metadata(server: LiveServer) -> None:
    status = httpx.get(f"{server.url}/v1/models/mlp").json()["model_version_status"]
    assert [(s["version"], s["state"]) for s in status] == [("2", "AVAILABLE"), ("1", "AVAILABLE")]
    failed = httpx.get(f"{server.url}/v1/models/corrupt/versions/1").json()["model_version_status"][0]
    assert failed["state"] == "END" and failed["status"]["error_code"] == "UNKNOWN"
    meta = httpx.get(f"{server.url}/v1/models/multi/metadata").json()
    signature = meta["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert signature["inputs"]["tokens"]["dtype"] == "DT_INT32"
    assert [d["size"] for d in signature["inputs"]["features"]["tensor_shape"]["dim"]] == ["-1", "4"]


def test_predict_instances_single_input(server: LiveServer, repository: Path) -> None:
    x = np.random.default_rng(3).normal(size=(2, 10)).astype(np.float32)
    answer = predict(server, "/v1/models/mlp/versions/1:predict", {"instances": x.tolist()}).json()
    expected = load_reference(repository, "mlp", 1)(x).numpy()
    np.testing.assert_allclose(np.array(answer["predictions"]), expected, atol=1e-4)


def test_predict_instances_and_inputs_multi(server: LiveServer, repository: Path) -> None:
    rng = np.random.default_rng(4)
    features = rng.normal(size=(2, 4)).astype(np.float32)
    tokens = rng.integers(0, 10, size=(2, 3))
    regression, probs = load_reference(repository, "multi", 1)([features, tokens.astype(np.int32)])
    rows = [{"features": f.tolist(), "tokens": t.tolist()} for f, t in zip(features, tokens, strict=True)]
    answer = predict(server, "/v1/models/multi:predict", {"instances": rows}).json()
    np.testing.assert_allclose(np.array([p["probs"] for p in answer["predictions"]]), probs.numpy(), atol=1e-4)
    columns = {"inputs": {"features": features.tolist(), "tokens": tokens.tolist()}}
    answer = predict(server, "/v1/models/multi:predict", columns).json()
    np.testing.assert_allclose(np.array(answer["outputs"]["regression"]), regression.numpy(), atol=1e-4)


def test_predict_errors(server: LiveServer) -> None:
    response = predict(server, "/v1/models/mlp:predict", {"instances": [[1, 2]]})
    assert response.status_code == 400 and "expected shape [-1, 10]" in response.json()["error"]
    response = predict(server, "/v1/models/mlp:predict", {"nothing": 1})
    assert response.status_code == 400 and "exactly one of 'instances'" in response.json()["error"]
    response = predict(server, "/v1/models/multi:predict", {"instances": [{"features": [0, 0, 0, 0]}]})
    assert response.status_code == 400 and "missing input(s): tokens" in response.json()["error"]
    response = predict(server, "/v1/models/nope:predict", {"instances": [[1]]})
    assert response.status_code == 404


def test_b64_values_decode_to_bytes() -> None:
    from layerserve.layers import LayerGraph
    from layerserve.model import Signature
    from layerserve.protocols.tfserving import encode_predict_response, parse_predict_request
    from layerserve.tensors import TensorSpec

    signature = LayerGraph(Signature((TensorSpec("text", "BYTES", (-1,)),), (TensorSpec("text", "BYTES", (-1,)),)))
    parsed = parse_predict_request(b'{"instances": [{"b64": "aGVsbG8="}, "plain"]}', signature)
    assert parsed.inputs["text"].tolist() == [b"hello", b"plain"]
    raw = np.array([b"ok", b"\xff\xfe"], dtype=object)
    assert orjson.loads(encode_predict_response(parsed, {"text": raw})) == {"predictions": ["ok", {"b64": "//4="}]}
