"""Versions over HTTP: apply/unpin, Triton load/unload/index, and the strict hot-swap test."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import keras
import numpy as np
import orjson
import pytest
import tritonclient.http as triton

from layerserve.settings import Settings
from tests.live_server import LiveServer, start_server
from tests.models import build_mlp
from tests.redis_server import RedisServer

X = np.random.default_rng(9).normal(size=(2, 10)).astype(np.float32)
BODY = orjson.dumps(
    {"inputs": [{"name": "x", "shape": [2, 10], "datatype": "FP32", "data": X}]}, option=orjson.OPT_SERIALIZE_NUMPY
)


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("swap-weights")
    files = {}
    for name, seed in (("a", 21), ("b", 22)):
        files[name] = folder / f"{name}.keras"
        build_mlp(seed).save(files[name])
    return files


@pytest.fixture(scope="module")
def references(weights: dict[str, Path]) -> dict[str, np.ndarray]:
    return {name: np.asarray(keras.saving.load_model(path)(X)) for name, path in weights.items()}


def weights_of(version: int) -> str:
    """Odd versions carry weights a, even ones weights b."""
    return "a" if version % 2 else "b"


def add_version(repo: Path, number: int, source: Path) -> None:
    """Written under a hidden name, then renamed: the folder appears whole."""
    staging = repo / "m" / f".staging-{number}"
    staging.mkdir()
    shutil.copyfile(source, staging / "model.keras")
    staging.rename(repo / "m" / str(number))


@pytest.fixture
def swap_server(tmp_path: Path, weights: dict[str, Path], engine_cache: Path) -> Iterator[tuple[LiveServer, Path]]:
    repo = tmp_path / "repo"
    (repo / "m").mkdir(parents=True)
    add_version(repo, 1, weights["a"])
    add_version(repo, 2, weights["b"])
    (repo / "m" / "config.yaml").write_text("version_policy: {latest: 2}\n")
    settings = Settings(model_repository=repo, engine_cache_dir=engine_cache, reload_interval_s=0.1)
    live = start_server(settings)
    yield live, repo
    live.stop()


def test_apply_unpin_and_errors(swap_server: tuple[LiveServer, Path]) -> None:
    live, _ = swap_server
    with httpx.Client(base_url=live.url, timeout=60) as http:
        check_apply_and_unpin(http)


def check_apply_and_unpin(http: httpx.Client) -> None:
    assert http.post("/v2/models/m/infer", content=BODY).json()["model_version"] == "2"
    applied = http.post("/v2/models/m/versions/1/apply")
    assert applied.status_code == 200 and applied.json() == {"name": "m", "active_version": "1", "pinned": True}
    assert http.post("/v2/models/m/infer", content=BODY).json()["model_version"] == "1"
    meta = http.get("/v2/models/m").json()
    assert (meta["active_version"], meta["pinned_version"]) == ("1", "1")
    assert http.post("/v2/models/m/apply", json={"version": "latest"}).json()["active_version"] == "2"
    assert http.post("/v2/models/m/infer", content=BODY).json()["model_version"] == "2"
    assert http.post("/v2/models/m/versions/7/apply").status_code == 404
    assert http.post("/v2/models/m/apply", json={"version": 1}).status_code == 400
    assert http.post("/v2/models/..%2Fetc/versions/1/apply").status_code in (400, 404)
    response = http.post("/v2/repository/models/.hidden/load")
    assert response.status_code == 400 and "invalid model name" in response.json()["error"]


def test_triton_repository_extension(swap_server: tuple[LiveServer, Path]) -> None:
    live, _ = swap_server
    client = triton.InferenceServerClient(live.host_port)
    index = client.get_model_repository_index()
    assert {(row["name"], row["version"], row["state"]) for row in index} == {("m", "1", "READY"), ("m", "2", "READY")}
    assert httpx.post(f"{live.url}/v2/models/m/versions/1/infer", content=BODY).status_code == 200
    assert 'layerserve_batch_size_count{model="m",version="1"}' in httpx.get(f"{live.url}/metrics").text
    client.unload_model("m")
    assert not client.is_model_ready("m")
    assert httpx.post(f"{live.url}/v2/models/m/infer", content=BODY).status_code == 503
    assert 'model="m",version="1"}' not in httpx.get(f"{live.url}/metrics").text.replace("route=", "")  # gone
    client.load_model("m")
    assert client.is_model_ready("m")
    with pytest.raises(triton.InferenceServerException, match="no model folder"):
        client.load_model("absent")


class SwapClients:
    """Closed-loop clients checking every answer against the weights of the version it names."""

    def __init__(self, url: str, weights: dict[str, Path], references: dict[str, np.ndarray]) -> None:
        self.url, self.weights, self.references = url, weights, references
        self.stop = threading.Event()
        self.problems: list[str] = []
        self.versions_seen: set[int] = set()
        self.lock = threading.Lock()

    def client(self) -> int:
        count = 0
        with httpx.Client(base_url=self.url, timeout=60) as http:
            while not self.stop.is_set():
                response = http.post("/v2/models/m/infer", content=BODY)
                count += 1
                with self.lock:
                    self.check(response)
        return count

    def check(self, response: httpx.Response) -> None:
        if response.status_code != 200:
            self.problems.append(f"{response.status_code}: {response.text}")
            return
        answer = response.json()
        version = int(answer["model_version"])
        got = np.array(answer["outputs"][0]["data"], np.float32).reshape(2, 3)
        self.versions_seen.add(version)
        if not np.allclose(got, self.references[weights_of(version)], atol=1e-5):
            self.problems.append(f"version {version} answered with the other weights")

    def swap(self, repo: Path) -> None:
        """5 s of apply alternating between 1 and 2 every 0.3 s, then 5 s of new version folders."""
        with httpx.Client(base_url=self.url, timeout=60) as http:
            started = time.monotonic()
            target = 1
            while time.monotonic() - started < 5:
                assert http.post(f"/v2/models/m/versions/{target}/apply").status_code == 200
                target = 3 - target
                time.sleep(0.3)
            assert http.post("/v2/models/m/apply", json={"version": "latest"}).status_code == 200
            number = 3
            while time.monotonic() - started < 10.5:
                add_version(repo, number, self.weights[weights_of(number)])
                number += 1
                time.sleep(0.3)


@pytest.mark.slow
def test_strict_hot_swap_zero_failed_requests(
    swap_server: tuple[LiveServer, Path], weights: dict[str, Path], references: dict[str, np.ndarray]
) -> None:
    live, repo = swap_server
    swap = SwapClients(live.url, weights, references)
    with ThreadPoolExecutor(9) as pool:
        clients = [pool.submit(swap.client) for _ in range(8)]
        pool.submit(swap.swap, repo).result()
        time.sleep(0.5)
        swap.stop.set()
        requests = sum(c.result() for c in clients)
    assert swap.problems == []
    assert requests > 100 and {1, 2} <= swap.versions_seen and max(swap.versions_seen) >= 5

    newest = max(int(p.name) for p in (repo / "m").iterdir() if p.name.isdigit())
    (repo / "m" / str(newest + 1)).mkdir()
    (repo / "m" / str(newest + 1) / "model.keras").write_bytes(b"corrupt")
    for _ in range(300):  # the reloader polls every 0.1 s
        rows = {r["version"]: r["state"] for r in httpx.post(f"{live.url}/v2/repository/index").json()}
        if rows.get(str(newest + 1)) == "FAILED":
            break
        time.sleep(0.1)
    assert rows[str(newest + 1)] == "FAILED"
    answer = httpx.post(f"{live.url}/v2/models/m/infer", content=BODY).json()
    assert answer["model_version"] == str(newest)


def test_version_swapped_out_while_a_request_awaits_still_answers_it(
    tmp_path: Path, weights: dict[str, Path], references: dict[str, np.ndarray], engine_cache: Path
) -> None:
    """A request holds the version it got from the start: here it waits on a stalled feature cache while its
    version is reloaded with other weights, and is answered by the version it started with."""
    repo = tmp_path / "repo"
    (repo / "m").mkdir(parents=True)
    add_version(repo, 1, weights["b"])
    (repo / "m" / "config.yaml").write_text("cache: true\n")
    redis = RedisServer()
    redis.start()
    settings = Settings(
        model_repository=repo, engine_cache_dir=engine_cache, redis_url=redis.url, redis_timeout_ms=10_000,
        reload_interval_s=0,
    )  # fmt: skip
    live = start_server(settings)
    try:
        assert httpx.post(f"{live.url}/v2/models/m/infer", content=BODY, timeout=30).status_code == 200
        stall = subprocess.Popen(["redis-cli", "-p", str(redis.port), "debug", "sleep", "2"])
        time.sleep(0.3)  # Redis answers nothing for 2 s: the next request waits in its cache lookup
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(
                httpx.post, f"{live.url}/v2/models/m/infer", content=orjson.dumps({
                    "inputs": [{"name": "x", "shape": [2, 10], "datatype": "FP32", "data": (X + 1).tolist()}]
                }), timeout=30,
            )  # fmt: skip
            time.sleep(0.3)
            shutil.copyfile(weights["a"], repo / "m" / "1" / "model.keras")
            reload = httpx.post(f"{live.url}/v2/repository/models/m/load", timeout=60)
            assert reload.status_code == 200, reload.text
            assert not waiting.done()  # the reload finished while the request still waited
            answer = waiting.result()
        stall.wait(timeout=30)
        assert answer.status_code == 200, answer.text
        expected = np.asarray(keras.saving.load_model(weights["b"])(X + 1))
        got = np.asarray(answer.json()["outputs"][0]["data"], dtype=np.float32).reshape(expected.shape)
        np.testing.assert_allclose(got, expected, atol=1e-4)  # the old weights answered it
        now = httpx.post(f"{live.url}/v2/models/m/infer", content=BODY, timeout=30).json()
        got = np.asarray(now["outputs"][0]["data"], dtype=np.float32).reshape(references["a"].shape)
        np.testing.assert_allclose(got, references["a"], atol=1e-4)  # and the new weights serve now
    finally:
        live.stop()
        redis.kill()
