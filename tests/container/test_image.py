"""The container image, built from the repository's Containerfile on a Debian base made here, run with the demo
repository mounted read-only under a memory limit, and checked from the host against a server in this process:
readiness and the HEALTHCHECK, V2 over HTTP and gRPC, /metrics, a training job, and SIGTERM with a request in
flight."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from corpora import rotten_tomatoes
from layerserve.settings import Settings
from tests.container.podman import (
    Podman,
    build_inputs_digest,
    host_state_restored,
    missing_tools,
    remove_stale_storages,
)
from tests.live_server import LiveServer, free_port, metric_sample, start_server, wait_until
from tests.models import build_slow, save_model
from tests.training.test_tokenizer import reference_scores

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]  # a first build downloads about 700 MB of wheels

IMAGE = "localhost/layerserve-test:latest"
IMAGE_UID = 10001  # the image's user (Containerfile)
MEMORY_LIMIT = "1g"  # a warm start of the demo repository, and a training job, fit in it
HTTP_PORT, GRPC_PORT = 9000, 9001  # inside the container, set through LAYERSERVE_* (the image's defaults: 8000, 8001)
GRACE_S = 60
SLOW_ROWS = 4000  # rows of one request that keeps the slow model busy for a while
TOKENS = {"inputs": [{"name": "tokens", "shape": [2, 64], "datatype": "INT32", "data": list(range(128))}]}


@dataclass
class Container:
    """A running container of the image: its name and its doors as the host reaches them."""

    name: str
    url: str
    grpc_target: str
    ready_after_s: float


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    """Podman with the image built; its storage (the base image and the build's layers) is kept between runs in a
    folder keyed by the Containerfile's, the constraints' and pyproject.toml's digest."""
    problems = missing_tools() + ([] if os.geteuid() == 0 else ["root (rootful podman)"])
    if problems:
        message = f"the container test needs {', '.join(problems)}: scripts/install --dev installs them as root"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    cache_parent = tmp_path_factory.getbasetemp().parent
    storage = cache_parent / f"layerserve-container-{build_inputs_digest()}"
    remove_stale_storages(storage)
    with host_state_restored():
        engine = Podman(storage)
        try:
            work = tmp_path_factory.mktemp("podman")
            engine.make_base_image(work)
            engine.build(IMAGE, work / "build.log")
            yield engine
        finally:
            engine.close()


@pytest.fixture(scope="module")
def repository(demo_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo repository and a slow model, in a folder of its own (mounted read-only into the container)."""
    repo = tmp_path_factory.mktemp("container") / "models"
    shutil.copytree(demo_repository, repo)
    save_model(build_slow(), repo / "slow" / "1", "model.keras")
    (repo / "slow" / "config.yaml").write_text("max_batch_size: 1\n")
    repo.chmod(0o755)  # readable by the image's user, as the copied files are
    return repo


@pytest.fixture(scope="module")
def host_server(
    repository: Path, demo_engine_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """The reference: the same repository served in this process (it also fills the export cache the container
    starts warm from)."""
    settings = Settings(
        model_repository=repository, engine_cache_dir=demo_engine_cache, reload_interval_s=0,
        jobs_dir=tmp_path_factory.mktemp("host-jobs"),
    )  # fmt: skip
    live = start_server(settings, grpc=True)
    yield live
    live.stop()


def _writable_copy(source: Path, target: Path) -> Path:
    """A copy of `source` that the image's user owns."""
    shutil.copytree(source, target)
    for path in [target, *target.rglob("*")]:
        os.chown(path, IMAGE_UID, IMAGE_UID)
    return target


def _start(podman: Podman, name: str, models: Path, mode: str, cache: Path) -> Container:
    """Run the image's default command with `models` at /models (`mode`: ro or rw) and `cache` as its export cache;
    return once ready."""
    http, grpc = free_port(), free_port()
    podman.remove(name)
    started = time.monotonic()
    podman(
        "run", "--detach", "--name", name, "--memory", MEMORY_LIMIT, "--network", "slirp4netns",
        "--publish", f"127.0.0.1:{http}:{HTTP_PORT}", "--publish", f"127.0.0.1:{grpc}:{GRPC_PORT}",
        "--env", f"LAYERSERVE_PORT={HTTP_PORT}", "--env", f"LAYERSERVE_GRPC_PORT={GRPC_PORT}",
        "--env", f"LAYERSERVE_SHUTDOWN_TIMEOUT_S={GRACE_S}", "--env", "LAYERSERVE_RELOAD_INTERVAL_S=0.5",
        "--volume", f"{models}:/models:{mode}", "--volume", f"{cache}:/var/cache/layerserve", IMAGE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{http}"

    def is_ready() -> bool:
        state = podman("inspect", "--format", "{{.State.Running}}", name).stdout.strip()
        assert state == "true", podman("logs", name, check=False).stderr[-6000:]
        try:
            return httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(is_ready, f"container {name} is ready", timeout_s=240)
    return Container(name, url, f"127.0.0.1:{grpc}", time.monotonic() - started)


@pytest.fixture(scope="module")
def container(
    podman: Podman,
    repository: Path,
    host_server: LiveServer,
    demo_engine_cache: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Container]:
    """The image serving the repository mounted read-only, its export cache warm (a copy of the host server's)."""
    cache = _writable_copy(demo_engine_cache, tmp_path_factory.mktemp("container-cache") / "onnx")
    name = f"layerserve-test-{os.getpid()}"
    try:
        started = _start(podman, name, repository, "ro", cache)
        print(f"container start to ready: {started.ready_after_s:.1f} s (warm export cache)")
        yield started
    finally:
        podman.remove(name)


def _memory_file(podman: Podman, name: str, v1: str, v2: str) -> int:
    """A value of the container's memory cgroup, read inside it (cgroup v1 or v2)."""
    script = f"cat /sys/fs/cgroup/memory/{v1} 2>/dev/null || cat /sys/fs/cgroup/{v2}"
    return int(podman("exec", name, "sh", "-c", script).stdout.strip())


def test_the_image_serves_a_read_only_repository_within_its_memory_limit(
    podman: Podman, container: Container, host_server: LiveServer
) -> None:
    limit = _memory_file(podman, container.name, "memory.limit_in_bytes", "memory.max")
    assert limit == 1 << 30  # the cgroup limit is in force
    config = json.loads(podman("image", "inspect", IMAGE).stdout)[0]["Config"]
    assert config["User"] == "layerserve" and config["Cmd"] == ["layerserve", "serve", "/models"]
    assert set(config["ExposedPorts"]) == {"8000/tcp", "8001/tcp"}
    assert podman("healthcheck", "run", container.name, check=False).returncode == 0
    owner = podman("exec", container.name, "id", "-u").stdout.strip()
    assert owner == str(IMAGE_UID)

    answer = httpx.post(f"{container.url}/v2/models/token_classifier/infer", json=TOKENS, timeout=30)
    reference = httpx.post(f"{host_server.url}/v2/models/token_classifier/infer", json=TOKENS, timeout=30)
    assert answer.status_code == 200, answer.text
    np.testing.assert_allclose(answer.json()["outputs"][0]["data"], reference.json()["outputs"][0]["data"], atol=1e-6)
    for url in (container.url, host_server.url):
        assert httpx.get(f"{url}/v2/models/efficientnet_lite0", timeout=30).json()["engine"] == "onnx"

    cat = _cat_photo()
    classified = httpx.post(
        f"{container.url}/v2/models/efficientnet_lite0/classify", files={"image": ("cat.png", cat)}, timeout=60
    )
    assert classified.status_code == 200, classified.text
    assert classified.json()["predictions"][0][0]["label"] == "Egyptian cat"

    client = grpcclient.InferenceServerClient(container.grpc_target)
    try:
        tokens = grpcclient.InferInput("tokens", [2, 64], "INT32")
        tokens.set_data_from_numpy(np.arange(128, dtype=np.int32).reshape(2, 64))
        result = client.infer("token_classifier", [tokens])
    finally:
        client.close()
    np.testing.assert_allclose(result.as_numpy("scores").ravel(), reference.json()["outputs"][0]["data"], atol=1e-6)
    served = metric_sample(container.url, "layerserve_requests_total", model="token_classifier", status="200")
    assert served >= 1
    peak = _memory_file(podman, container.name, "memory.max_usage_in_bytes", "memory.peak")
    print(f"container memory peak: {peak / (1 << 20):.0f} MiB of {limit / (1 << 20):.0f} MiB")


def _in_flight(url: str) -> float:
    """The server's `layerserve_requests_in_flight` gauge."""
    found = re.search(r"^layerserve_requests_in_flight (\S+)$", httpx.get(f"{url}/metrics", timeout=30).text, re.M)
    return float(found[1]) if found else 0.0


def _cat_photo() -> bytes:
    from tests.demo.test_demo import package_file

    return package_file("skimage", "data/chelsea.png").read_bytes()


def _wait_for_job(url: str, job_id: str) -> dict[str, Any]:
    job: dict[str, Any] = {}

    def is_done() -> bool:
        job.update(httpx.get(f"{url}/v2/jobs/{job_id}", timeout=30).json())
        return job["state"] in {"succeeded", "failed", "cancelled"}

    wait_until(is_done, f"job {job_id} has ended", timeout_s=300)
    return job


def _reviews(count: int) -> dict[str, Any]:
    texts, labels = rotten_tomatoes(count)
    return {"dataset": {"texts": texts, "labels": labels}, "params": {"epochs": 3, "seed": 1}, "apply": True}


def test_training_into_the_read_only_repository_fails_cleanly(container: Container, repository: Path) -> None:
    response = httpx.post(f"{container.url}/v2/models/reviews/train", json=_reviews(200), timeout=60)
    assert response.status_code == 409 and "read-only" in response.json()["error"], response.text
    assert not (repository / "reviews").exists() and not (repository / ".jobs").exists()
    assert httpx.get(f"{container.url}/v2/health/ready", timeout=30).status_code == 200


def test_a_training_job_in_the_container_serves_its_version_and_keeps_records_outside_the_repository(
    podman: Podman, repository: Path, demo_engine_cache: Path, tmp_path: Path
) -> None:
    models = _writable_copy(repository / "token_classifier", tmp_path / "models" / "token_classifier").parent
    os.chown(models, IMAGE_UID, IMAGE_UID)
    cache = _writable_copy(demo_engine_cache, tmp_path / "onnx")
    name = f"layerserve-test-train-{os.getpid()}"
    try:
        trainer = _start(podman, name, models, "rw", cache)
        started = httpx.post(f"{trainer.url}/v2/models/reviews/train", json=_reviews(600), timeout=60)
        assert started.status_code == 202, started.text
        job = _wait_for_job(trainer.url, started.json()["job_id"])
        assert job["state"] == "succeeded", job["error"]
        assert (models / "reviews" / "1" / "model.keras").exists()
        wait_until(
            lambda: httpx.get(f"{trainer.url}/v2/models/reviews/ready", timeout=30).status_code == 200,
            "the trained version is served",
        )
        texts = ["A triumph: moving, funny and beautifully made.", "A dull, lifeless mess with nothing to say."]
        answer = httpx.post(f"{trainer.url}/v1/models/reviews:predict", json={"instances": texts}, timeout=30)
        assert answer.status_code == 200, answer.text
        want = reference_scores(models / "reviews" / "1", texts)  # Keras, here, on the version the job wrote
        np.testing.assert_allclose(np.array(answer.json()["predictions"]), want, atol=1e-5)
        records = podman("exec", name, "ls", "/var/lib/layerserve/jobs").stdout.split()
        assert records and not (models / ".jobs").exists()
        peak = _memory_file(podman, name, "memory.max_usage_in_bytes", "memory.peak")
        print(f"container memory peak with a training job: {peak / (1 << 20):.0f} MiB")
    finally:
        podman.remove(name)


def test_sigterm_answers_the_request_in_flight_and_exits_0(podman: Podman, container: Container) -> None:
    rows = np.random.default_rng(0).normal(size=(4 * SLOW_ROWS, 16)).astype(np.float32)
    body = {"inputs": [{"name": "x", "shape": list(rows.shape), "datatype": "FP32", "data": rows.ravel().tolist()}]}
    answers: list[httpx.Response] = []
    request = threading.Thread(
        target=lambda: answers.append(httpx.post(f"{container.url}/v2/models/slow/infer", json=body, timeout=120))
    )
    request.start()
    wait_until(lambda: _in_flight(container.url) >= 2, "the request is in flight")  # with /metrics' own request
    podman("stop", "--time", str(GRACE_S), container.name, timeout_s=GRACE_S + 30)
    request.join(timeout=120)
    assert answers and answers[0].status_code == 200, answers[0].text if answers else "no answer"
    assert answers[0].json()["outputs"][0]["shape"] == [4 * SLOW_ROWS, 1024]
    code = podman("inspect", "--format", "{{.State.ExitCode}}", container.name).stdout.strip()
    assert code == "0", podman("logs", container.name, check=False).stderr[-4000:]  # 137: killed after the grace
