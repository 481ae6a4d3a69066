"""Layer outputs and cuts over HTTP (V2 JSON and binary, TF Serving, tritonclient), against Keras."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import keras
import numpy as np
import orjson
import pytest
import tritonclient.http as triton

from tests.live_server import LiveServer
from tests.models import load_reference


@pytest.fixture(scope="module")
def mobilenet(repository: Path) -> Any:
    return load_reference(repository, "mobilenet", 1)


@pytest.fixture(scope="module")
def input_name(mobilenet: Any) -> str:
    name: str = mobilenet.layers[0].name
    return name


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    return np.random.default_rng(5).uniform(-1, 1, (2, 96, 96, 3)).astype(np.float32)


def _tensor(name: str, array: np.ndarray) -> dict[str, object]:
    return {"name": name, "shape": list(array.shape), "datatype": "FP32", "data": array.reshape(-1)}


def infer(server: LiveServer, model: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v2/models/{model}/infer", content=orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    )


def outputs_by_name(response: httpx.Response) -> dict[str, np.ndarray]:
    assert response.status_code == 200, response.text
    return {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in response.json()["outputs"]}


def test_layers_route(server: LiveServer) -> None:
    body = httpx.get(f"{server.url}/v2/models/mobilenet/layers").json()
    layers = {layer["name"]: layer for layer in body["layers"]}
    assert body["layers"][0]["class_name"] == "InputLayer"
    assert layers["block_2_add"] == {
        "name": "block_2_add",
        "class_name": "Add",
        "output_shapes": [[-1, 24, 24, 8]],
        "datatype": "FP32",
        "inbound": ["block_1_project_BN", "block_2_project_BN"],
    }
    nested = httpx.get(f"{server.url}/v2/models/nested/versions/1/layers").json()["layers"]
    assert any(layer["name"].endswith("/block_5_add") for layer in nested)


def test_several_layers_mixed_with_model_output(
    server: LiveServer, input_name: str, mobilenet: Any, images: np.ndarray
) -> None:
    wanted = ["block_6_expand_relu", "predictions", "block_2_add"]
    body = {"inputs": [_tensor(input_name, images)], "outputs": [{"name": n} for n in wanted]}
    got = outputs_by_name(infer(server, "mobilenet", body))
    assert list(got) == wanted
    sub = keras.Model(mobilenet.inputs, [mobilenet.get_layer(n).output for n in wanted])
    for name, expected in zip(wanted, sub(images), strict=True):
        np.testing.assert_allclose(got[name], np.asarray(expected), atol=1e-4)


def test_layer_output_as_binary(server: LiveServer, input_name: str, mobilenet: Any, images: np.ndarray) -> None:
    header = orjson.dumps(
        {
            "inputs": [
                {**_tensor(input_name, images), "data": None, "parameters": {"binary_data_size": images.nbytes}}
            ],
            "outputs": [{"name": "block_3_expand_relu", "parameters": {"binary_data": True}}],
        }
    ).replace(b',"data":null', b"")
    response = httpx.post(
        f"{server.url}/v2/models/mobilenet/infer",
        content=header + images.tobytes(),
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    length = int(response.headers["Inference-Header-Content-Length"])
    (output,) = orjson.loads(response.content[:length])["outputs"]
    got = np.frombuffer(response.content[length:], np.float32).reshape(output["shape"])
    expected = keras.Model(mobilenet.inputs, mobilenet.get_layer("block_3_expand_relu").output)(images)
    np.testing.assert_allclose(got, np.asarray(expected), atol=1e-4)


def test_bottleneck_then_rest_over_two_requests(
    server: LiveServer, input_name: str, mobilenet: Any, images: np.ndarray
) -> None:
    first = {"inputs": [_tensor(input_name, images)], "outputs": [{"name": "block_13_expand_relu"}]}
    bottleneck = outputs_by_name(infer(server, "mobilenet", first))["block_13_expand_relu"]
    second = {"inputs": [_tensor("block_13_expand_relu", bottleneck)], "outputs": [{"name": "predictions"}]}
    rest = outputs_by_name(infer(server, "mobilenet", second))["predictions"]
    np.testing.assert_allclose(rest, np.asarray(mobilenet(images)), atol=1e-4)
    default = {"inputs": [_tensor("block_13_expand_relu", bottleneck)]}
    assert list(outputs_by_name(infer(server, "mobilenet", default))) == ["predictions"]


def test_nested_inner_layer_and_cut(server: LiveServer, repository: Path, images: np.ndarray) -> None:
    model = load_reference(repository, "nested", 1)
    base = model.layers[1]
    inner = f"{base.name}/block_5_add"
    body = {"inputs": [_tensor("image", images)], "outputs": [{"name": inner}]}
    feature = outputs_by_name(infer(server, "nested", body))[inner]
    expected = keras.Model(base.inputs, base.get_layer("block_5_add").output)(images)
    np.testing.assert_allclose(feature, np.asarray(expected), atol=1e-4)
    rest = outputs_by_name(infer(server, "nested", {"inputs": [_tensor(inner, feature)]}))["head"]
    np.testing.assert_allclose(rest, np.asarray(model(images)), atol=1e-4)


def test_cut_errors(server: LiveServer, input_name: str) -> None:
    data = np.zeros((1, 24, 24, 8), np.float32)
    body = {"inputs": [_tensor("block_2_project_BN", data)], "outputs": [{"name": "block_2_add"}]}
    response = infer(server, "mobilenet", body)
    assert response.status_code == 400 and "also need block_1_project_BN" in response.json()["error"]
    body = {"inputs": [_tensor("block_2_project_BN", np.zeros((1, 24, 24, 9), np.float32))]}
    response = infer(server, "mobilenet", body)
    assert response.status_code == 400
    assert "input 'block_2_project_BN': expected shape [-1, 24, 24, 8]" in response.json()["error"]
    body = {
        "inputs": [_tensor(input_name, np.zeros((1, 96, 96, 3), np.float32))],
        "outputs": [{"name": "blok_2_add"}],
    }
    response = infer(server, "mobilenet", body)
    assert response.status_code == 400
    assert response.json()["error"].startswith("unknown output 'blok_2_add'; close layer names: block_2_add")


def test_tfserving_output_filter(server: LiveServer, repository: Path) -> None:
    model = load_reference(repository, "multi", 1)
    features = np.ones((2, 4), np.float32)
    tokens = np.ones((2, 3), np.int32)
    rows = [{"features": f.tolist(), "tokens": t.tolist()} for f, t in zip(features, tokens, strict=True)]
    body = {"instances": rows, "output_filter": ["joined", "probs"]}
    answer = httpx.post(f"{server.url}/v1/models/multi:predict", content=orjson.dumps(body)).json()
    joined = keras.Model(model.inputs, model.get_layer("joined").output)([features, tokens])
    np.testing.assert_allclose(np.array([p["joined"] for p in answer["predictions"]]), np.asarray(joined), atol=1e-5)
    bad = httpx.post(f"{server.url}/v1/models/multi:predict", content=orjson.dumps({**body, "output_filter": ["x"]}))
    assert bad.status_code == 400 and "unknown output 'x'" in bad.json()["error"]


def test_tritonclient_asks_for_a_layer(server: LiveServer, input_name: str, mobilenet: Any, images: np.ndarray) -> None:
    client = triton.InferenceServerClient(server.host_port)
    request = triton.InferInput(input_name, list(images.shape), "FP32")
    request.set_data_from_numpy(images, binary_data=True)
    result = client.infer("mobilenet", [request], outputs=[triton.InferRequestedOutput("block_4_add")])
    expected = keras.Model(mobilenet.inputs, mobilenet.get_layer("block_4_add").output)(images)
    np.testing.assert_allclose(result.as_numpy("block_4_add"), np.asarray(expected), atol=1e-4)


def test_cuts_listed_in_metadata(server: LiveServer, input_name: str, images: np.ndarray) -> None:
    body = {"inputs": [_tensor(input_name, images)], "outputs": [{"name": "block_1_expand_relu"}]}
    assert infer(server, "mobilenet", body).status_code == 200
    cuts = httpx.get(f"{server.url}/v2/models/mobilenet").json()["cuts"]
    assert {"inputs": [input_name], "outputs": ["block_1_expand_relu"]}.items() <= next(
        c for c in cuts if c["outputs"] == ["block_1_expand_relu"]
    ).items()
