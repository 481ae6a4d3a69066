"""Models loaded on demand under a memory budget: listed at start, loaded by their first request (once, however many
wait), the least recently used idle versions unloaded to make room, never one in use or kept loaded; a 503 naming
the budget when nothing can make room; answers equal to Keras throughout."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import keras
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from corpora import rotten_tomatoes
from layerserve.errors import DeadlineExceededError, QueueFullError
from layerserve.settings import Settings
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
from tests.models import load_reference, save_model
from tests.training.test_jobs import wait_for
from tests.training.test_tokenizer import reference_scores

MB = 1 << 20
SMALL = [f"small{i}" for i in range(6)]  # ~1 MB each


def build_small(seed: int, width: int = 512) -> keras.Model:
    """32 floats -> 4 scores through two `width`-wide layers (512: about 1 MB of weights), each seed its own."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((32,), name="x")
    h = keras.layers.Dense(width, activation="relu", name="hidden")(x)
    h = keras.layers.Dense(width, activation="relu", name="hidden2")(h)
    return keras.Model(x, keras.layers.Dense(4, name="scores")(h), name=f"small{seed}")


def build_big() -> keras.Model:
    """32 floats -> 4 scores through 2048-wide layers: about 17 MB of weights."""
    keras.utils.set_random_seed(99)
    x = keras.Input((32,), name="x")
    h = keras.layers.Dense(2048, activation="relu", name="wide")(x)
    h = keras.layers.Dense(2048, activation="relu", name="wide2")(h)
    return keras.Model(x, keras.layers.Dense(4, name="scores")(h), name="big")


@pytest.fixture(scope="module")
def budget_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six small models, one kept loaded by its config.yaml, and one larger than the budget."""
    root = tmp_path_factory.mktemp("on-demand")
    repository = root / "models"
    for seed, name in enumerate(SMALL):
        save_model(build_small(seed), repository / name / "1", "model.keras")
    save_model(build_small(50), repository / "kept" / "1", "model.keras")
    (repository / "kept" / "config.yaml").write_text("keep_loaded: true\n")
    save_model(build_big(), repository / "big" / "1", "model.keras")
    return repository


@pytest.fixture(scope="module")
def budget_cache(tmp_path_factory: pytest.TempPathFactory, budget_repository: Path) -> Path:
    """An export cache made warm by one server over the repository with no budget (so loads here are cold starts,
    not exports)."""
    cache = tmp_path_factory.mktemp("on-demand-cache")
    live = start_server(Settings(model_repository=budget_repository, engine_cache_dir=cache, reload_interval_s=0))
    live.stop()
    return cache


def budget_settings(repository: Path, cache: Path, budget: int, **more: object) -> Settings:
    """A server's settings with a memory budget, counted by the versions' figures alone (the server runs in the
    test's process, whose memory is not the server's)."""
    return Settings(
        model_repository=repository, engine_cache_dir=cache, model_memory_budget=budget, reload_interval_s=0,
        watch_resident_memory=False, **more,
    )  # fmt: skip


@pytest.fixture
def budget_server(budget_repository: Path, budget_cache: Path) -> Iterator[LiveServer]:
    """A server whose budget holds about four small models (and not `big`)."""
    live = start_server(budget_settings(budget_repository, budget_cache, 9 * MB), grpc=True)
    yield live
    live.stop()


def infer_body(rows: np.ndarray, name: str = "x") -> dict[str, object]:
    """A V2 JSON infer body of one FP32 input."""
    return {"inputs": [{"name": name, "datatype": "FP32", "shape": list(rows.shape), "data": rows.ravel().tolist()}]}


def gauge(live: LiveServer, name: str) -> float:
    """The value of an unlabelled sample of the server's /metrics."""
    for line in httpx.get(f"{live.url}/metrics", timeout=30).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def states(live: LiveServer) -> dict[str, tuple[str, str]]:
    """Model -> (state, reason) of its version 1, from the repository index."""
    rows = httpx.post(f"{live.url}/v2/repository/index", timeout=10).json()
    return {row["name"]: (row["state"], row.get("reason", "")) for row in rows}


def test_models_are_listed_at_start_and_kept_ones_loaded(budget_server: LiveServer) -> None:
    found = states(budget_server)
    assert found["kept"][0] == "READY"
    for name in [*SMALL, "big"]:
        assert found[name] == ("UNAVAILABLE", "not loaded (on demand)")
    wait_until(lambda: gauge(budget_server, "layerserve_model_memory_budget_bytes") == 9 * MB, "a sample")


def test_first_request_loads_once_and_answers_as_keras(
    budget_server: LiveServer, budget_repository: Path, rng: np.random.Generator
) -> None:
    rows = rng.normal(size=(2, 32)).astype(np.float32)
    expected = load_reference(budget_repository, "small0", 1).predict(rows, verbose=0)
    # Counters are the process's: other servers of this test process counted before.
    loads_before = metric_sample(budget_server.url, "layerserve_model_loads_total", model="small0")
    cold_before = gauge(budget_server, "layerserve_cold_start_seconds_count")

    def infer() -> httpx.Response:
        return httpx.post(f"{budget_server.url}/v2/models/small0/infer", json=infer_body(rows), timeout=60)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: infer(), range(8)))
    for answer in answers:
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose(np.array(answer.json()["outputs"][0]["data"]).reshape(2, 4), expected, atol=1e-4)
    assert metric_sample(budget_server.url, "layerserve_model_loads_total", model="small0") == loads_before + 1
    assert gauge(budget_server, "layerserve_cold_start_seconds_count") == cold_before + 1
    assert states(budget_server)["small0"][0] == "READY"


def test_least_recently_used_idle_versions_make_room(budget_server: LiveServer, rng: np.random.Generator) -> None:
    rows = rng.normal(size=(1, 32)).astype(np.float32)
    evictions_before = metric_sample(budget_server.url, "layerserve_model_evictions_total", model=SMALL[0])
    loads_before = metric_sample(budget_server.url, "layerserve_model_loads_total", model=SMALL[0])
    for name in SMALL:  # each ~1.3 MB; the budget holds about four beside `kept`
        answer = httpx.post(f"{budget_server.url}/v2/models/{name}/infer", json=infer_body(rows), timeout=60)
        assert answer.status_code == 200, answer.text
    found = states(budget_server)
    assert found["kept"][0] == "READY"  # kept loaded: never unloaded
    assert found[SMALL[-1]][0] == found[SMALL[-2]][0] == "READY"  # the most recent
    assert found[SMALL[0]] == (
        "UNAVAILABLE", "unloaded to make room under the memory budget (on demand: a request loads it again)"
    )  # fmt: skip
    assert metric_sample(budget_server.url, "layerserve_model_evictions_total", model=SMALL[0]) == evictions_before + 1
    time.sleep(1.2)  # one memory sample after the last load
    assert 0 < gauge(budget_server, "layerserve_model_resident_bytes") <= 9 * MB
    # An unloaded model loads again on its next request, and answers.
    answer = httpx.post(f"{budget_server.url}/v2/models/{SMALL[0]}/infer", json=infer_body(rows), timeout=60)
    assert answer.status_code == 200
    assert metric_sample(budget_server.url, "layerserve_model_loads_total", model=SMALL[0]) == loads_before + 2


def test_a_model_larger_than_the_budget_is_a_clear_error(budget_server: LiveServer) -> None:
    answer = httpx.post(
        f"{budget_server.url}/v2/models/big/infer", json=infer_body(np.zeros((1, 32), np.float32)), timeout=60
    )
    assert answer.status_code == 503
    message = answer.json()["error"]
    assert "more than the whole model_memory_budget (9.0 MB)" in message and "big" in message
    assert states(budget_server)["big"][0] == "FAILED"
    assert states(budget_server)["kept"][0] == "READY"  # nothing was unloaded for it


def test_versions_in_use_are_never_unloaded_and_no_room_is_a_503(
    budget_server: LiveServer, rng: np.random.Generator
) -> None:
    rows = rng.normal(size=(1, 32)).astype(np.float32)
    for name in SMALL[:4]:
        assert httpx.post(f"{budget_server.url}/v2/models/{name}/infer", json=infer_body(rows), timeout=60).is_success
    loaded = [name for name, (state, _) in states(budget_server).items() if state == "READY"]
    # Requests in flight on every loaded version: leases taken through the data plane, as a door takes them.
    data, loop = budget_server.server.runtime.data, budget_server.loop
    views = [data.open(name) for name in loaded]
    for view in views:
        asyncio.run_coroutine_threadsafe(view.__aenter__(), loop).result(10)
    try:
        answer = httpx.post(f"{budget_server.url}/v2/models/{SMALL[5]}/infer", json=infer_body(rows), timeout=60)
        assert answer.status_code == 503
        assert answer.headers["retry-after"] == "1"
        message = answer.json()["error"]
        assert f"no memory for model '{SMALL[5]}' version 1 now" in message
        assert "the model_memory_budget is 9.0 MB" in message and "1 kept loaded" in message
        assert [name for name, (state, _) in states(budget_server).items() if state == "READY"] == loaded
    finally:
        for view in views:
            asyncio.run_coroutine_threadsafe(view.__aexit__(None, None, None), loop).result(10)
    answer = httpx.post(f"{budget_server.url}/v2/models/{SMALL[5]}/infer", json=infer_body(rows), timeout=60)
    assert answer.status_code == 200


def test_metadata_and_grpc_load_a_listed_model(
    budget_server: LiveServer, budget_repository: Path, rng: np.random.Generator
) -> None:
    metadata = httpx.get(f"{budget_server.url}/v2/models/small3", timeout=60).json()
    assert metadata["inputs"][0]["name"] == "x" and metadata["state"] == "READY"
    client = grpcclient.InferenceServerClient(budget_server.grpc_target)
    rows = rng.normal(size=(3, 32)).astype(np.float32)
    tensor = grpcclient.InferInput("x", [3, 32], "FP32")
    tensor.set_data_from_numpy(rows)
    answer = client.infer("small4", [tensor]).as_numpy("scores")
    expected = load_reference(budget_repository, "small4", 1).predict(rows, verbose=0)
    np.testing.assert_allclose(answer, expected, atol=1e-4)
    assert not client.is_model_ready("small5")  # readiness never loads
    status = httpx.get(f"{budget_server.url}/v1/models/small5", timeout=10)
    assert status.status_code == 200
    assert status.json()["model_version_status"][0]["state"] == "START"  # TF Serving's: tracked, not loaded
    predicted = httpx.post(f"{budget_server.url}/v1/models/small5:predict", json={"instances": rows.tolist()}).json()
    expected = load_reference(budget_repository, "small5", 1).predict(rows, verbose=0)
    np.testing.assert_allclose(np.array(predicted["predictions"]), expected, atol=1e-4)


def test_load_counts_against_the_budget_and_unload_frees(budget_server: LiveServer) -> None:
    for name in SMALL:
        assert httpx.post(f"{budget_server.url}/v2/repository/models/{name}/load", timeout=60).status_code == 200
    found = states(budget_server)
    assert sum(found[name][0] == "READY" for name in SMALL) < len(SMALL)  # the first ones made room
    assert found[SMALL[-1]][0] == "READY"
    assert httpx.post(f"{budget_server.url}/v2/repository/models/{SMALL[-1]}/unload", timeout=60).status_code == 200
    assert states(budget_server)[SMALL[-1]][0] == "UNAVAILABLE"


def test_a_neighbour_server_in_the_process_never_shows_in_the_budget_gauges(
    budget_server: LiveServer, server: LiveServer
) -> None:
    """Servers in one process share the process's gauges; each one's /metrics still shows its own budget while
    the other (no budget) samples them over and over."""
    import threading

    stop = threading.Event()

    def sample_the_neighbour() -> None:
        while not stop.is_set():
            server.server.runtime.sample_process(with_gpu=False)

    neighbour = threading.Thread(target=sample_the_neighbour, daemon=True)
    neighbour.start()
    try:
        budgets = {gauge(budget_server, "layerserve_model_memory_budget_bytes") for _ in range(100)}
    finally:
        stop.set()
        neighbour.join(timeout=10)
    assert budgets == {9 * MB}


def test_new_versions_of_listed_models_are_listed_and_of_loaded_ones_loaded(
    budget_repository: Path, budget_cache: Path, tmp_path: Path, rng: np.random.Generator
) -> None:
    repository = tmp_path / "models"
    for name in ("small0", "small1"):
        shutil.copytree(budget_repository / name, repository / name)
    live = start_server(
        budget_settings(repository, budget_cache, 20 * MB).model_copy(update={"reload_interval_s": 0.2})
    )
    try:
        rows = rng.normal(size=(1, 32)).astype(np.float32)
        assert httpx.post(f"{live.url}/v2/models/small0/infer", json=infer_body(rows), timeout=60).status_code == 200
        for name, seed in (("small0", 7), ("small1", 8)):
            save_model(build_small(seed), repository / name / "2", "model.keras")
        index = f"{live.url}/v2/repository/index"

        def version_state(name: str, version: str) -> str:
            rows_ = httpx.post(index, timeout=10).json()
            return next((r["state"] for r in rows_ if r["name"] == name and r["version"] == version), "")

        wait_until(lambda: version_state("small0", "2") == "READY", "the loaded model's new version loaded")
        wait_until(lambda: version_state("small1", "2") == "UNAVAILABLE", "the listed model's new version listed")
        time.sleep(1)
        assert version_state("small1", "2") == "UNAVAILABLE"
        answer = httpx.post(f"{live.url}/v2/models/small1/infer", json=infer_body(rows), timeout=60).json()
        assert answer["model_version"] == "2"
        expected = load_reference(repository, "small1", 2).predict(rows, verbose=0)
        np.testing.assert_allclose(np.array(answer["outputs"][0]["data"]).reshape(1, 4), expected, atol=1e-4)
    finally:
        live.stop()


def test_layerserve_models_says_what_each_version_needs_of_the_budget(budget_repository: Path) -> None:
    listing = subprocess.run(
        [sys.executable, "-m", "layerserve", "models", str(budget_repository), "--model-memory-budget", "9MB"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    big = listing[listing.index("big") :].splitlines()[1]
    assert "of the 9.0 MB model_memory_budget: LARGER THAN THE BUDGET, it cannot load" in big
    small = listing[listing.index("small0") :].splitlines()[1]
    assert "of the 9.0 MB model_memory_budget" in small and "LARGER" not in small


def resident_bytes(pid: int) -> int:
    """A process's resident memory, from /proc."""
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_the_budget_holds_in_the_workers_real_memory(tmp_path: Path, rng: np.random.Generator) -> None:
    """What the versions' own figures count is what the serving process's resident memory shows: the figures of
    the loaded versions match its growth, and loading three times the budget keeps it within the budget."""
    repository, cache = tmp_path / "models", tmp_path / "cache"
    names = [f"wide{seed}" for seed in range(16)]
    for seed, name in enumerate(names):
        save_model(build_small(seed, 1024), repository / name / "1", "model.keras")  # ~4.3 MB
    start_server(Settings(model_repository=repository, engine_cache_dir=cache, reload_interval_s=0)).stop()
    port = free_port()
    process = start_server_process(repository, cache, port, "--model-memory-budget", "48MB")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_process_ready(url, process, server_log(repository))
        rows = rng.normal(size=(1, 32)).astype(np.float32)
        with httpx.Client(base_url=url, timeout=60) as client:
            # An unload closes its version and gives the heap's free pages back (malloc_trim), so that a load's
            # transient memory is gone when measured, as it is once loads and unloads take turns.
            client.post(f"/v2/models/{names[0]}/infer", json=infer_body(rows)).raise_for_status()  # ORT starts
            client.post(f"/v2/repository/models/{names[0]}/unload").raise_for_status()
            time.sleep(1)
            base = resident_bytes(process.pid)
            for name in names[1:10]:  # about 43 MB: within the budget, nothing unloaded
                client.post(f"/v2/models/{name}/infer", json=infer_body(rows)).raise_for_status()
            client.post(f"/v2/repository/models/{names[9]}/unload").raise_for_status()
            time.sleep(1)
            figures = [client.get(f"/v2/models/{name}").json()["memory"]["total_bytes"] for name in names[1:9]]
            growth = resident_bytes(process.pid) - base
            assert abs(growth - sum(figures)) <= 0.3 * sum(figures), (growth, figures)
            peak = 0
            for _ in range(3):
                for name in names:
                    client.post(f"/v2/models/{name}/infer", json=infer_body(rows)).raise_for_status()
                    peak = max(peak, resident_bytes(process.pid) - base)
            evicted = metric_sample(url, "layerserve_model_evictions_total")
            assert evicted >= 2 * len(names)
            # Unloaded versions are closed and their memory given back before the next load: once loads stop, the
            # process holds the budget. While a version opens, ONNX Runtime briefly holds its graph several times
            # over (the file, the parsed graph, its weights), until the heap is trimmed after the load.
            time.sleep(1)
            assert resident_bytes(process.pid) - base <= 48 * MB + 8 * MB
            largest = max((repository / name / "1" / "model.keras").stat().st_size for name in names)
            assert peak <= 48 * MB + 8 * largest, peak / MB
            # A cold start with the export cache warm opens a session: TensorFlow is never imported for it.
            assert "libtensorflow" not in Path(f"/proc/{process.pid}/maps").read_text()
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_trained_model_is_listed_and_loaded_by_its_first_request(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    repository.mkdir()
    live = start_server(budget_settings(repository, tmp_path / "cache", 64 * MB))
    try:
        texts, labels = rotten_tomatoes(600)
        body = {"dataset": {"texts": texts, "labels": labels}, "params": {"epochs": 2}}
        started = httpx.post(f"{live.url}/v2/models/reviews/train", json=body, timeout=30)
        assert started.status_code == 202, started.text
        job = wait_for(live.url, started.json()["job_id"], {"succeeded", "failed"})
        assert job["state"] == "succeeded", job["error"]
        assert states(live)["reviews"] == ("UNAVAILABLE", "not loaded (on demand)")
        sample = ["a wonderful film", "a dull and tedious mess"]
        answer = httpx.post(f"{live.url}/v1/models/reviews:predict", json={"instances": sample}, timeout=60)
        assert answer.status_code == 200, answer.text
        expected = reference_scores(repository / "reviews" / "1", sample)
        np.testing.assert_allclose(np.array(answer.json()["predictions"]), expected, atol=1e-5)
        assert states(live)["reviews"][0] == "READY"
    finally:
        live.stop()


def test_a_layer_output_loads_its_version_and_its_cut_counts_in_its_memory(
    budget_server: LiveServer, budget_repository: Path, rng: np.random.Generator
) -> None:
    rows = rng.normal(size=(2, 32)).astype(np.float32)
    body = {**infer_body(rows), "outputs": [{"name": "hidden"}]}
    answer = httpx.post(f"{budget_server.url}/v2/models/small2/infer", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    reference = load_reference(budget_repository, "small2", 1)
    layer = keras.Model(reference.inputs, reference.get_layer("hidden").output)
    expected = layer.predict(rows, verbose=0)
    np.testing.assert_allclose(np.array(answer.json()["outputs"][0]["data"]).reshape(2, 512), expected, atol=1e-4)

    def cuts_bytes() -> int:
        memory = httpx.get(f"{budget_server.url}/v2/models/small2", timeout=10).json()["memory"]
        return int(memory["cuts_bytes"])

    wait_until(lambda: cuts_bytes() > 0, "the cut's graph counted in the version's memory")
    memory = httpx.get(f"{budget_server.url}/v2/models/small2", timeout=10).json()["memory"]
    assert memory["total_bytes"] >= memory["server_bytes"] + memory["cuts_bytes"]


def test_waiting_requests_are_bounded_and_wait_at_most_their_deadline(
    budget_repository: Path, budget_cache: Path
) -> None:
    live = start_server(budget_settings(budget_repository, budget_cache, 9 * MB, max_queue_size=2))
    control = live.server.runtime.control
    try:

        async def five_at_once() -> list[object]:
            waits = [control.load_on_demand("small1", 1) for _ in range(5)]
            return await asyncio.gather(*waits, return_exceptions=True)

        outcomes = asyncio.run_coroutine_threadsafe(five_at_once(), live.loop).result(60)
        loaded = [outcome for outcome in outcomes if not isinstance(outcome, Exception)]
        refused = [outcome for outcome in outcomes if isinstance(outcome, QueueFullError)]
        assert len(loaded) == 2 and len(refused) == 3, outcomes
        assert "small1' version 1 is loading and 2 requests wait for it" in refused[0].message
        for version in loaded:
            live.loop.call_soon_threadsafe(version.release)  # type: ignore[attr-defined]  # returned held
    finally:
        live.stop()
    live = start_server(budget_settings(budget_repository, budget_cache, 9 * MB, request_timeout_ms=1))
    try:
        waited = asyncio.run_coroutine_threadsafe(live.server.runtime.control.load_on_demand("small2", 1), live.loop)
        with pytest.raises(DeadlineExceededError, match="did not load within request_timeout_ms"):
            waited.result(60)
        wait_until(lambda: states(live)["small2"][0] == "READY", "the load went on without its request")
    finally:
        live.stop()
