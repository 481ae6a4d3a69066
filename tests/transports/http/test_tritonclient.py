"""The real Triton HTTP client against a running layerserve."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as triton

from tests.live_server import LiveServer
from tests.models import load_reference


@pytest.fixture
def client(server: LiveServer) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(server.host_port)


def test_ready_and_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("multi")
    assert client.is_model_ready("mlp", "1")
    assert not client.is_model_ready("corrupt")
    meta = client.get_model_metadata("multi")
    assert [i["name"] for i in meta["inputs"]] == ["features", "tokens"]
    assert client.get_server_metadata()["name"] == "layerserve"


@pytest.mark.parametrize("binary", [True, False])
def test_infer(client: triton.InferenceServerClient, repository: Path, binary: bool) -> None:
    rng = np.random.default_rng(7)
    features = rng.normal(size=(3, 4)).astype(np.float32)
    tokens = rng.integers(0, 10, size=(3, 3)).astype(np.int32)
    inputs = [triton.InferInput("features", [3, 4], "FP32"), triton.InferInput("tokens", [3, 3], "INT32")]
    inputs[0].set_data_from_numpy(features, binary_data=binary)
    inputs[1].set_data_from_numpy(tokens, binary_data=binary)
    outputs = [triton.InferRequestedOutput(name, binary_data=binary) for name in ("regression", "probs")]
    result = client.infer("multi", inputs, outputs=outputs, request_id="abc")
    assert result.get_response()["id"] == "abc"
    assert result.get_response()["model_version"] == "1"
    regression, probs = load_reference(repository, "multi", 1)([features, tokens])
    np.testing.assert_allclose(result.as_numpy("regression"), regression.numpy(), atol=1e-4)
    np.testing.assert_allclose(result.as_numpy("probs"), probs.numpy(), atol=1e-4)


def test_infer_version_and_errors(client: triton.InferenceServerClient) -> None:
    x = triton.InferInput("x", [1, 10], "FP32")
    x.set_data_from_numpy(np.ones((1, 10), np.float32))
    assert client.infer("mlp", [x], model_version="1").get_response()["model_version"] == "1"
    with pytest.raises(triton.InferenceServerException, match="expected datatype FP32"):
        wrong = triton.InferInput("x", [1, 10], "FP64")
        wrong.set_data_from_numpy(np.ones((1, 10), np.float64))
        client.infer("mlp", [wrong])
