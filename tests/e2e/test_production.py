"""Production features: tokens, access log, request metrics, GPU settings, several workers, and a graceful
shutdown with requests in flight."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import keras
import numpy as np
import pytest

from corpora import rotten_tomatoes
from layerserve.gpu import MEMORY_LIMIT_VARIABLE, apply_settings, onnx_providers
from layerserve.logs import JsonFormatter
from layerserve.settings import Settings
from soak_server import descendants
from tests.live_server import LiveServer, free_port, server_log, start_server, start_server_process, wait_process_ready
from tests.models import build_mlp, save_model

ADMIN, API = "admin-secret-token", "api-secret-token"


@pytest.fixture(scope="module")
def guarded(repository: Path, engine_cache: Path) -> Iterator[LiveServer]:
    settings = Settings(
        model_repository=repository, engine_cache_dir=engine_cache,
        admin_token=ADMIN, api_token=API, access_log=True, reload_interval_s=0,
    )  # fmt: skip
    live = start_server(settings)
    yield live
    live.stop()


def _infer(url: str, headers: dict[str, str]) -> httpx.Response:
    body = {"inputs": [{"name": "x", "shape": [1, 10], "datatype": "FP32", "data": [0.5] * 10}]}
    return httpx.post(f"{url}/v2/models/mlp/infer", json=body, headers=headers)


def test_tokens_guard_routes(guarded: LiveServer) -> None:
    url = guarded.url
    bearer = {"api": {"Authorization": f"Bearer {API}"}, "admin": {"Authorization": f"Bearer {ADMIN}"}}
    assert httpx.get(f"{url}/v2/health/ready").status_code == 200  # health needs no token
    missing = _infer(url, {})
    assert missing.status_code == 401 and "API token" in missing.json()["error"]
    assert missing.headers["www-authenticate"].startswith("Bearer")
    assert _infer(url, {"Authorization": "Bearer wrong"}).status_code == 403
    assert _infer(url, {"Authorization": "Basic abc"}).status_code == 401
    assert _infer(url, bearer["api"]).status_code == 200
    assert _infer(url, bearer["admin"]).status_code == 200  # the admin token opens every route
    management = ("/v2/repository/index", "/v2/repository/models/mlp/load", "/v2/models/mlp/versions/1/apply",
                  "/v2/models/mlp/labels/stable/apply", "/v2/models/mlp/apply", "/v2/logging")  # fmt: skip
    for path in management:
        assert httpx.post(f"{url}{path}").status_code == 401, path
        assert httpx.post(f"{url}{path}", headers=bearer["api"]).status_code == 403, path
    assert httpx.post(f"{url}/v2/repository/index", headers=bearer["admin"]).status_code == 200
    assert httpx.post(f"{url}/v2/models/new/train", json={}, headers=bearer["api"]).status_code == 403
    assert httpx.get(f"{url}/v2/jobs", headers=bearer["admin"]).status_code == 200
    assert httpx.get(f"{url}/v2/logging", headers=bearer["api"]).status_code == 403  # log settings: admin only
    assert httpx.get(f"{url}/v2/logging", headers=bearer["admin"]).status_code == 200


def test_access_log_and_request_metrics(guarded: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    headers = {"Authorization": f"Bearer {API}"}
    with caplog.at_level(logging.INFO, logger="layerserve.access"):
        assert _infer(guarded.url, headers).status_code == 200
        assert httpx.get(f"{guarded.url}/v2/models/nope", headers=headers).status_code == 404
    records = [r for r in caplog.records if r.name == "layerserve.access"]
    infer = next(r for r in records if r.path == "/v2/models/mlp/infer")  # type: ignore[attr-defined]
    assert (infer.route, infer.model, infer.version, infer.status) == ("v2.infer", "mlp", "2", 200)  # type: ignore[attr-defined]
    assert infer.latency_ms > 0  # type: ignore[attr-defined]
    line = json.loads(JsonFormatter().format(infer))
    assert line["logger"] == "layerserve.access" and line["model"] == "mlp" and line["status"] == 200
    text = httpx.get(f"{guarded.url}/metrics", headers=headers).text
    ok = re.search(
        r'^layerserve_requests_total\{model="mlp",route="v2.infer",status="200",version="2"\} (\S+)$', text, re.M
    )
    assert ok and float(ok.group(1)) >= 2
    assert re.search(
        r'^layerserve_requests_total\{model="",route="v2.model_metadata",status="404",version=""\}', text, re.M
    )
    assert re.search(r'^layerserve_request_seconds_count\{model="mlp",route="v2.infer"\} ', text, re.M)
    assert re.search(r'^layerserve_model_state\{model="mlp",state="READY",version="2"\} 1.0$', text, re.M)
    assert re.search(r'^layerserve_model_load_seconds\{model="mlp",version="2"\} [0-9.]+$', text, re.M)
    assert re.search(r"^layerserve_requests_in_flight 1.0$", text, re.M)  # this very request
    rss = re.search(r"^layerserve_process_resident_memory_bytes (\S+)$", text, re.M)
    assert rss and float(rss.group(1)) > 50e6
    assert re.search(r"^layerserve_queue_seconds_bucket", text, re.M) and re.search(
        r"^layerserve_batch_size", text, re.M
    )


def test_gpu_settings_reach_the_environment_and_providers(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CUDA_VISIBLE_DEVICES", "TF_FORCE_GPU_ALLOW_GROWTH", MEMORY_LIMIT_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    apply_settings(Settings(gpu_devices="1", gpu_memory_growth=True, gpu_memory_limit_mb=512))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1" and os.environ["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    assert onnx_providers(["CUDAExecutionProvider", "CPUExecutionProvider"]) == [
        ("CUDAExecutionProvider", {"gpu_mem_limit": str(512 << 20)}),
        "CPUExecutionProvider",
    ]
    assert onnx_providers(["CPUExecutionProvider"]) == ["CPUExecutionProvider"]  # this machine: CPU only
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    apply_settings(Settings())
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and os.environ[MEMORY_LIMIT_VARIABLE] == "0"


@pytest.mark.slow
def test_two_workers_load_slowly_share_the_port_and_follow_apply(demo_repository: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for name in ("efficientnet_lite0", "token_classifier"):  # a fresh cache: EfficientNet's load exports it
        (repo / name).mkdir(parents=True)
        for item in (demo_repository / name).iterdir():
            target = repo / name / item.name
            target.symlink_to(item, target_is_directory=item.is_dir())
    save_model(build_mlp(1), repo / "mlp" / "1", "model.keras")
    save_model(build_mlp(2), repo / "mlp" / "2", "model.keras")
    (repo / "mlp" / "config.yaml").write_text("version_policy: {all: true}\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_server_process(repo, tmp_path / "cache", port, "--workers", "2", "--reload-interval-s", "0.5")
    try:
        seen_live = wait_process_ready(url, process, server_log(repo))
        # A worker accepts connections only once loaded: liveness waited or answered 200, never anything else.
        assert set(seen_live) <= {200}
        # From the first 200 of readiness on, every worker has loaded: no request meets one still loading.
        statuses = _load_for(url, seconds=4.0)
        assert statuses and set(statuses) == {200}, statuses
        pids = _worker_pids(url)
        assert len(pids) == 2
        for _ in range(20):  # each worker runs EfficientNet in an engine process of its own
            with httpx.Client() as client:
                reason = client.get(f"{url}/v2/models/efficientnet_lite0").json()["engine_reason"]
                assert "runs in engine process" in reason, reason
        # The workers and their engine processes (and any helper process alive): glibc's heap held to 2 arenas.
        below = {pid: environment for pid in descendants(process.pid) if (environment := _environment(pid))}
        assert len(below) >= 4, below.keys()
        expected = os.environ.get("MALLOC_ARENA_MAX", "2")  # an operator's own value is kept
        assert {environment.get("MALLOC_ARENA_MAX") for environment in below.values()} == {expected}
        httpx.post(f"{url}/v2/models/mlp/versions/1/apply").raise_for_status()  # answered by one worker
        time.sleep(1.5)  # one reload interval (0.5 s) and margin: the other worker has read the pin
        body = {"inputs": [{"name": "x", "shape": [1, 10], "datatype": "FP32", "data": [0.5] * 10}]}
        versions = set()
        for _ in range(40):  # new connections, spread over both workers by the kernel
            with httpx.Client() as client:
                versions.add(client.post(f"{url}/v2/models/mlp/infer", json=body).json()["model_version"])
        assert versions == {"1"}
        text = httpx.get(f"{url}/metrics").text
        served = re.findall(
            r'^layerserve_requests_total\{model="mlp",route="v2.infer",status="200",version="1"\} (\S+)$', text, re.M
        )
        assert served and float(served[0]) == 40  # summed over both workers
        overview = httpx.get(f"{url}/v2/overview").json()  # the console's document sums them the same way
        assert overview["series"]["mlp"]["latency_s"]["count"] >= 40
        assert {p["id"] for p in overview["processes"]} >= {f"pid {pid}" for pid in pids}, overview["processes"]
        _jobs_are_shared_by_workers(url)
        _a_killed_worker_is_replaced_without_503s(url, pids)
        _a_new_version_reaches_both_workers_without_503s(url, demo_repository, repo)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0


def _environment(pid: int) -> dict[str, str]:
    """The environment a process was started with ({} once it is gone)."""
    try:
        pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(pair.decode(errors="surrogateescape").split("=", 1) for pair in pairs if b"=" in pair)


def _worker_pids(url: str) -> set[str]:
    text = httpx.get(f"{url}/metrics").text
    return set(re.findall(r'layerserve_process_cpu_seconds\{pid="(\d+)"\}', text))


_TOKENS = {"inputs": [{"name": "tokens", "shape": [1, 64], "datatype": "INT32", "data": list(range(1, 65))}]}


def _load_for(url: str, seconds: float, clients: int = 4, stop: threading.Event | None = None) -> list[int | str]:
    """Closed-loop clients (kept-alive connections, one per client) on the token classifier for `seconds` or
    until `stop`; every answer's status, or the transport error's name."""
    statuses: list[int | str] = []
    deadline = time.monotonic() + seconds

    def client_loop() -> None:
        client = httpx.Client(timeout=30)
        while time.monotonic() < deadline and not (stop and stop.is_set()):
            try:
                statuses.append(client.post(f"{url}/v2/models/token_classifier/infer", json=_TOKENS).status_code)
            except httpx.TransportError as error:
                statuses.append(type(error).__name__)
                client.close()
                client = httpx.Client(timeout=30)
        client.close()

    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statuses


def _a_killed_worker_is_replaced_without_503s(url: str, pids: set[str]) -> None:
    """SIGKILL one worker under load: only requests in flight on it fail, none is answered 503 (its replacement
    takes connections once loaded), and readiness returns once the replacement has loaded."""
    stop = threading.Event()
    statuses: list[int | str] = []
    loader = threading.Thread(target=lambda: statuses.extend(_load_for(url, 120.0, stop=stop)))
    loader.start()
    time.sleep(1.0)
    victim = int(sorted(pids)[0])
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    readiness: list[int] = []
    deadline = killed_at + 120
    while time.monotonic() < deadline:
        readiness.append(httpx.get(f"{url}/v2/health/ready", timeout=10).status_code)
        new_pids = _worker_pids(url)
        if readiness[-1] == 200 and len(new_pids) == 2 and str(victim) not in new_pids:
            break
        time.sleep(0.2)
    back_after = time.monotonic() - killed_at
    time.sleep(2.0)  # requests keep flowing once the replacement serves
    stop.set()
    loader.join()
    failed = [s for s in statuses if s != 200]
    print(f"worker killed: {len(statuses)} requests, {len(failed)} failed {sorted(set(map(str, failed)))}, "
          f"ready again after {back_after:.1f} s (readiness answers: {sorted(set(readiness))})")  # fmt: skip
    assert readiness[-1] == 200 and str(victim) not in _worker_pids(url), readiness
    assert 503 not in statuses
    assert len(failed) <= 4 and all(isinstance(s, str) for s in failed), failed  # at most one per client
    assert statuses.count(200) > 100


def _a_new_version_reaches_both_workers_without_503s(url: str, demo: Path, repo: Path) -> None:
    """A new version folder under load: each worker loads it beside the old one; no answer is a 503."""
    stop = threading.Event()
    statuses: list[int | str] = []
    loader = threading.Thread(target=lambda: statuses.extend(_load_for(url, 120.0, stop=stop)))
    loader.start()
    shutil.copytree(demo / "token_classifier" / "1", repo / "token_classifier" / "2")
    deadline, served = time.monotonic() + 90, set()
    while time.monotonic() < deadline and served != {"2"}:
        served = set()
        for _ in range(10):  # new connections, spread over both workers
            with httpx.Client() as client:
                served.add(client.post(f"{url}/v2/models/token_classifier/infer", json=_TOKENS).json()["model_version"])
        time.sleep(0.2)
    stop.set()
    loader.join()
    assert served == {"2"}
    assert statuses and set(statuses) == {200}, sorted(set(map(str, statuses)))


def _jobs_are_shared_by_workers(url: str) -> None:
    """A job started through one worker is seen, and cancelled, through any (new connections each time)."""
    texts, labels = rotten_tomatoes(1000)
    body = {"dataset": {"texts": texts, "labels": labels}, "params": {"epochs": 500, "patience": 500}}
    with httpx.Client() as client:
        job_id = client.post(f"{url}/v2/models/reviews/train", json=body).json()["job_id"]
    deadline = time.monotonic() + 120
    states = []
    while time.monotonic() < deadline and "running" not in states:
        with httpx.Client() as client:
            answer = client.get(f"{url}/v2/jobs/{job_id}")
        assert answer.status_code == 200, answer.text
        states.append(answer.json()["state"])
        time.sleep(0.2)
    for _ in range(4):  # whichever worker takes the cancel, the job ends cancelled
        with httpx.Client() as client:
            answer = client.post(f"{url}/v2/jobs/{job_id}/cancel", timeout=60)
            assert answer.status_code == 200, answer.text
            job = answer.json()
        if job["state"] == "cancelled":
            break
    assert job["state"] == "cancelled" and job["model_version"] is None, job
    with httpx.Client() as client:
        listed = client.get(f"{url}/v2/jobs").json()["jobs"]
    assert [(j["id"], j["state"]) for j in listed] == [(job_id, "cancelled")]


def _slow_model(folder: Path) -> None:
    """One 1024-wide layer applied 32 times (4 MB of weights): 5,000 rows take seconds of compute on a CPU, long
    after their 20 MB body has been read."""
    keras.utils.set_random_seed(0)
    x = keras.Input((1024,), name="x")
    dense = keras.layers.Dense(1024, activation="tanh", name="d")
    h = x
    for _ in range(32):
        h = dense(h)
    save_model(keras.Model(x, h), folder, "model.keras")


@pytest.mark.slow
def test_sigterm_finishes_requests_in_flight_refuses_new_ones_and_exits_0(tmp_path: Path) -> None:
    _slow_model(tmp_path / "repo" / "slow" / "1")
    (tmp_path / "repo" / "slow" / "config.yaml").write_text("max_batch_size: 5000\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_server_process(tmp_path / "repo", tmp_path / "cache", port, "--shutdown-timeout-s", "60")
    wait_process_ready(url, process, server_log(tmp_path / "repo"))
    rows = np.random.default_rng(0).normal(size=(5000, 1024)).astype(np.float32)
    header = json.dumps({"inputs": [{"name": "x", "shape": [5000, 1024], "datatype": "FP32",
                                     "parameters": {"binary_data_size": rows.nbytes}}]}).encode()  # fmt: skip
    answers: list[httpx.Response] = []

    def slow_request() -> None:
        answers.append(httpx.post(
            f"{url}/v2/models/slow/infer", content=header + rows.tobytes(), timeout=120,
            headers={"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"},
        ))  # fmt: skip

    worker = threading.Thread(target=slow_request)
    worker.start()
    try:
        time.sleep(1.0)  # the request has been sent (its connection is accepted, its body on the way)
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while True:  # new connections are refused soon after the signal, while the request is still computed
            try:
                httpx.get(f"{url}/v2/health/live", timeout=5)
            except httpx.TransportError:
                break
            assert time.monotonic() < deadline, "new connections were still accepted 30 s after SIGTERM"
            time.sleep(0.05)
        assert not answers, "the request in flight was answered before new connections were refused"
        worker.join(timeout=120)
        assert process.wait(timeout=60) == 0
        assert answers and answers[0].status_code == 200, answers[0].text if answers else "no answer"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def test_sigterm_turns_readiness_off_before_the_server_stops(settings: Settings) -> None:
    from layerserve.server import Server

    async def scenario() -> None:
        server = Server(settings.model_copy(update={"reload_interval_s": 0}), settle_first=True)
        await server.start()
        assert server.runtime.is_ready
        server.request_exit()  # what SIGTERM and SIGINT call (Server.run)
        assert not server.runtime.is_ready and not await server.runtime.readiness()  # before anything stops
        await server.stop()

    asyncio.run(scenario())


def test_logs_go_to_stdout_or_a_file_as_json_lines(tmp_path: Path) -> None:
    script = (
        "import logging, sys; from pathlib import Path; from layerserve.logs import configure_logging; "
        "configure_logging('info', 'json', Path(sys.argv[1]) if sys.argv[1] != 'none' else None); "
        "logging.getLogger('layerserve.access').info('GET /x', extra={'status': 200}); "
        "logging.getLogger('layerserve.x').debug('hidden')"
    )
    for target in ("-", str(tmp_path / "server.log"), "none"):
        done = subprocess.run([sys.executable, "-c", script, target], capture_output=True, text=True, check=True)
        written = {"-": done.stdout, "none": done.stderr}.get(target) or (tmp_path / "server.log").read_text()
        lines = [json.loads(line) for line in written.splitlines() if line.startswith("{")]
        assert [(line["logger"], line["message"], line["status"]) for line in lines] == [
            ("layerserve.access", "GET /x", 200)
        ], target


def test_gpu_memory_is_read_from_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from layerserve.metrics import gpu_memory

    fake = tmp_path / "nvidia-smi"  # prints what the real tool prints for these flags, on two GPUs
    fake.write_text("#!/bin/sh\nprintf '0, 1024, 81920\\n1, 0, 81920\\n'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert gpu_memory() == [("0", 1024 << 20, 81920 << 20), ("1", 0, 81920 << 20)]
