"""Images over HTTP against the demo repository: /classify, /features, V2 BYTES images, bad images."""

from __future__ import annotations

import base64
import io
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import keras
import numpy as np
import orjson
import pytest
from PIL import Image
from starlette.requests import Request

from layerserve.settings import Settings
from layerserve.transports.http.image_routes import query_parameters
from tests.demo.test_demo import REFERENCE_TOP5, chelsea_batch, package_file
from tests.live_server import LiveServer, start_server

MAX_PIXELS = 2_000_000


@pytest.fixture(scope="module")
def demo_server(demo_repository: Path, demo_engine_cache: Path) -> Iterator[LiveServer]:
    settings = Settings(
        model_repository=demo_repository, engine_cache_dir=demo_engine_cache, max_image_pixels=MAX_PIXELS
    )
    live = start_server(settings)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def efficientnet(demo_repository: Path) -> Any:
    return keras.saving.load_model(demo_repository / "efficientnet_lite0" / "1" / "model.keras")


def photo(name: str) -> bytes:
    return package_file("skimage", f"data/{name}").read_bytes()


def as_jpeg(raw: bytes) -> bytes:
    buffer = io.BytesIO()
    Image.open(io.BytesIO(raw)).convert("RGB").save(buffer, "JPEG", quality=95)
    return buffer.getvalue()


def classify(server: LiveServer, model: str, content: bytes, media_type: str, query: str = "") -> httpx.Response:
    return httpx.post(
        f"{server.url}/v2/models/{model}/classify{query}", content=content, headers={"Content-Type": media_type}
    )


def test_classify_chelsea_reproduces_the_reference(demo_server: LiveServer) -> None:
    response = classify(demo_server, "efficientnet_lite0", photo("chelsea.png"), "image/png")
    assert response.status_code == 200, response.text
    (top5,) = response.json()["predictions"]
    assert [c["label"] for c in top5] == [label for label, _ in REFERENCE_TOP5]
    for got, (_, score) in zip(top5, REFERENCE_TOP5, strict=True):
        assert got["score"] == pytest.approx(score, abs=0.01)
    assert top5[0]["index"] == 285


def test_multipart_batch_and_top_k(demo_server: LiveServer) -> None:
    files = [("image", ("cat.png", photo("chelsea.png"), "image/png")),
             ("image", ("coffee.jpg", as_jpeg(photo("coffee.png")), "image/jpeg"))]  # fmt: skip
    response = httpx.post(f"{demo_server.url}/v2/models/efficientnet_lite0/classify?top_k=3", files=files)
    assert response.status_code == 200, response.text
    cat, coffee = response.json()["predictions"]
    assert len(cat) == 3 and cat[0]["label"] == "Egyptian cat"
    assert coffee[0]["label"] in {"espresso", "cup", "coffee mug"}


def test_jpeg_body(demo_server: LiveServer) -> None:
    response = classify(demo_server, "efficientnet_lite0", as_jpeg(photo("chelsea.png")), "image/jpeg", "?top_k=1")
    assert response.json()["predictions"][0][0]["label"] == "Egyptian cat"


def test_legacy_h5_emotion_model(demo_server: LiveServer, demo_repository: Path) -> None:
    raw = photo("astronaut.png")
    response = classify(demo_server, "emotion", raw, "image/png", "?top_k=7")
    assert response.status_code == 200, response.text
    (scores,) = response.json()["predictions"]
    assert sorted(c["label"] for c in scores) == sorted(
        ["angry", "disgust", "fear", "happy", "sad", "surprise", "neutral"]
    )
    gray = Image.open(io.BytesIO(raw)).convert("L").resize((64, 64), Image.Resampling.BILINEAR)
    x = (np.asarray(gray, np.float32) / 127.5 - 1.0)[None, ..., None]
    expected = np.asarray(keras.saving.load_model(demo_repository / "emotion" / "1" / "model.h5", compile=False)(x))[0]
    for item in scores:
        assert item["score"] == pytest.approx(float(expected[item["index"]]), abs=1e-4)


def test_features_json_npy_and_store(demo_server: LiveServer, efficientnet: Any) -> None:
    url = f"{demo_server.url}/v2/models/efficientnet_lite0/features"
    body, headers = photo("chelsea.png"), {"Content-Type": "image/png"}
    answer = httpx.post(f"{url}?layer=avg_pool&ids=cat-1", content=body, headers=headers).json()
    assert answer["shape"] == [1, 1280] and answer["layer"] == "avg_pool"
    expected = keras.Model(efficientnet.inputs, efficientnet.get_layer("avg_pool").output)(chelsea_batch())
    np.testing.assert_allclose(np.array(answer["features"]), np.asarray(expected), atol=1e-3)

    npy = httpx.post(
        f"{url}?layer=block7_add&pool=max", content=body, headers={**headers, "Accept": "application/x-npy"}
    )
    vectors = np.load(io.BytesIO(npy.content), allow_pickle=False)
    block = keras.Model(efficientnet.inputs, efficientnet.get_layer("block7_add").output)(chelsea_batch())
    np.testing.assert_allclose(vectors, np.asarray(block).max(axis=(1, 2)), atol=1e-3)

    stored = httpx.get(f"{demo_server.url}/v2/models/efficientnet_lite0/features/cat-1").json()
    assert stored["datatype"] == "float32" and stored["shape"] == [1280] and stored["layer"] == "avg_pool"
    np.testing.assert_allclose(np.array(stored["data"]), np.array(answer["features"][0]), atol=1e-6)
    raw = httpx.get(
        f"{demo_server.url}/v2/models/efficientnet_lite0/features/cat-1", headers={"Accept": "application/x-npy"}
    )
    array = np.load(io.BytesIO(raw.content), allow_pickle=False)
    assert array.dtype == np.float32 and array.shape == (1280,)
    missing = httpx.get(f"{demo_server.url}/v2/models/efficientnet_lite0/features/nope")
    assert missing.status_code == 404


def test_v2_bytes_images_and_classification_extension(demo_server: LiveServer) -> None:
    raw = photo("chelsea.png")
    header = orjson.dumps(
        {
            "inputs": [
                {"name": "image", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": len(raw) + 4}}
            ],
            "outputs": [{"name": "predictions", "parameters": {"classification": 2}}],
        }
    )
    response = httpx.post(
        f"{demo_server.url}/v2/models/efficientnet_lite0/infer",
        content=header + struct.pack("<I", len(raw)) + raw,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert response.status_code == 200, response.text
    (output,) = response.json()["outputs"]
    assert output["datatype"] == "BYTES" and output["shape"] == [1, 2]
    score, index, label = output["data"][0].split(":")
    assert (index, label) == ("285", "Egyptian cat") and float(score) == pytest.approx(0.396, abs=0.01)

    body = {
        "inputs": [{"name": "image", "shape": [1, 1], "datatype": "BYTES", "data": [base64.b64encode(raw).decode()]}]
    }
    answer = httpx.post(f"{demo_server.url}/v2/models/efficientnet_lite0/infer", content=orjson.dumps(body)).json()
    assert int(np.argmax(answer["outputs"][0]["data"])) == 285


def test_classification_of_a_layer_has_no_labels_of_another_output(demo_server: LiveServer) -> None:
    raw = photo("chelsea.png")
    url = f"{demo_server.url}/v2/models/efficientnet_lite0/infer"
    image = {"name": "image", "shape": [1, 1], "datatype": "BYTES", "data": [base64.b64encode(raw).decode()]}
    plain = httpx.post(url, content=orjson.dumps({"inputs": [image], "outputs": [{"name": "avg_pool"}]})).json()
    pooled = np.array(plain["outputs"][0]["data"], dtype=np.float32)
    assert pooled.shape == (1280,)
    body = {"inputs": [image], "outputs": [{"name": "avg_pool", "parameters": {"classification": 3}}]}
    answer = httpx.post(url, content=orjson.dumps(body))
    assert answer.status_code == 200, answer.text
    entries = answer.json()["outputs"][0]["data"]
    best = np.argsort(-pooled, kind="stable")[:3]
    assert [entry.split(":")[1] for entry in entries] == [str(i) for i in best]
    assert all(len(entry.split(":")) == 2 for entry in entries)  # Triton's score:index, no ImageNet names
    assert [float(entry.split(":")[0]) for entry in entries] == pytest.approx(pooled[best].tolist(), rel=1e-5)


@pytest.mark.parametrize(
    ("content", "media_type", "status", "message"),
    [
        (b"", "image/png", 422, "empty image"),
        (b"\x89PNG\r\n\x1a\n garbage", "image/png", 422, "not a decodable image"),
        (b"hello", "text/plain", 415, "expected an image body"),
    ],
)
def test_bad_images(demo_server: LiveServer, content: bytes, media_type: str, status: int, message: str) -> None:
    response = classify(demo_server, "efficientnet_lite0", content, media_type)
    assert response.status_code == status and message in response.json()["error"]
    assert httpx.get(f"{demo_server.url}/v2/health/live").status_code == 200


def test_truncated_and_oversized_images(demo_server: LiveServer) -> None:
    for cut in (5000, 200_000):
        response = classify(demo_server, "efficientnet_lite0", photo("chelsea.png")[:cut], "image/png")
        error = response.json()["error"]
        assert response.status_code == 422
        assert "truncated or corrupt" in error or "not a decodable image" in error
    buffer = io.BytesIO()
    Image.new("1", (2000, 1500)).save(buffer, "PNG")  # 3 MP of a few hundred bytes
    response = classify(demo_server, "efficientnet_lite0", buffer.getvalue(), "image/png")
    assert response.status_code == 413 and f"over the limit of {MAX_PIXELS} pixels" in response.json()["error"]
    good = classify(demo_server, "efficientnet_lite0", photo("chelsea.png"), "image/png", "?top_k=1")
    assert good.status_code == 200


def test_non_image_model_and_bad_queries(demo_server: LiveServer) -> None:
    response = classify(demo_server, "token_classifier", photo("chelsea.png"), "image/png")
    assert response.status_code == 415 and "does not take images" in response.json()["error"]
    texts = httpx.post(f"{demo_server.url}/v2/models/token_classifier/classify", json={"texts": ["a text"]})
    assert texts.status_code == 415 and "send tensors to /v2/models/token_classifier/infer" in texts.json()["error"]
    url = f"{demo_server.url}/v2/models/efficientnet_lite0/features"
    headers = {"Content-Type": "image/png"}
    response = httpx.post(url, content=photo("chelsea.png"), headers=headers)
    assert response.status_code == 400 and "query 'layer' is required" in response.json()["error"]
    response = httpx.post(f"{url}?layer=avg_pool&pool=sum", content=photo("chelsea.png"), headers=headers)
    assert response.status_code == 400 and "query 'pool'" in response.json()["error"]
    response = httpx.post(f"{url}?layer=avg_pool&ids=a,b", content=photo("chelsea.png"), headers=headers)
    assert response.status_code == 400 and "one id per input" in response.json()["error"]
    response = classify(demo_server, "efficientnet_lite0", photo("chelsea.png"), "image/png", "?top_k=0")
    assert response.status_code == 400 and "top_k" in response.json()["error"]


def _hits(server: LiveServer) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    found = re.search(r'^layerserve_cache_hits_total{backend="memory",model="efficientnet_lite0"} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_encoded_images_hit_the_cache_before_decoding(demo_server: LiveServer) -> None:
    url = f"{demo_server.url}/v2/models/efficientnet_lite0/features?layer=block7_add&pool=avg"
    body, headers = as_jpeg(photo("coffee.png")), {"Content-Type": "image/jpeg"}
    first = httpx.post(url, content=body, headers=headers).json()["features"]
    before = _hits(demo_server)
    second = httpx.post(url, content=body, headers=headers).json()["features"]
    assert _hits(demo_server) == before + 1
    assert second == first
    bypassed = httpx.post(f"{url}&cache=false", content=body, headers=headers).json()["features"]
    assert _hits(demo_server) == before + 1
    np.testing.assert_allclose(np.array(bypassed), np.array(first), atol=1e-5)
    assert httpx.post(f"{url}&cache=true", content=body, headers=headers).json()["features"] == first
    assert _hits(demo_server) == before + 2
    refused = httpx.post(f"{url}&cache=no", content=body, headers=headers)
    assert refused.status_code == 400 and refused.json() == {"error": "query 'cache' must be true or false, got 'no'"}


def test_batch_read_of_stored_features(demo_server: LiveServer) -> None:
    url = f"{demo_server.url}/v2/models/efficientnet_lite0"
    files = [
        ("image", ("a.png", photo("chelsea.png"), "image/png")),
        ("image", ("b.png", photo("coffee.png"), "image/png")),
    ]
    stored = httpx.post(f"{url}/features?layer=avg_pool&ids=batch-a,batch-b", files=files).json()["features"]
    found = httpx.post(f"{url}/features/batch", json={"ids": ["batch-b", "missing", "batch-a"]}).json()["features"]
    assert found["missing"] is None
    np.testing.assert_allclose(np.array(found["batch-a"]["data"]), np.array(stored[0]), atol=1e-6)
    np.testing.assert_allclose(np.array(found["batch-b"]["data"]), np.array(stored[1]), atol=1e-6)
    assert found["batch-a"]["layer"] == "avg_pool" and found["batch-a"]["shape"] == [1280]
    bad = httpx.post(f"{url}/features/batch", json={"ids": "batch-a"})
    assert bad.status_code == 400 and "'ids' must be a non-empty list" in bad.json()["error"]


def test_bench_image_workload_with_ceiling(demo_server: LiveServer, demo_repository: Path, tmp_path: Path) -> None:
    from layerserve.bench.generator import BenchOptions, run_bench

    photo_file = tmp_path / "cat.jpg"
    photo_file.write_bytes(as_jpeg(photo("chelsea.png")))
    options = BenchOptions(
        url=demo_server.url, model="efficientnet_lite0", workload="image", concurrency=[2], duration_s=0.5,
        image=photo_file, in_process=demo_repository, batch_sizes=(1, 2), use_cache=False,
    )  # fmt: skip
    report = run_bench(options)
    (step,) = report["steps"]
    assert step["errors"] == {} and step["requests"] > 0 and step["samples_s"] == step["req_s"]
    assert report["in_process"]["best_batch_size"] in (1, 2) and step["vs_in_process"] > 0


@pytest.mark.parametrize(
    "query",
    [b"", b"top_k=3", b"cache=false&top_k=2", b"ids=a%2Cb,c&layer=block%201", b"x=1&x=2", b"pool=&layer=a+b", b"k"],
)
def test_query_parameters_read_as_starlette_reads_them(query: bytes) -> None:
    scope = {"type": "http", "query_string": query, "headers": []}
    assert query_parameters(scope) == dict(Request(scope).query_params)
    # Parsed once per query string: the next request with it shares the parse, which nobody can change.
    assert query_parameters(scope) is query_parameters({**scope, "query_string": bytes(query)})
    with pytest.raises(TypeError):
        query_parameters(scope)["top_k"] = "9"  # type: ignore[index]
