"""Pipelines (`pipeline:` in a model's config.yaml) on a real server: answers equal to the steps computed with Keras
(V2 over HTTP and gRPC, /classify with the last step's labels, a step that starts at a layer: a cut), each step batched
by its own model, statistics and trace spans per step, load errors that name the step (a missing model, a shape that
does not connect, a circle, an unknown output), a step model's new version followed, steps loaded on demand under a
memory budget; and the config's checks."""

from __future__ import annotations

import asyncio
import base64
import io
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import keras
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from PIL import Image

from layerserve.errors import ConfigError
from layerserve.serving.pipeline import find_circle, pipeline_depth
from layerserve.settings import ModelConfig, Settings, read_model_config
from tests.live_server import LiveServer, metric_sample, start_server, wait_until
from tests.models import build_tiny_image, save_model
from tests.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.slow

CONCURRENT = 12


def build_head(seed: int) -> Any:
    """4 pooled features -> 2 softmax scores (the base's `pool` is 4 wide)."""
    keras.utils.set_random_seed(seed)
    features = keras.Input((4,), name="features")
    hidden = keras.layers.Dense(6, activation="relu", name="hidden")(features)
    return keras.Model(features, keras.layers.Dense(2, activation="softmax", name="scores")(hidden), name="head")


def write_pipeline(repo: Path, name: str, steps: str) -> None:
    (repo / name).mkdir(parents=True, exist_ok=True)
    (repo / name / "config.yaml").write_text(f"pipeline:\n{steps}")


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`base` (an 8x8 image classifier with a 4-wide `pool` layer), `head` (pool -> cat/dog) and pipelines over
    them: good ones, and one per load error."""
    repo = tmp_path_factory.mktemp("pipelines")
    save_model(build_tiny_image(), repo / "base" / "1", "model.keras")
    (repo / "base" / "config.yaml").write_text("input: image\nmax_batch_size: 32\nmax_delay_ms: 40\n")
    for name in ("head", "swapped_head"):
        save_model(build_head(1), repo / name / "1", "model.keras")
        (repo / name / "labels.txt").write_text("cat\ndog\n")
        (repo / name / "config.yaml").write_text("labels: labels.txt\nmax_batch_size: 32\nmax_delay_ms: 40\n")
    write_pipeline(repo, "pets", "  - model: base\n    output: pool\n  - model: head\n    input: features\n")
    write_pipeline(repo, "pets_swapped", "  - {model: base, output: pool}\n  - {model: swapped_head}\n")
    cut = "  - {model: base, output: conv}\n  - {model: base, input: conv, output: probs}\n"
    write_pipeline(repo, "from_conv", cut)
    write_pipeline(repo, "wrong_width", "  - {model: base, output: probs}\n  - {model: head}\n")
    write_pipeline(repo, "missing_step", "  - {model: base, output: pool}\n  - {model: nowhere}\n")
    write_pipeline(repo, "typo", "  - {model: base, output: pol}\n  - {model: head}\n")
    write_pipeline(repo, "circle_a", "  - {model: circle_b}\n")
    write_pipeline(repo, "circle_b", "  - {model: base, output: pool}\n  - {model: circle_a}\n")
    return repo


@pytest.fixture(scope="module")
def live(repo: Path, engine_cache: Path, receiver: OtlpReceiver) -> Iterator[LiveServer]:
    """A server polling the repository, its gRPC door open, tracing a caller's sampled requests."""
    settings = Settings(
        model_repository=repo, engine_cache_dir=engine_cache, reload_interval_s=0.3,
        otlp_endpoint=receiver.endpoint, trace_sampling_ratio=0.0,
    )  # fmt: skip
    server = start_server(settings, grpc=True)
    yield server
    server.stop()


def images(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 255, (count, 8, 8, 3)).astype(np.float32)


def reference(repo: Path, x: np.ndarray, head: str = "head", version: int = 1) -> np.ndarray:
    """The two steps computed with Keras on the saved models: the head on the base's pooled layer."""
    base = keras.saving.load_model(repo / "base" / "1" / "model.keras")
    pool = keras.Model(base.inputs, base.get_layer("pool").output)(x)
    return np.asarray(keras.saving.load_model(repo / head / str(version) / "model.keras")(pool))


def infer(url: str, model: str, x: np.ndarray, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"inputs": [{"name": "image", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    return httpx.post(f"{url}/v2/models/{model}/infer", json=body, headers=headers, timeout=30)


def scores(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    output = response.json()["outputs"][0]
    return np.asarray(output["data"], np.float32).reshape(output["shape"])


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_pipeline_answers_as_its_steps_computed_with_keras(live: LiveServer, repo: Path) -> None:
    x = images(3)
    np.testing.assert_allclose(scores(infer(live.url, "pets", x)), reference(repo, x), atol=1e-5)
    metadata = httpx.get(f"{live.url}/v2/models/pets").json()
    assert metadata["state"] == "READY" and metadata["engine"] == "pipeline", metadata
    assert metadata["engine_reason"] == "pipeline: base (pool) -> head (scores)"
    assert metadata["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [-1, 8, 8, 3]}]
    assert metadata["outputs"] == [{"name": "scores", "datatype": "FP32", "shape": [-1, 2]}]
    assert metadata["input"] == "image"  # its first step's: /classify takes images
    with grpcclient.InferenceServerClient(live.grpc_target) as client:
        given = grpcclient.InferInput("image", list(x.shape), "FP32")
        given.set_data_from_numpy(x)
        answer = client.infer("pets", [given]).as_numpy("scores")
    np.testing.assert_allclose(answer, reference(repo, x), atol=1e-5)
    body = {"inputs": [{"name": "image", "shape": [1, 8, 8, 3], "datatype": "FP32", "data": x[0].ravel().tolist()}],
            "outputs": [{"name": "hidden"}]}  # fmt: skip
    refused = httpx.post(f"{live.url}/v2/models/pets/infer", json=body)  # a pipeline has no layers of its own
    assert refused.status_code == 400 and "each step's model answers its own layers" in refused.json()["error"]
    pooled = {"inputs": [{"name": "scores", "shape": [1, 2], "datatype": "FP32", "data": [0.5, 0.5]}]}
    refused = httpx.post(f"{live.url}/v2/models/pets/infer", json=pooled)  # nor does it start at one
    assert refused.status_code == 400, refused.text
    assert "pipeline 'pets' takes its inputs image, got scores" in refused.json()["error"]


def test_classify_ranks_the_last_steps_labels_on_images_decoded_as_the_first_step_does(
    live: LiveServer, repo: Path
) -> None:
    pixels = images(2, seed=1).round()
    encoded = [png(image) for image in pixels]
    given = [base64.b64encode(item).decode() for item in encoded]
    pooled = httpx.post(
        f"{live.url}/v2/models/base/infer",
        json={"inputs": [{"name": "image", "shape": [2], "datatype": "BYTES", "data": given}],
              "outputs": [{"name": "pool"}]},
    )  # fmt: skip
    expected = np.asarray(keras.saving.load_model(repo / "head" / "1" / "model.keras")(scores(pooled)))
    for image, row in zip(encoded, expected, strict=True):
        answer = httpx.post(
            f"{live.url}/v2/models/pets/classify?top_k=2", content=image, headers={"Content-Type": "image/png"}
        )
        assert answer.status_code == 200, answer.text
        ranked = answer.json()["predictions"][0]
        assert [item["label"] for item in ranked] == [["cat", "dog"][i] for i in np.argsort(-row)]
        np.testing.assert_allclose([item["score"] for item in ranked], np.sort(row)[::-1], atol=1e-5)


def test_a_step_may_start_at_a_layer_of_its_model(live: LiveServer, repo: Path) -> None:
    x = images(2, seed=2)
    base = keras.saving.load_model(repo / "base" / "1" / "model.keras")
    np.testing.assert_allclose(scores(infer(live.url, "from_conv", x)), np.asarray(base(x)), atol=1e-5)


def test_each_step_batches_as_its_model_and_statistics_show_each_step(live: LiveServer, repo: Path) -> None:
    def stats(model: str) -> dict[str, Any]:
        found: dict[str, Any] = httpx.get(f"{live.url}/v2/models/{model}/stats").json()["model_stats"][0]
        return found

    def successes(entry: dict[str, Any]) -> int:
        return int(entry["inference_stats"]["success"]["count"])

    before = {model: stats(model) for model in ("pets", "base", "head")}
    x = images(CONCURRENT, seed=3)

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            body = [
                {"inputs": [{"name": "image", "shape": [1, 8, 8, 3], "datatype": "FP32", "data": row.ravel().tolist()}]}
                for row in x
            ]
            return await asyncio.gather(*(client.post(f"{live.url}/v2/models/pets/infer", json=b) for b in body))

    def counted(model: str) -> float:
        return metric_sample(live.url, "layerserve_requests_total", model=model, route="v2.infer", status="200")

    counted_before = {model: counted(model) for model in ("pets", "base", "head")}
    answers = asyncio.run(send_all())
    np.testing.assert_allclose(np.concatenate([scores(a) for a in answers]), reference(repo, x), atol=1e-5)
    after = {model: stats(model) for model in ("pets", "base", "head")}
    for model in ("base", "head"):  # each step's model saw the pipeline's requests, in fewer model calls
        requests = successes(after[model]) - successes(before[model])
        calls = after[model]["execution_count"] - before[model]["execution_count"]
        assert requests == CONCURRENT and calls < CONCURRENT, (model, requests, calls)
    steps = after["pets"]["steps"]
    assert [(s["step"], s["model"], s["version"], s["output"]) for s in steps] == [
        (1, "base", "1", "pool"), (2, "head", "1", "scores")
    ]  # fmt: skip
    for step, earlier in zip(steps, before["pets"]["steps"], strict=True):
        assert step["success"]["count"] - earlier["success"]["count"] == CONCURRENT and step["success"]["ns"] > 0
    assert successes(after["pets"]) - successes(before["pets"]) == CONCURRENT
    # The requests are the pipeline's: its steps' models count none in the request counters (their statistics above).
    assert {model: counted(model) - counted_before[model] for model in counted_before} == {
        "pets": CONCURRENT, "base": 0, "head": 0
    }  # fmt: skip
    with grpcclient.InferenceServerClient(live.grpc_target) as client:  # Triton's message has no steps: left out
        assert client.get_inference_statistics("pets").model_stats[0].name == "pets"


def test_a_traced_request_has_a_span_per_step(live: LiveServer, receiver: OtlpReceiver) -> None:
    trace_id = secrets.token_hex(16)
    traceparent = f"00-{trace_id}-{secrets.token_hex(8)}-01"
    assert infer(live.url, "pets", images(1), {"traceparent": traceparent}).status_code == 200
    wait_until(
        lambda: len([s for s in receiver.trace(trace_id) if s.name == "pipeline step"]) == 2, "two step spans", 60
    )
    steps = sorted((s for s in receiver.trace(trace_id) if s.name == "pipeline step"), key=lambda s: s.start_ns)
    assert [(s.attributes["layerserve.step"], s.attributes["layerserve.model"]) for s in steps] == [
        (1, "base"), (2, "head")
    ]  # fmt: skip
    assert all(s.attributes["layerserve.pipeline"] == "pets" and s.attributes["layerserve.version"] == 1 for s in steps)
    computed = [s for s in receiver.trace(trace_id) if s.name == "engine compute"]
    assert {s.attributes["layerserve.model"] for s in computed} == {"base", "head"}


def test_load_errors_name_the_step(live: LiveServer) -> None:
    index = {row["name"]: row for row in httpx.post(f"{live.url}/v2/repository/index").json()}
    assert index["pets"]["state"] == "READY"
    expected = {
        "wrong_width": "step 2 (model 'head' version 1): its input 'features' takes FP32 [-1, 4], but step 1's "
        "output 'probs' gives FP32 [-1, 3]",
        "missing_step": "step 2: the repository has no model 'nowhere'",
        "typo": "step 1 (model 'base' version 1): unknown output 'pol'; close layer names: pool",  # and probs
        "circle_a": "step 1 (model 'circle_b') leads back to a model on the way: circle_a -> circle_b -> circle_a",
        "circle_b": "step 2 (model 'circle_a') leads back to a model on the way: circle_b -> circle_a -> circle_b",
    }
    for name, reason in expected.items():
        assert index[name]["state"] == "FAILED" and index[name]["reason"].startswith(reason), index[name]
    refused = infer(live.url, "wrong_width", images(1))
    assert refused.status_code == 503 and reason_in(refused, "step 2 (model 'head' version 1)")


def reason_in(response: httpx.Response, text: str) -> bool:
    return text in response.json()["error"]


def test_a_pipeline_follows_a_new_version_of_a_step(live: LiveServer, repo: Path) -> None:
    x = images(2, seed=4)
    first = reference(repo, x, "swapped_head")
    np.testing.assert_allclose(scores(infer(live.url, "pets_swapped", x)), first, atol=1e-5)
    save_model(build_head(2), repo / "swapped_head" / "2", "model.keras")
    expected = reference(repo, x, "swapped_head", 2)

    def answers_with_version_2() -> bool:
        if not np.allclose(scores(infer(live.url, "pets_swapped", x)), expected, atol=1e-5):
            return False
        # The pipeline connects again at the poll after the new version (its statistics start again then).
        steps = httpx.get(f"{live.url}/v2/models/pets_swapped/stats").json()["model_stats"][0]["steps"]
        return bool(steps[1]["version"] == "2")

    wait_until(answers_with_version_2, "the pipeline answering with swapped_head's version 2", 60)
    assert httpx.get(f"{live.url}/v2/models/pets_swapped").json()["state"] == "READY"


def test_a_step_loaded_between_polls_is_followed_at_once(repo: Path, engine_cache: Path, tmp_path: Path) -> None:
    own = tmp_path / "repo"
    for name in ("base", "head"):
        shutil.copytree(repo / name, own / name)
    write_pipeline(own, "pets", "  - {model: base, output: pool}\n  - {model: head}\n")
    (own / "head" / "config.yaml").write_text("labels: labels.txt\nversion_policy: all\n")  # version 1 stays
    server = start_server(Settings(model_repository=own, engine_cache_dir=engine_cache, reload_interval_s=0))
    try:
        image = png(images(1, seed=6)[0].round())

        def labels() -> list[str]:
            answer = httpx.post(
                f"{server.url}/v2/models/pets/classify?top_k=2", content=image, headers={"Content-Type": "image/png"}
            )
            assert answer.status_code == 200, answer.text
            return sorted(item["label"] for item in answer.json()["predictions"][0])

        assert labels() == ["cat", "dog"]
        save_model(build_head(3), own / "head" / "2", "model.keras")
        (own / "head" / "2" / "labels.txt").write_text("fox\nowl\n")  # a version's own labels win
        loaded = httpx.post(f"{server.url}/v2/repository/models/head/load", timeout=120)
        assert loaded.status_code == 200, loaded.text
        assert labels() == ["fox", "owl"]  # no poll: the load connected the pipeline again
        x = images(2, seed=7)
        np.testing.assert_allclose(scores(infer(server.url, "pets", x)), reference(own, x, "head", 2), atol=1e-5)
    finally:
        server.stop()


def test_steps_load_on_demand_under_a_memory_budget(repo: Path, engine_cache: Path) -> None:
    settings = Settings(
        model_repository=repo, engine_cache_dir=engine_cache, reload_interval_s=0, model_memory_budget="2GB",
        models="base,head,pets",
    )  # fmt: skip
    server = start_server(settings)
    try:
        states = {row["name"]: row["state"] for row in httpx.post(f"{server.url}/v2/repository/index").json()}
        assert states == {"base": "UNAVAILABLE", "head": "UNAVAILABLE", "pets": "UNAVAILABLE"}
        x = images(2, seed=5)
        np.testing.assert_allclose(scores(infer(server.url, "pets", x)), reference(repo, x), atol=1e-5)
        states = {row["name"]: row["state"] for row in httpx.post(f"{server.url}/v2/repository/index").json()}
        assert states == {"base": "READY", "head": "READY", "pets": "READY"}
        unloaded = httpx.post(f"{server.url}/v2/repository/models/head/unload")
        assert unloaded.status_code == 200, unloaded.text
        started = time.monotonic()
        np.testing.assert_allclose(scores(infer(server.url, "pets", x)), reference(repo, x), atol=1e-5)
        assert time.monotonic() - started < 60  # the step loaded again, on demand, for the request
    finally:
        server.stop()


def test_the_command_line_lists_pipelines_and_exports_their_steps_only(repo: Path, engine_cache: Path) -> None:
    command = [sys.executable, "-m", "layerserve"]
    listed = subprocess.run([*command, "models", str(repo)], capture_output=True, text=True, check=True)
    assert "  pipeline: base (pool) -> head (its output)" in listed.stdout.splitlines()
    exported = subprocess.run(
        [*command, "export", str(repo), "--engine-cache-dir", str(engine_cache)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stdout + exported.stderr
    lines = exported.stdout.splitlines()
    assert any(line.startswith("pets") and "a pipeline: nothing to export (its steps are base, head)" in line
               for line in lines), lines  # fmt: skip


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("pipeline:\n  - {model: a, input: x}\n", "step 1 takes the pipeline's inputs: it names no input"),
        ("pipeline:\n  - {model: a}\ninput: image\nmax_delay_ms: 5\n",
         "a pipeline takes input, max_delay_ms from its first step's model"),
        ("pipeline: []\n", "at least one step"),
        ("pipeline:\n  - {model: a, outputs: y}\n", "key 'pipeline.0.outputs': unknown key"),
        ("pipeline:\n  - {model: ../a}\n", "invalid model name '../a'"),
        ("pipeline:\n  - {model: a}\ncache: true\n", "a pipeline takes cache from its first step's model"),
    ],
)  # fmt: skip
def test_the_config_checks_a_pipeline(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "config.yaml").write_text(text)
    with pytest.raises(ConfigError, match=message):
        read_model_config(tmp_path / "config.yaml")


def test_circles_and_load_order() -> None:
    def pipeline(*models: str) -> ModelConfig:
        return ModelConfig(pipeline=[{"model": m} for m in models])

    configs = {"a": pipeline("b"), "b": pipeline("c", "a"), "c": ModelConfig(), "d": pipeline("d"), "e": pipeline("b")}
    assert find_circle("a", configs["a"].pipeline or [], configs.get) == (
        "step 1 (model 'b') leads back to a model on the way: a -> b -> a"
    )
    assert find_circle("d", configs["d"].pipeline or [], configs.get).startswith("step 1 (model 'd') leads back")
    assert find_circle("x", pipeline("c").pipeline or [], configs.get) == ""
    assert [pipeline_depth(m, configs.get) for m in ("c", "x")] == [0, 0]
    assert pipeline_depth("e", configs.get) > pipeline_depth("b", configs.get) > 0
    shared = {"a": pipeline("b", "c"), "c": pipeline("b"), "b": pipeline("leaf"), "leaf": ModelConfig()}
    assert [pipeline_depth(m, shared.get) for m in ("leaf", "b", "c", "a")] == [0, 1, 2, 3]
