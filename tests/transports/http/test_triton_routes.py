"""tritonclient.http (sync and aio) against Triton's extensions: statistics, model config, log settings,
load with a config, trace and shared memory (400: not supported), compressed bodies, and 405 with Allow."""

from __future__ import annotations

import gzip
import json
import logging
import shutil
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
import tritonclient.http.aio as triton_aio

from layerserve.settings import Settings
from tests.live_server import LiveServer, start_server
from tests.models import build_mlp, load_reference, save_model

BODY_LIMIT = 1_000_000


@pytest.fixture(scope="module")
def triton_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Byte-identical copies of one MLP (one ONNX export for all): `mlp` with a config.yaml, `counted` for the
    statistics alone, `reloadable` for loads with a config, `cached` with the feature cache."""
    repo = tmp_path_factory.mktemp("triton-extensions")
    first = save_model(build_mlp(1), repo / "mlp" / "1", "model.keras")
    for name in ("counted", "reloadable", "cached"):
        (repo / name / "1").mkdir(parents=True)
        shutil.copy(first, repo / name / "1" / "model.keras")
    config = "description: an mlp\nmax_batch_size: 8\nmax_delay_ms: 2\nmax_queue_size: 32\n"
    for name in ("mlp", "reloadable"):
        (repo / name / "config.yaml").write_text(config)
    (repo / "cached" / "config.yaml").write_text("cache: true\n")
    return repo


@pytest.fixture(scope="module")
def server(triton_repository: Path) -> Iterator[LiveServer]:
    """A server of its own (its counters and loads disturb no other test), with a 1 MB body limit."""
    cache = triton_repository.parent / f"{triton_repository.name}-onnx"
    live = start_server(
        Settings(model_repository=triton_repository, engine_cache_dir=cache, reload_interval_s=0,
                 max_body_bytes=BODY_LIMIT)
    )  # fmt: skip
    yield live
    live.stop()


@pytest.fixture(scope="module")
def reference(triton_repository: Path) -> Any:
    """The MLP every model of this repository is, loaded with Keras."""
    return load_reference(triton_repository, "mlp", 1)


@pytest.fixture
def client(server: LiveServer) -> Iterator[triton.InferenceServerClient]:
    with triton.InferenceServerClient(server.host_port) as client:
        yield client


def _input(rows: np.ndarray, binary: bool = True) -> triton.InferInput:
    x = triton.InferInput("x", list(rows.shape), "FP32")
    x.set_data_from_numpy(rows, binary_data=binary)
    return x


def _status(error: pytest.ExceptionInfo[triton.InferenceServerException]) -> str:
    return str(error.value.status())


# --- Statistics -----------------------------------------------------------------------------------------


def test_statistics_count_requests_rows_and_batches(
    client: triton.InferenceServerClient, rng: np.random.Generator
) -> None:
    started_ms = time.time() * 1000
    sizes = [1, 2, 3, 1, 2]
    for rows in sizes:
        client.infer("counted", [_input(rng.normal(size=(rows, 10)).astype(np.float32))])
    with pytest.raises(triton.InferenceServerException):  # refused while parsing: never reaches the model
        client.infer("counted", [_input(np.ones((1, 4), np.float32))])
    answer = client.get_inference_statistics(model_name="counted", model_version="1")
    (stats,) = answer["model_stats"]
    assert stats["name"] == "counted" and stats["version"] == "1"
    assert stats["inference_count"] == sum(sizes)
    assert 1 <= stats["execution_count"] <= len(sizes)
    inference = stats["inference_stats"]
    assert inference["success"]["count"] == len(sizes) and inference["success"]["ns"] > 0
    assert inference["fail"]["count"] == 0
    assert inference["queue"]["count"] == len(sizes)
    assert inference["compute_infer"]["count"] == len(sizes) and inference["compute_infer"]["ns"] > 0
    assert inference["cache_hit"]["count"] == inference["cache_miss"]["count"] == 0
    batches = stats["batch_stats"]
    assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in batches) == sum(sizes)
    assert sum(b["compute_infer"]["count"] for b in batches) == stats["execution_count"]
    assert started_ms <= stats["last_inference"] <= time.time() * 1000
    # Without a version: every ready version of the model; without a model: every model.
    assert client.get_inference_statistics(model_name="counted")["model_stats"] == [stats]
    every = client.get_inference_statistics()["model_stats"]
    assert [s["name"] for s in every] == ["cached", "counted", "mlp", "reloadable"]
    assert every[1] == stats


def test_statistics_count_feature_cache_hits_and_misses(client: triton.InferenceServerClient) -> None:
    rows = np.arange(30, dtype=np.float32).reshape(3, 10)
    for _ in range(3):
        client.infer("cached", [_input(rows)])
    (stats,) = client.get_inference_statistics("cached")["model_stats"]
    inference = stats["inference_stats"]
    assert inference["cache_miss"]["count"] == 1 and inference["cache_hit"]["count"] == 2
    assert inference["success"]["count"] == 3
    assert stats["inference_count"] == 3 and stats["execution_count"] == 1  # the hits never reach the model


def test_statistics_of_unknown_model_or_version(client: triton.InferenceServerClient) -> None:
    with pytest.raises(triton.InferenceServerException, match="unknown model 'nope'") as error:
        client.get_inference_statistics(model_name="nope")
    assert _status(error) == "404"
    with pytest.raises(triton.InferenceServerException, match="no loaded version 7"):
        client.get_inference_statistics(model_name="mlp", model_version="7")


@pytest.mark.anyio
async def test_statistics_and_config_with_the_aio_client(server: LiveServer, rng: np.random.Generator) -> None:
    async with triton_aio.InferenceServerClient(server.host_port) as client:
        before = (await client.get_inference_statistics("mlp", "1"))["model_stats"][0]
        rows = rng.normal(size=(4, 10)).astype(np.float32)
        x = triton_aio.InferInput("x", [4, 10], "FP32")
        x.set_data_from_numpy(rows)
        await client.infer("mlp", [x])
        after = (await client.get_inference_statistics("mlp", "1"))["model_stats"][0]
        assert after["inference_count"] == before["inference_count"] + 4
        assert after["inference_stats"]["success"]["count"] == before["inference_stats"]["success"]["count"] + 1
        assert after["execution_count"] == before["execution_count"] + 1
        assert (await client.get_model_config("mlp"))["max_batch_size"] == 8
        settings = await client.get_log_settings()
        assert set(settings) == {"log_file", "log_info", "log_warning", "log_error", "log_verbose_level",
                                 "log_format"}  # fmt: skip


# --- Model configuration --------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["", "1"])
def test_model_config_matches_the_signature(client: triton.InferenceServerClient, version: str) -> None:
    config = client.get_model_config("mlp", version)
    metadata = client.get_model_metadata("mlp")
    assert config["name"] == "mlp" and config["platform"] == metadata["platform"] == "keras_tensorflow"
    assert config["backend"] == ("onnxruntime" if metadata["engine"] == "onnx" else "keras")
    assert config["max_batch_size"] == 8
    for key, tensors in (("input", metadata["inputs"]), ("output", metadata["outputs"])):
        expected = [{"name": t["name"], "data_type": f"TYPE_{t['datatype']}", "dims": t["shape"][1:]} for t in tensors]
        assert config[key] == expected
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [10]}]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    assert config["dynamic_batching"]["default_queue_policy"]["max_queue_size"] == 32
    assert config["version_policy"] == {"latest": {"num_versions": 1}}
    assert config["parameters"]["description"] == {"string_value": "an mlp"}


# --- Log settings ---------------------------------------------------------------------------------------


def test_log_settings_round_trip_and_apply(client: triton.InferenceServerClient) -> None:
    root = logging.getLogger()
    original_level, original = root.level, client.get_log_settings()
    try:
        assert original["log_file"] == "" and original["log_format"] == "text"
        verbose = client.update_log_settings({"log_verbose_level": 1})
        assert verbose["log_verbose_level"] == 1 and verbose["log_info"] and root.level == logging.DEBUG
        assert client.get_log_settings() == verbose
        quiet = client.update_log_settings({"log_verbose_level": 0, "log_info": False})
        assert quiet == {**original, "log_verbose_level": 0, "log_info": False, "log_warning": True,
                         "log_error": True}  # fmt: skip
        assert root.level == logging.WARNING
        errors_only = client.update_log_settings({"log_warning": False})
        assert root.level == logging.ERROR and not errors_only["log_warning"] and errors_only["log_error"]
        assert client.update_log_settings({"log_info": True})["log_info"] and root.level == logging.INFO
    finally:
        root.setLevel(original_level)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"log_colour": True}, "unknown log setting 'log_colour'; settings: log_file, log_info"),
        ({"log_info": "yes"}, "log setting 'log_info' must be a bool, got 'yes'"),
        ({"log_verbose_level": -1}, "log setting 'log_verbose_level' must be a non-negative integer"),
        ({"log_verbose_level": True}, "log setting 'log_verbose_level' must be a non-negative integer"),
        ({"log_format": "xml"}, "log setting 'log_format' must be 'text' or 'json'"),
        ({"log_file": "/tmp/elsewhere.log"}, "log setting 'log_file' is fixed at start"),
    ],
)
def test_bad_log_settings_are_400(client: triton.InferenceServerClient, settings: dict[str, Any], message: str) -> None:
    level = logging.getLogger().level
    with pytest.raises(triton.InferenceServerException, match=message) as error:
        client.update_log_settings(settings)
    assert _status(error) == "400" and logging.getLogger().level == level


def test_trace_settings_are_a_clear_400(client: triton.InferenceServerClient) -> None:
    for call in (
        client.get_trace_settings,
        lambda: client.get_trace_settings(model_name="mlp"),
        lambda: client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]}),
        lambda: client.update_trace_settings(model_name="mlp", settings={"trace_rate": "1"}),
    ):
        with pytest.raises(triton.InferenceServerException, match="it sends OpenTelemetry traces") as error:
            call()
        assert _status(error) == "400"


# --- Load with a config ---------------------------------------------------------------------------------


def test_load_with_config_overrides_config_yaml_until_a_load_without(
    client: triton.InferenceServerClient, reference: Any
) -> None:
    client.load_model("reloadable", config=json.dumps({"max_batch_size": 2, "description": "overridden"}))
    config = client.get_model_config("reloadable")
    assert config["max_batch_size"] == 2 and config["parameters"]["description"]["string_value"] == "overridden"
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000  # config.yaml's, not overridden
    assert client.get_model_metadata("reloadable")["batching"]["max_batch_size"] == 2
    rows = np.linspace(-1, 1, 50, dtype=np.float32).reshape(5, 10)
    result = client.infer("reloadable", [_input(rows)])
    np.testing.assert_allclose(result.as_numpy("probs"), np.asarray(reference(rows)), atol=1e-5)
    client.load_model("reloadable")
    assert client.get_model_config("reloadable")["max_batch_size"] == 8


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            json.dumps({"max_batch_sise": 2}),
            "config key 'max_batch_sise' is not supported; supported keys: description,",
        ),
        (json.dumps({"name": "reloadable"}), "config key 'name' is not supported; supported keys: .*max_batch_size"),
        (json.dumps({"max_batch_size": 0}), "key 'max_batch_size': Input should be greater than or equal to 1"),
        ("[1, 2]", "load parameter 'config' must be a JSON object, got list"),
        ("{not json", "load parameter 'config' is not valid JSON"),
    ],
)
def test_load_with_a_bad_config_is_400_and_changes_nothing(
    client: triton.InferenceServerClient, config: str, message: str
) -> None:
    with pytest.raises(triton.InferenceServerException, match=message) as error:
        client.load_model("reloadable", config=config)
    assert _status(error) == "400"
    assert client.get_model_config("reloadable")["max_batch_size"] == 8
    assert client.is_model_ready("reloadable")


def test_load_with_files_is_400(server: LiveServer) -> None:
    body = {"parameters": {"config": "{}", "file:1/model.keras": "UEs="}}  # Triton's override files
    answer = httpx.post(f"{server.url}/v2/repository/models/reloadable/load", json=body)
    assert answer.status_code == 400
    assert answer.json() == {
        "error": "load parameter 'file:1/model.keras' is not supported; the only parameter is 'config'"
    }


# --- Shared memory --------------------------------------------------------------------------------------


def test_shared_memory_routes_say_not_supported(client: triton.InferenceServerClient, server: LiveServer) -> None:
    for call in (
        lambda: client.register_system_shared_memory("region", "/key", 64),
        client.get_system_shared_memory_status,
        lambda: client.get_system_shared_memory_status("region"),
        client.unregister_system_shared_memory,
        lambda: client.unregister_system_shared_memory("region"),
        client.get_cuda_shared_memory_status,
        lambda: client.register_cuda_shared_memory("region", b"handle", 0, 64),
        lambda: client.unregister_cuda_shared_memory("region"),
    ):
        with pytest.raises(triton.InferenceServerException, match="shared memory is not supported") as error:
            call()
        assert _status(error) == "400"
    answer = httpx.post(f"{server.url}/v2/cudasharedmemory/unregister")
    assert answer.status_code == 400 and "send tensors in the request body" in answer.json()["error"]


def test_infer_with_a_shared_memory_input_or_output_is_400(client: triton.InferenceServerClient) -> None:
    output = triton.InferRequestedOutput("probs")
    output.set_shared_memory("region", 12)
    with pytest.raises(triton.InferenceServerException, match="output 'probs': shared memory") as error:
        client.infer("mlp", [_input(np.ones((1, 10), np.float32))], outputs=[output])
    assert _status(error) == "400"
    x = triton.InferInput("x", [1, 10], "FP32")
    x.set_shared_memory("region", 40)
    with pytest.raises(triton.InferenceServerException, match=r"input 'x': shared memory .* not supported"):
        client.infer("mlp", [x])


# --- Compression ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("request_compression", [None, "gzip", "deflate"])
@pytest.mark.parametrize("response_compression", [None, "gzip", "deflate"])
@pytest.mark.parametrize("binary", [True, False])
def test_compressed_requests_and_answers_equal_keras(
    client: triton.InferenceServerClient,
    reference: Any,
    request_compression: str | None,
    response_compression: str | None,
    binary: bool,
) -> None:
    rows = np.random.default_rng(3).normal(size=(200, 10)).astype(np.float32)  # answers well over 1 KB
    result = client.infer(
        "mlp",
        [_input(rows, binary)],
        outputs=[triton.InferRequestedOutput("probs", binary_data=binary)],
        request_compression_algorithm=request_compression,
        response_compression_algorithm=response_compression,
    )
    np.testing.assert_allclose(result.as_numpy("probs"), np.asarray(reference(rows)), atol=1e-5)


def test_a_large_compressed_body_within_the_limit(client: triton.InferenceServerClient, reference: Any) -> None:
    rows = np.random.default_rng(5).normal(size=(10_000, 10)).astype(np.float32)  # 400 KB, hardly compressible
    result = client.infer("mlp", [_input(rows)], request_compression_algorithm="gzip")
    np.testing.assert_allclose(result.as_numpy("probs"), np.asarray(reference(rows)), atol=1e-5)


@pytest.mark.anyio
@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
async def test_compression_with_the_aio_client(server: LiveServer, reference: Any, algorithm: str) -> None:
    rows = np.random.default_rng(4).normal(size=(100, 10)).astype(np.float32)
    async with triton_aio.InferenceServerClient(server.host_port) as client:
        x = triton_aio.InferInput("x", [100, 10], "FP32")
        x.set_data_from_numpy(rows)
        result = await client.infer(
            "mlp", [x], request_compression_algorithm=algorithm, response_compression_algorithm=algorithm
        )
    np.testing.assert_allclose(result.as_numpy("probs"), np.asarray(reference(rows)), atol=1e-5)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_binary_answers_are_compressed_with_the_uncompressed_header_length(server: LiveServer, encoding: str) -> None:
    rows = np.ones((300, 10), np.float32)
    header = json.dumps({"inputs": [{"name": "x", "shape": [300, 10], "datatype": "FP32",
                                     "parameters": {"binary_data_size": rows.nbytes}}],
                         "parameters": {"binary_data_output": True}}).encode()  # fmt: skip
    with httpx.Client(headers={"Accept-Encoding": encoding}) as http:
        answer = http.post(
            f"{server.url}/v2/models/mlp/infer",
            content=header + rows.tobytes(),
            headers={"Inference-Header-Content-Length": str(len(header))},
        )
    assert answer.status_code == 200 and answer.headers["content-encoding"] == encoding
    length = int(answer.headers["inference-header-content-length"])
    decoded = json.loads(answer.content[:length])  # httpx decompressed it: the length counts the plain header
    assert decoded["outputs"][0]["parameters"]["binary_data_size"] == 300 * 3 * 4
    assert len(answer.content) == length + 300 * 3 * 4


def _infer_body(rows: int) -> bytes:
    return json.dumps(
        {"inputs": [{"name": "x", "shape": [rows, 10], "datatype": "FP32", "data": [0.5] * rows * 10}]}
    ).encode()


@pytest.mark.parametrize(("encoding", "compress"), [("gzip", gzip.compress), ("deflate", zlib.compress)])
def test_a_compression_bomb_is_413_and_the_server_serves_on(server: LiveServer, encoding: str, compress: Any) -> None:
    bomb = compress(b" " * (BODY_LIMIT * 20))  # 20 MB of blanks after a few KB
    assert len(bomb) < 64 * 1024
    answer = httpx.post(f"{server.url}/v2/models/mlp/infer", content=bomb, headers={"Content-Encoding": encoding})
    assert answer.status_code == 413
    assert answer.json() == {"error": f"decompressed body is over the limit of {BODY_LIMIT} bytes"}
    fine = httpx.post(f"{server.url}/v2/models/mlp/infer", content=compress(_infer_body(2)),
                      headers={"Content-Encoding": encoding})  # fmt: skip
    assert fine.status_code == 200 and len(fine.json()["outputs"][0]["data"]) == 6


@pytest.mark.parametrize(
    ("encoding", "body", "status", "message"),
    [
        ("br", b"anything", 415, "Content-Encoding 'br' is not supported; expected gzip, deflate or identity"),
        ("gzip", b"not gzip at all", 400, "the body is not valid gzip data"),
        ("gzip", gzip.compress(_infer_body(1))[:-12], 400, "the gzip body is truncated"),
        ("deflate", gzip.compress(_infer_body(1)), 400, "the body is not valid deflate data"),
    ],
)
def test_bad_content_encodings(server: LiveServer, encoding: str, body: bytes, status: int, message: str) -> None:
    answer = httpx.post(f"{server.url}/v2/models/mlp/infer", content=body, headers={"Content-Encoding": encoding})
    assert answer.status_code == status and answer.json()["error"].startswith(message)


# --- 405 ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("DELETE", "/v2", {"GET", "HEAD"}),
        ("POST", "/v2/health/live", {"GET", "HEAD"}),
        ("GET", "/v2/models/mlp/infer", {"POST"}),
        ("PUT", "/v2/logging", {"GET", "HEAD", "POST"}),
        ("GET", "/v2/repository/index", {"POST"}),
    ],
)
def test_a_wrong_method_is_405_with_allow(server: LiveServer, method: str, path: str, allowed: set[str]) -> None:
    answer = httpx.request(method, f"{server.url}{path}")
    assert answer.status_code == 405
    assert {m.strip() for m in answer.headers["allow"].split(",")} == allowed
    message = answer.json()["error"]
    assert message.startswith(f"method {method} is not allowed on {path}; allowed: "), message
    assert {m.strip() for m in message.split("allowed: ")[1].split(",")} == allowed
