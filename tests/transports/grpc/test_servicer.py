"""The gRPC door with real clients: tritonclient.grpc (sync, aio, streams), grpc health and reflection."""

from __future__ import annotations

import asyncio
import queue
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import keras
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.grpc.aio as tga
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from layerserve.settings import Settings
from tests.conftest import ADMIN_TOKEN, API_TOKEN, SLOW_ROWS
from tests.demo.test_demo import chelsea_batch, package_file
from tests.live_server import (
    LiveServer,
    free_port,
    metric_sample,
    server_log,
    start_server,
    start_server_process,
    wait_process_ready,
    wait_until,
)
from tests.models import build_slow, load_reference, save_model

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
API = {"authorization": f"Bearer {API_TOKEN}"}
REST_API = {"Authorization": f"Bearer {API_TOKEN}"}


@pytest.fixture
def client(server: LiveServer) -> Iterator[tg.InferenceServerClient]:
    with tg.InferenceServerClient(server.grpc_target) as triton:
        yield triton


def _mlp_input(rows: int, seed: int = 0) -> tuple[np.ndarray, tg.InferInput]:
    x = np.random.default_rng(seed).normal(size=(rows, 10)).astype(np.float32)
    tensor = tg.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return x, tensor


def _code(error: InferenceServerException) -> str:
    return str(error.status())


def test_health_metadata_health_service_and_reflection(client: tg.InferenceServerClient, server: LiveServer) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("mlp") and client.is_model_ready("mlp", "1")
    assert not client.is_model_ready("corrupt") and not client.is_model_ready("nope")
    assert client.get_server_metadata().name == "layerserve"
    meta = client.get_model_metadata("multi")
    assert [(i.name, i.datatype, list(i.shape)) for i in meta.inputs] == [
        ("features", "FP32", [-1, 4]), ("tokens", "INT32", [-1, 3])
    ]  # fmt: skip
    assert client.get_model_metadata("mlp", "1").versions == ["1", "2"]
    config = client.get_model_config("mlp").config
    assert config.name == "mlp" and config.max_batch_size == 16 and list(config.input[0].dims) == [10]
    with grpc.insecure_channel(server.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            answer = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        asked = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        listed = next(iter(reflection.ServerReflectionInfo(asked)))
        names = {service.name for service in listed.list_services_response.service}
        assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= names


def test_infer_equals_keras_and_rest(client: tg.InferenceServerClient, server: LiveServer, repository: Path) -> None:
    x, tensor = _mlp_input(5)
    result = client.infer("mlp", [tensor], model_version="1", request_id="r1")
    assert result.get_response().id == "r1" and result.get_response().model_version == "1"
    expected = np.asarray(load_reference(repository, "mlp", 1)(x))
    np.testing.assert_allclose(result.as_numpy("probs"), expected, atol=1e-5)
    rest = httpx.post(f"{server.url}/v2/models/mlp/versions/1/infer", json={
        "inputs": [{"name": "x", "shape": [5, 10], "datatype": "FP32", "data": x.ravel().tolist()}]
    }).json()  # fmt: skip
    np.testing.assert_array_equal(result.as_numpy("probs").ravel(), np.asarray(rest["outputs"][0]["data"], np.float32))


def test_requests_of_one_shape_each_get_their_own_answer(client: tg.InferenceServerClient, repository: Path) -> None:
    # The second and later requests of one shape take their arrays from the message (InferTemplates).
    reference = load_reference(repository, "mlp", 2)
    for seed in range(4):
        x, tensor = _mlp_input(3, seed)
        np.testing.assert_allclose(client.infer("mlp", [tensor]).as_numpy("probs"), reference(x), atol=1e-5)
    x = np.repeat(_mlp_input(1, 9)[0], 200, axis=0)  # compressible (grpc sends what does not shrink as it is)
    tensor = tg.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    for algorithm in ("gzip", "deflate"):  # compressed requests are inflated
        answer = client.infer("mlp", [tensor], compression_algorithm=algorithm)
        np.testing.assert_allclose(answer.as_numpy("probs"), reference(x), atol=1e-5)


def test_unknown_methods_and_bad_messages_get_their_status(server: LiveServer) -> None:
    with grpc.insecure_channel(server.grpc_target) as channel:
        for path, message, code in (
            ("/inference.GRPCInferenceService/Nope", b"", grpc.StatusCode.UNIMPLEMENTED),
            ("/nope.Service/ModelInfer", b"", grpc.StatusCode.UNIMPLEMENTED),
            ("/inference.GRPCInferenceService/ModelInfer", b"\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT),
            ("/inference.GRPCInferenceService/ModelMetadata", b"\x0a\x05", grpc.StatusCode.INVALID_ARGUMENT),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                channel.unary_unary(path)(message)
            assert caught.value.code() == code, (path, caught.value.details())
        # The connection still serves.
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as caught:
            health.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_outputs_in_requested_order_layers_and_cuts(client: tg.InferenceServerClient, repository: Path) -> None:
    rng = np.random.default_rng(3)
    features = rng.normal(size=(2, 4)).astype(np.float32)
    tokens = rng.integers(0, 10, size=(2, 3)).astype(np.int32)
    inputs = [tg.InferInput("features", [2, 4], "FP32"), tg.InferInput("tokens", [2, 3], "INT32")]
    inputs[0].set_data_from_numpy(features)
    inputs[1].set_data_from_numpy(tokens)
    wanted = ["probs", "joined", "regression"]
    result = client.infer("multi", inputs, outputs=[tg.InferRequestedOutput(name) for name in wanted])
    assert [o.name for o in result.get_response().outputs] == wanted
    model = load_reference(repository, "multi", 1)
    probe = keras.Model(model.inputs, [model.get_layer(n).output for n in wanted])
    for name, expected in zip(wanted, probe([features, tokens]), strict=True):
        np.testing.assert_allclose(result.as_numpy(name), np.asarray(expected), atol=1e-5)
    # A cut: the layer `joined` fed as an input, the graph run from there.
    joined = tg.InferInput("joined", [2, 10], "FP32")
    joined.set_data_from_numpy(result.as_numpy("joined"))
    cut = client.infer("multi", [joined], outputs=[tg.InferRequestedOutput("probs")])
    np.testing.assert_allclose(cut.as_numpy("probs"), result.as_numpy("probs"), atol=1e-5)


def test_typed_contents_and_classification(server: LiveServer, repository: Path) -> None:
    x = np.random.default_rng(4).normal(size=(2, 10)).astype(np.float32)
    request = service_pb2.ModelInferRequest(model_name="mlp", model_version="2")
    request.inputs.add(name="x", datatype="FP32", shape=[2, 10]).contents.fp32_contents.extend(x.ravel().tolist())
    request.outputs.add(name="probs")
    with grpc.insecure_channel(server.grpc_target) as channel:
        answer = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    assert answer.outputs[0].name == "probs" and list(answer.outputs[0].shape) == [2, 3]
    probs = np.frombuffer(answer.raw_output_contents[0], "<f4").reshape(2, 3)
    np.testing.assert_allclose(probs, np.asarray(load_reference(repository, "mlp", 2)(x)), atol=1e-5)
    with tg.InferenceServerClient(server.grpc_target) as client:
        tensor = tg.InferInput("x", [2, 10], "FP32")
        tensor.set_data_from_numpy(x)
        top = client.infer("mlp", [tensor], "2", outputs=[tg.InferRequestedOutput("probs", class_count=2)])
    best = top.as_numpy("probs")
    assert best.shape == (2, 2)
    for row, scores in zip(best, probs, strict=True):
        score, index = row[0].decode().split(":")[:2]
        assert int(index) == int(np.argmax(scores)) and abs(float(score) - scores.max()) < 1e-5


def test_errors_map_to_status_codes(client: tg.InferenceServerClient) -> None:
    _, tensor = _mlp_input(1)
    cases: list[tuple[str, list[tg.InferInput], str]] = [("nope", [tensor], "StatusCode.NOT_FOUND")]
    wrong_type = tg.InferInput("x", [1, 10], "FP64")
    wrong_type.set_data_from_numpy(np.zeros((1, 10)))
    wrong_shape = tg.InferInput("x", [1, 9], "FP32")
    wrong_shape.set_data_from_numpy(np.zeros((1, 9), np.float32))
    unknown = tg.InferInput("y", [1, 10], "FP32")
    unknown.set_data_from_numpy(np.zeros((1, 10), np.float32))
    invalid = "StatusCode.INVALID_ARGUMENT"
    cases += [("mlp", [wrong_type], invalid), ("mlp", [wrong_shape], invalid), ("mlp", [unknown], invalid)]
    cases += [("corrupt", [tensor], "StatusCode.UNAVAILABLE")]
    for model, inputs, code in cases:
        with pytest.raises(InferenceServerException) as caught:
            client.infer(model, inputs)
        assert _code(caught.value) == code, (model, caught.value.message())
    with pytest.raises(InferenceServerException) as caught:
        client.infer("mlp", [tensor], model_version="0")
    assert _code(caught.value) == "StatusCode.INVALID_ARGUMENT" and "positive integer" in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        client.infer("mlp", [tensor], outputs=[tg.InferRequestedOutput("nope")])
    assert "unknown output 'nope'" in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        client.get_system_shared_memory_status()
    assert _code(caught.value) == "StatusCode.UNIMPLEMENTED" and "shared memory" in caught.value.message()


def test_stream_answers_every_request(server: LiveServer, repository: Path) -> None:
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    reference = load_reference(repository, "mlp", 2)
    with tg.InferenceServerClient(server.grpc_target) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        sent = {}
        for i in range(6):
            x, tensor = _mlp_input(i + 1, seed=i)
            sent[f"s{i}"] = x
            client.async_stream_infer("mlp", [tensor], request_id=f"s{i}")
        _, bad = _mlp_input(1)
        client.async_stream_infer("nope", [bad], request_id="bad")
        answers = [results.get(timeout=60) for _ in range(7)]
        client.stop_stream()
    errors = [error for result, error in answers if error is not None]
    assert len(errors) == 1 and "unknown model 'nope'" in errors[0].message()
    for result, error in answers:
        if error is None:
            x = sent[result.get_response().id]
            np.testing.assert_allclose(result.as_numpy("probs"), np.asarray(reference(x)), atol=1e-5)
    assert {r.get_response().id for r, e in answers if e is None} == set(sent)


def test_aio_client_infer_stream_and_statistics(server: LiveServer, repository: Path) -> None:
    reference = load_reference(repository, "mlp", 1)

    async def run() -> None:
        async with tga.InferenceServerClient(server.grpc_target) as client:
            before = (await client.get_inference_statistics("mlp", "1")).model_stats[0]
            x, _ = _mlp_input(3, seed=9)
            tensor = tga.InferInput("x", [3, 10], "FP32")
            tensor.set_data_from_numpy(x)
            result = await client.infer("mlp", [tensor], model_version="1")
            np.testing.assert_allclose(result.as_numpy("probs"), np.asarray(reference(x)), atol=1e-5)

            async def requests() -> Any:
                for i in range(3):
                    yield {"model_name": "mlp", "model_version": "1", "inputs": [tensor], "request_id": f"a{i}"}

            seen = []
            async for answer, error in client.stream_infer(requests()):
                assert error is None
                np.testing.assert_allclose(answer.as_numpy("probs"), np.asarray(reference(x)), atol=1e-5)
                seen.append(answer.get_response().id)
                if len(seen) == 3:
                    break
            assert sorted(seen) == ["a0", "a1", "a2"]
            after = (await client.get_inference_statistics("mlp", "1")).model_stats[0]
            assert after.inference_stats.success.count == before.inference_stats.success.count + 4
            assert after.inference_count >= before.inference_count + 12

    asyncio.run(run())


def test_grpc_requests_are_counted_in_metrics(client: tg.InferenceServerClient, server: LiveServer) -> None:
    _, tensor = _mlp_input(1)
    client.infer("mlp", [tensor])
    text = httpx.get(f"{server.url}/metrics").text
    assert 'route="grpc.ModelInfer",status="OK"' in text


def _slow_input(rows: int) -> tg.InferInput:
    tensor = tg.InferInput("x", [rows, 16], "FP32")
    tensor.set_data_from_numpy(np.random.default_rng(rows).normal(size=(rows, 16)).astype(np.float32))
    return tensor


def _raises(code: str, call: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(InferenceServerException) as caught:
        call(*args, **kwargs)
    assert _code(caught.value) == code, caught.value.message()
    return str(caught.value.message())


def test_tokens(guarded_server: LiveServer) -> None:
    _, tensor = _mlp_input(1)
    with tg.InferenceServerClient(guarded_server.grpc_target) as client:
        assert client.is_server_live() and client.is_server_ready()  # health needs no token
        assert "API token" in _raises("StatusCode.UNAUTHENTICATED", client.infer, "mlp", [tensor])
        _raises("StatusCode.PERMISSION_DENIED", client.infer, "mlp", [tensor], headers={"authorization": "Bearer no"})
        assert client.infer("mlp", [tensor], headers=API).as_numpy("probs").shape == (1, 3)
        assert client.infer("mlp", [tensor], headers=ADMIN).as_numpy("probs").shape == (1, 3)
        assert "admin token" in _raises("StatusCode.UNAUTHENTICATED", client.get_model_repository_index)
        _raises("StatusCode.PERMISSION_DENIED", client.get_model_repository_index, headers=API)
        _raises("StatusCode.PERMISSION_DENIED", client.unload_model, "mlp", headers=API)


def test_repository_index_unload_load(guarded_server: LiveServer) -> None:
    with tg.InferenceServerClient(guarded_server.grpc_target) as client:
        index = client.get_model_repository_index(headers=ADMIN)
        assert {(m.name, m.version, m.state) for m in index.models} == {("mlp", "1", "READY"), ("slow", "1", "READY")}
        client.unload_model("mlp", headers=ADMIN)
        assert not client.is_model_ready("mlp", headers=API)
        _, tensor = _mlp_input(1)
        _raises("StatusCode.UNAVAILABLE", client.infer, "mlp", [tensor], headers=API)
        client.load_model("mlp", headers=ADMIN, config='{"max_batch_size": 4}')
        assert client.is_model_ready("mlp", headers=API)
        assert client.get_model_config("mlp", headers=API).config.max_batch_size == 4
        message = _raises("StatusCode.INVALID_ARGUMENT", client.load_model, "mlp", headers=ADMIN, config="[1]")
        assert "must be a JSON object" in message
        _raises("StatusCode.NOT_FOUND", client.unload_model, "nope", headers=ADMIN)
        client.load_model("mlp", headers=ADMIN)


def test_message_size_limit_and_deadlines(guarded_server: LiveServer) -> None:
    with tg.InferenceServerClient(guarded_server.grpc_target) as client:
        _, big = _mlp_input(30_000)  # 1.2 MB, over the 1 MB body limit
        _raises("StatusCode.RESOURCE_EXHAUSTED", client.infer, "mlp", [big], headers=API)
        message = _raises("StatusCode.RESOURCE_EXHAUSTED", client.infer, "slow", [_slow_input(300)], headers=API)
        assert "over the message size limit of 1048576 bytes" in message  # 300 x 1024 floats answered: 1.2 MB
        _raises("StatusCode.DEADLINE_EXCEEDED", client.infer, "slow", [_slow_input(SLOW_ROWS)], headers=API,
                client_timeout=0.05)  # fmt: skip
        message = _raises("StatusCode.DEADLINE_EXCEEDED", client.infer, "slow", [_slow_input(SLOW_ROWS)],
                          headers=API, parameters={"timeout_ms": 1})  # fmt: skip
        assert "timed out" in message


def _statistics(client: tg.InferenceServerClient) -> tuple[int, int]:
    stats = client.get_inference_statistics("slow", "1", headers=API).model_stats[0]
    return stats.execution_count, stats.inference_count


def test_cancelled_call_is_never_computed(guarded_server: LiveServer) -> None:
    url = guarded_server.url

    def batches() -> float:
        return metric_sample(url, "layerserve_batch_size_count", REST_API, model="slow")

    def queued() -> Any:
        return httpx.get(f"{url}/v2/models/slow", headers=REST_API).json()["batching"]["queued"]

    def computed() -> float:
        return metric_sample(url, "layerserve_compute_seconds_count", REST_API, model="slow")

    wait_until(lambda: computed() == batches(), "the slow model is idle (calls of earlier tests are done)")

    def cancels_seen() -> float:
        return metric_sample(url, "layerserve_requests_total", REST_API, route="grpc.ModelInfer", status="CANCELLED")

    cancelled, seen = metric_sample(url, "layerserve_requests_cancelled_total", REST_API, model="slow"), cancels_seen()
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    top = [tg.InferRequestedOutput("d5", class_count=1)]  # a small answer from a big batch
    with tg.InferenceServerClient(guarded_server.grpc_target) as client:
        executions, rows = _statistics(client)
        started = batches()
        client.async_infer("slow", [_slow_input(SLOW_ROWS)], lambda result, error: answers.put((result, error)),
                           outputs=top, headers=API)  # fmt: skip
        wait_until(lambda: batches() > started, "the slow request is computed")
        call = client.async_infer("slow", [_slow_input(1)], lambda result, error: answers.put((result, error)),
                                  headers=API)  # fmt: skip
        wait_until(lambda: queued() == 1, "the second request waits in the queue")
        call.cancel()
        wait_until(lambda: cancels_seen() > seen, "the server saw the cancel")
        (slow, no_error), (nothing, error) = sorted((answers.get(timeout=120), answers.get(timeout=120)),
                                                    key=lambda answer: answer[1] is not None)  # fmt: skip
        assert no_error is None and nothing is None and error.status() == "StatusCode.CANCELLED"
        assert slow.as_numpy("d5").shape == (SLOW_ROWS, 1)
        assert _statistics(client) == (executions + 1, rows + SLOW_ROWS)  # the cancelled one never ran
    assert metric_sample(url, "layerserve_requests_cancelled_total", REST_API, model="slow") == cancelled + 1
    assert queued() == 0


@pytest.fixture(scope="module")
def demo_grpc_server(demo_repository: Path, demo_engine_cache: Path) -> Iterator[LiveServer]:
    settings = Settings(model_repository=demo_repository, engine_cache_dir=demo_engine_cache)
    live = start_server(settings, grpc=True)
    yield live
    live.stop()


def test_encoded_images_as_bytes_equal_keras_and_rest(demo_grpc_server: LiveServer, demo_repository: Path) -> None:
    import tritonclient.http as th

    encoded = np.array([package_file("skimage", "data/chelsea.png").read_bytes()], dtype=object)
    with tg.InferenceServerClient(demo_grpc_server.grpc_target) as client:
        meta = client.get_model_metadata("efficientnet_lite0")
        (name,), (output,) = [i.name for i in meta.inputs], [o.name for o in meta.outputs]
        tensor = tg.InferInput(name, [1], "BYTES")
        tensor.set_data_from_numpy(encoded)
        scores = client.infer("efficientnet_lite0", [tensor]).as_numpy(output)
        top = client.infer("efficientnet_lite0", [tensor], outputs=[tg.InferRequestedOutput(output, class_count=3)])
    model = keras.saving.load_model(demo_repository / "efficientnet_lite0" / "1" / "model.keras")
    np.testing.assert_allclose(scores, np.asarray(model(chelsea_batch())), atol=1e-3)
    rest_input = th.InferInput(name, [1], "BYTES")
    rest_input.set_data_from_numpy(encoded)
    rest = th.InferenceServerClient(demo_grpc_server.host_port).infer("efficientnet_lite0", [rest_input])
    np.testing.assert_array_equal(scores, rest.as_numpy(output))
    best = top.as_numpy(output)[0][0].decode().split(":")
    assert best[1:] == ["285", "Egyptian cat"]
    corrupt = tg.InferInput(name, [1], "BYTES")
    corrupt.set_data_from_numpy(np.array([b"\x89PNG not really"], dtype=object))
    with tg.InferenceServerClient(demo_grpc_server.grpc_target) as client:
        message = _raises("StatusCode.INVALID_ARGUMENT", client.infer, "efficientnet_lite0", [corrupt])  # a 422
    assert "image" in message


def test_two_workers_serve_grpc_on_one_port(repository: Path, tmp_path: Path) -> None:
    port, grpc_port = free_port(), free_port()
    process = start_server_process(repository, tmp_path / "cache", port, "--workers", "2", "--grpc-port",
                                   str(grpc_port), "--engine", "keras")  # fmt: skip
    try:
        wait_process_ready(f"http://127.0.0.1:{port}", process, server_log(repository))
        reference = load_reference(repository, "mlp", 2)
        for seed in range(8):  # a new connection each time: the kernel spreads them over the workers
            with tg.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
                assert client.is_server_ready()
                x, tensor = _mlp_input(2, seed)
                np.testing.assert_allclose(client.infer("mlp", [tensor]).as_numpy("probs"), reference(x), atol=1e-5)
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_sigterm_lets_a_grpc_call_in_flight_finish(tmp_path: Path) -> None:
    save_model(build_slow(), tmp_path / "repo" / "slow" / "1", "model.keras")
    port, grpc_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_server_process(tmp_path / "repo", tmp_path / "cache", port, "--grpc-port", str(grpc_port))
    try:
        wait_process_ready(url, process, server_log(tmp_path / "repo"))
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        with tg.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
            started = metric_sample(url, "layerserve_batch_size_count", model="slow")
            client.async_infer("slow", [_slow_input(SLOW_ROWS)], lambda result, error: answers.put((result, error)),
                               outputs=[tg.InferRequestedOutput("d5", class_count=1)])  # fmt: skip
            wait_until(lambda: metric_sample(url, "layerserve_batch_size_count", model="slow") > started,
                       "the slow call is computed")  # fmt: skip
            process.send_signal(signal.SIGTERM)
            result, error = answers.get(timeout=120)
        assert error is None and result.as_numpy("d5").shape == (SLOW_ROWS, 1)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_a_single_worker_refuses_a_taken_grpc_port(tmp_path: Path) -> None:
    import socket

    from layerserve.server import Server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = Settings(model_repository=tmp_path, grpc_port=taken.getsockname()[1])

        async def start() -> None:
            door = Server(settings).grpc
            assert door is not None
            await door.start()

        with pytest.raises(RuntimeError, match="Failed to bind"):
            asyncio.run(start())
