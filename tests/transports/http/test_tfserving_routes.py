"""TF Serving REST routes against a real server: status, metadata, predict, classify, regress, version labels."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from PIL import Image

from layerserve.settings import Settings
from layerserve.training.tokenizer import Tokenizer
from tests.live_server import LiveServer, start_server
from tests.models import build_mlp, build_multi, build_scalar, build_tiny_image, build_tiny_text, load_reference


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
    for path in ("/v1/models/mlp:predicts", "/v1/models/mlp", "/v1/models/mlp/versions/1:bogus"):
        response = predict(server, path, {"instances": [[1]]})
        assert response.status_code == 405 and ":predict, :classify or :regress" in response.json()["error"], path


def test_b64_values_decode_to_bytes() -> None:
    from layerserve.lifecycle.model import Signature
    from layerserve.protocols.tfserving import encode_predict_response, parse_predict_request
    from layerserve.serving.layers import LayerGraph
    from layerserve.tensors import TensorSpec

    signature = LayerGraph(Signature((TensorSpec("text", "BYTES", (-1,)),), (TensorSpec("text", "BYTES", (-1,)),)))
    parsed = parse_predict_request(b'{"instances": [{"b64": "aGVsbG8="}, "plain"]}', signature)
    assert parsed.inputs["text"].tolist() == [b"hello", b"plain"]
    raw = np.array([b"ok", b"\xff\xfe"], dtype=object)
    assert orjson.loads(encode_predict_response(parsed, {"text": raw})) == {"predictions": ["ok", {"b64": "//4="}]}


def test_signature_name_other_than_serving_default_is_refused(server: LiveServer) -> None:
    x = np.zeros((1, 10)).tolist()
    for name in (None, "serving_default"):
        body = {"instances": x} if name is None else {"instances": x, "signature_name": name}
        assert predict(server, "/v1/models/mlp:predict", body).status_code == 200
    response = predict(server, "/v1/models/mlp:predict", {"instances": x, "signature_name": "other"})
    assert response.status_code == 400
    assert response.json()["error"] == (
        'Serving signature name: "other" not found in signature def; the model has one signature: "serving_default"'
    )


def test_b64_for_an_int32_input_names_what_was_given(server: LiveServer) -> None:
    row = {"features": [0, 0, 0, 0], "tokens": {"b64": "AAEC"}}
    response = predict(server, "/v1/models/multi:predict", {"instances": [row]})
    assert response.status_code == 400
    expected = "input 'tokens': expected integers for INT32, got bytes (a {\"b64\": ...} object)"
    assert response.json()["error"] == expected
    row = {"features": [0, 0, 0, 0], "tokens": [1, True, 3]}
    response = predict(server, "/v1/models/multi:predict", {"instances": [row]})
    assert response.status_code == 400
    assert response.json()["error"] == "input 'tokens': expected integers for INT32, got true/false among them"


ADMIN = "admin-secret"
TEXTS = ["good great fine", "bad awful poor"]


@pytest.fixture(scope="module")
def tf_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Path]]:
    """A server (with an admin token) over labelled, regression, image and text models."""
    repo = tmp_path_factory.mktemp("tfserving-repo")

    def model(name: str, versions: dict[int, Any], config: str, labels: str = "") -> Path:
        for number, keras_model in versions.items():
            (repo / name / str(number)).mkdir(parents=True)
            keras_model.save(repo / name / str(number) / "model.keras")
        (repo / name / "config.yaml").write_text(config)
        if labels:
            (repo / name / "labels.txt").write_text(labels)
        return repo / name

    labelled = "version_policy: all\nlabels: labels.txt\nversion_labels: {stable: 1, canary: 2, future: 9}\n"
    model("labelled", {1: build_mlp(1), 2: build_mlp(2)}, labelled, "cat\ndog\nbird\n")
    model("scalar", {1: build_scalar()}, "")
    model("multi", {1: build_multi()}, "labels: labels.txt\nclassify_output: probs\n", "a\nb\nc\nd\ne\n")
    model("image", {1: build_tiny_image()}, "input: image\nresize: squash\nlabels: labels.txt\n", "red\ngreen\nblue\n")
    tokenizer = Tokenizer(sequence_length=6).fit(TEXTS)
    text = model("text", {1: build_tiny_text(tokenizer.size, 6)}, "input: text\nlabels: labels.txt\n", "neg\npos\n")
    tokenizer.save(text / "1")
    (repo / "broken").mkdir()
    (repo / "broken" / "config.yaml").write_text("version_labels: {Stable: 1}\n")
    settings = Settings(model_repository=repo, engine_cache_dir=tmp_path_factory.mktemp("tf-cache"), admin_token=ADMIN)
    live = start_server(settings)
    yield live, repo
    live.stop()


def ranked(scores: np.ndarray, labels: list[str]) -> list[list[str]]:
    """Keras' classes per row, best first."""
    return [[labels[i] for i in np.argsort(-row, kind="stable")] for row in scores]


def check_classes(answer: dict[str, Any], scores: np.ndarray, labels: list[str]) -> None:
    results = answer["results"]
    assert [[label for label, _ in row] for row in results] == ranked(scores, labels)
    for row, expected in zip(results, scores, strict=True):
        for label, score in row:
            assert score == pytest.approx(float(expected[labels.index(label)]), abs=1e-5)


def test_classify_a_labelled_model_equals_keras(tf_server: tuple[LiveServer, Path]) -> None:
    live, repo = tf_server
    x = np.random.default_rng(5).normal(size=(3, 10)).astype(np.float32)
    response = predict(live, "/v1/models/labelled/versions/1:classify", {"examples": [{"x": r.tolist()} for r in x]})
    assert response.status_code == 200, response.text
    check_classes(response.json(), load_reference(repo, "labelled", 1)(x).numpy(), ["cat", "dog", "bird"])


def test_classify_merges_the_context_and_ranks_classify_output(tf_server: tuple[LiveServer, Path]) -> None:
    live, repo = tf_server
    features = np.random.default_rng(6).normal(size=(2, 4)).astype(np.float32)
    tokens = np.array([[1, 2, 3], [1, 2, 3]], np.int32)
    body = {"signature_name": "serving_default", "context": {"tokens": [1, 2, 3]},
            "examples": [{"features": f.tolist()} for f in features]}  # fmt: skip
    response = predict(live, "/v1/models/multi:classify", body)
    assert response.status_code == 200, response.text
    _, probs = load_reference(repo, "multi", 1)([features, tokens])
    check_classes(response.json(), probs.numpy(), list("abcde"))
    both = {"context": {"tokens": [1, 2, 3]}, "examples": [{"features": [0] * 4, "tokens": [1, 2, 3]}]}
    response = predict(live, "/v1/models/multi:classify", both)
    assert response.status_code == 400 and "tokens also in 'context'" in response.json()["error"]


def test_classify_encoded_images_and_texts(tf_server: tuple[LiveServer, Path]) -> None:
    live, repo = tf_server
    pixels = np.random.default_rng(7).integers(0, 256, size=(2, 8, 8, 3), dtype=np.uint8)
    pngs = []
    for image in pixels:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, "PNG")
        pngs.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    response = predict(live, "/v1/models/image:classify", {"examples": [{"image": {"b64": p}} for p in pngs]})
    assert response.status_code == 200, response.text
    expected = load_reference(repo, "image", 1)(pixels.astype(np.float32)).numpy()
    check_classes(response.json(), expected, ["red", "green", "blue"])

    response = predict(live, "/v1/models/text:classify", {"examples": [{"tokens": t} for t in ["great fine", "awful"]]})
    assert response.status_code == 200, response.text
    ids = Tokenizer.load(repo / "text" / "1").encode(["great fine", "awful"])
    check_classes(response.json(), load_reference(repo, "text", 1)(ids).numpy(), ["neg", "pos"])


def test_classify_without_labels_names_classes_by_index(tf_server: tuple[LiveServer, Path]) -> None:
    live, repo = tf_server
    x = np.random.default_rng(8).normal(size=(2, 4)).astype(np.float32)
    answer = predict(live, "/v1/models/scalar:classify", {"examples": [{"x": r.tolist()} for r in x]}).json()
    check_classes(answer, load_reference(repo, "scalar", 1)(x).numpy(), ["0"])


def test_regress_equals_keras(tf_server: tuple[LiveServer, Path]) -> None:
    live, repo = tf_server
    x = np.random.default_rng(9).normal(size=(3, 4)).astype(np.float32)
    response = predict(live, "/v1/models/scalar/versions/1:regress", {"examples": [{"x": r.tolist()} for r in x]})
    assert response.status_code == 200, response.text
    expected = load_reference(repo, "scalar", 1)(x).numpy().reshape(-1)
    np.testing.assert_allclose(response.json()["results"], expected, atol=1e-5)


def test_regress_refuses_a_model_that_is_not_a_regression_model(tf_server: tuple[LiveServer, Path]) -> None:
    live, _ = tf_server
    body = {"examples": [{"features": [0] * 4, "tokens": [1, 2, 3]}]}
    response = predict(live, "/v1/models/multi:regress", body)
    assert response.status_code == 400
    message = response.json()["error"]
    assert "not a regression model" in message and "(shape [-1] or [-1, 1])" in message
    assert "'regression' [-1, 2], 'probs' [-1, 5]" in message
    response = predict(live, "/v1/models/labelled:regress", {"examples": [{"x": [0] * 10}]})
    assert response.status_code == 400 and "'probs' [-1, 3]" in response.json()["error"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"examples": []}, "'examples' must be a non-empty list of objects"),
        ({"examples": [[0, 0, 0, 0]]}, "'examples' must be a non-empty list of objects"),
        ({"examples": [{"x": [0] * 4}], "context": [1]}, "'context' must be an object"),
        ({"examples": [{"x": [0] * 4}, {"y": [0] * 4}]}, "example 1 has the features [y], example 0 has [x]"),
        ({"examples": [{"x": [0] * 3}]}, "feature 'x' of example 0: expected 4 value(s), one row of the input's shape"),
        ({"examples": [{"x": ["a"] * 4}]}, "feature 'x' of example 0: expected numbers for FP32, got strings"),
        ({"examples": [{"nope": [0] * 4}]}, "unknown input 'nope'"),
        ({"examples": [{"x": [0] * 4}], "signature_name": "other"}, 'Serving signature name: "other" not found'),
    ],
)
def test_examples_errors(tf_server: tuple[LiveServer, Path], body: object, message: str) -> None:
    live, _ = tf_server
    for verb in ("classify", "regress"):
        response = predict(live, f"/v1/models/scalar:{verb}", body)
        assert response.status_code == 400 and message in response.json()["error"], (verb, response.text)


def test_version_labels_route_status_metadata_predict_and_classify(tf_server: tuple[LiveServer, Path]) -> None:
    live, repo = tf_server
    status = httpx.get(f"{live.url}/v1/models/labelled/labels/canary").json()["model_version_status"]
    assert [(s["version"], s["state"]) for s in status] == [("2", "AVAILABLE")]
    meta = httpx.get(f"{live.url}/v1/models/labelled/labels/stable/metadata").json()
    assert meta["model_spec"]["version"] == "1"
    x = np.random.default_rng(10).normal(size=(2, 10)).astype(np.float32)
    answer = predict(live, "/v1/models/labelled/labels/stable:predict", {"instances": x.tolist()}).json()
    np.testing.assert_allclose(answer["predictions"], load_reference(repo, "labelled", 1)(x).numpy(), atol=1e-4)
    answer = predict(live, "/v1/models/labelled/labels/canary:classify", {"examples": [{"x": r.tolist()} for r in x]})
    check_classes(answer.json(), load_reference(repo, "labelled", 2)(x).numpy(), ["cat", "dog", "bird"])
    regress = predict(live, "/v1/models/scalar/labels/stable:regress", {"examples": [{"x": [0] * 4}]})
    assert regress.status_code == 404
    v2 = httpx.get(f"{live.url}/v2/models/labelled").json()
    assert v2["version_labels"] == {"stable": "1", "canary": "2", "future": "9"}


def test_unknown_labels_are_404_naming_the_known_ones(tf_server: tuple[LiveServer, Path]) -> None:
    live, _ = tf_server
    response = httpx.get(f"{live.url}/v1/models/labelled/labels/beta")
    assert response.status_code == 404
    assert response.json()["error"] == "model 'labelled' has no version label 'beta'; labels: canary, future, stable"
    response = predict(live, "/v1/models/scalar/labels/stable:predict", {"instances": [[0] * 4]})
    assert response.status_code == 404 and "labels: none (set version_labels in its config.yaml)" in response.text
    response = predict(live, "/v1/models/labelled/labels/future:predict", {"instances": [[0] * 10]})
    assert response.status_code == 404 and "has no loaded version 9" in response.json()["error"]
    response = httpx.get(f"{live.url}/v1/models/broken/labels/stable")
    assert response.status_code == 503 and "config.yaml is invalid" in response.json()["error"]
    assert "label 'Stable' must match [a-z][a-z0-9_-]*" in response.json()["error"]


def test_apply_by_label_pins_the_version_and_needs_the_admin_token(tf_server: tuple[LiveServer, Path]) -> None:
    live, repo = tf_server
    admin = {"Authorization": f"Bearer {ADMIN}"}
    route = f"{live.url}/v2/models/labelled/labels/stable/apply"
    assert httpx.post(route).status_code == 401
    assert httpx.post(route, headers={"Authorization": "Bearer wrong"}).status_code == 403
    applied = httpx.post(route, headers=admin)
    assert applied.status_code == 200, applied.text
    assert applied.json() == {"name": "labelled", "active_version": "1", "pinned": True}
    assert (repo / "labelled" / ".pinned_version").read_text().strip() == "1"
    x = np.random.default_rng(11).normal(size=(1, 10)).astype(np.float32)
    answer = predict(live, "/v1/models/labelled:predict", {"instances": x.tolist()}).json()
    np.testing.assert_allclose(answer["predictions"], load_reference(repo, "labelled", 1)(x).numpy(), atol=1e-4)

    by_body = httpx.post(f"{live.url}/v2/models/labelled/apply", json={"label": "canary"}, headers=admin)
    assert by_body.status_code == 200 and by_body.json()["active_version"] == "2"
    assert httpx.get(f"{live.url}/v2/models/labelled").json()["pinned_version"] == "2"
    unknown = httpx.post(f"{live.url}/v2/models/labelled/labels/beta/apply", headers=admin)
    assert unknown.status_code == 404 and "labels: canary, future, stable" in unknown.json()["error"]
    missing = httpx.post(f"{live.url}/v2/models/labelled/labels/future/apply", headers=admin)
    assert missing.status_code == 404 and "no version folder 9" in missing.json()["error"]
    broken = httpx.post(f"{live.url}/v2/models/broken/labels/stable/apply", headers=admin)
    assert broken.status_code == 503 and "config.yaml is invalid" in broken.json()["error"]
    nowhere = httpx.post(f"{live.url}/v2/models/nowhere/labels/stable/apply", headers=admin)
    assert nowhere.status_code == 404 and "unknown model 'nowhere'" in nowhere.json()["error"]
    bad = httpx.post(f"{live.url}/v2/models/labelled/apply", json={"label": 1}, headers=admin)
    assert bad.status_code == 400 and '{"label": "<label>"}' in bad.json()["error"]
    unpinned = httpx.post(f"{live.url}/v2/models/labelled/apply", json={"version": "latest"}, headers=admin)
    assert unpinned.json() == {"name": "labelled", "active_version": "2", "pinned": False}
