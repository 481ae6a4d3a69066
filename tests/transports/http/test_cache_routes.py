"""The feature cache over HTTP with a real redis-server: row-level hits, bypass, an outage, two processes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from layerserve.settings import Settings
from tests.live_server import LiveServer, free_port, start_server
from tests.models import load_reference
from tests.redis_server import RedisServer


def _body(x: np.ndarray, **parameters: object) -> bytes:
    body: dict[str, object] = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x}]}
    if parameters:
        body["parameters"] = parameters
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    found = re.findall(r'^layerserve_cache_(hits|misses|errors)_total{backend="redis",model="mlp"} (\S+)$', text, re.M)
    return {name: float(value) for name, value in found}


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.kill()


@pytest.fixture
def cached_repo(repository: Path, tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "mlp").mkdir(parents=True)
    shutil.copytree(repository / "mlp" / "1", repo / "mlp" / "1")
    (repo / "mlp" / "config.yaml").write_text("cache: true\n")
    return repo


@pytest.fixture
def cached_server(cached_repo: Path, redis_server: RedisServer, engine_cache: Path) -> Iterator[LiveServer]:
    settings = Settings(
        model_repository=cached_repo, engine_cache_dir=engine_cache, redis_url=redis_server.url,
        redis_timeout_ms=100, cache_key_prefix=f"t{free_port()}:",
    )  # fmt: skip
    live = start_server(settings)
    yield live
    live.stop()


def test_row_level_hits_and_bypass(cached_server: LiveServer, repository: Path) -> None:
    reference = load_reference(repository, "mlp", 1)
    rng = np.random.default_rng(5)
    a, b, c = (rng.normal(size=(1, 10)).astype(np.float32) for _ in range(3))
    url = f"{cached_server.url}/v2/models/mlp/infer"
    first = counters(cached_server.url)
    httpx.post(url, content=_body(np.concatenate([a, b])))
    second = counters(cached_server.url)
    assert delta(first, second, "misses") == 2 and delta(first, second, "hits") == 0
    answer = httpx.post(url, content=_body(np.concatenate([b, c]))).json()
    third = counters(cached_server.url)
    assert delta(second, third, "hits") == 1 and delta(second, third, "misses") == 1
    got = np.array(answer["outputs"][0]["data"], np.float32).reshape(2, 3)
    np.testing.assert_allclose(got, reference(np.concatenate([b, c])), atol=1e-5)
    httpx.post(url, content=_body(np.concatenate([a, b]), cache=False))
    assert counters(cached_server.url) == third  # bypassed: no lookup at all


@pytest.mark.slow
def test_redis_outage_fails_no_request_and_hits_resume(cached_server: LiveServer, redis_server: RedisServer) -> None:
    rows = np.random.default_rng(6).normal(size=(20, 1, 10)).astype(np.float32)
    url = f"{cached_server.url}/v2/models/mlp/infer"
    failures: list[str] = []
    stop = threading.Event()

    def client(offset: int) -> int:
        sent = 0
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                response = http.post(url, content=_body(rows[(sent + offset) % len(rows)]))
                sent += 1
                if response.status_code != 200:
                    failures.append(f"{response.status_code} {response.text}")
        return sent

    with ThreadPoolExecutor(4) as pool:
        clients = [pool.submit(client, i * 5) for i in range(4)]
        time.sleep(1.0)
        before_outage = counters(cached_server.url)
        redis_server.kill()
        time.sleep(1.5)
        during = counters(cached_server.url)
        redis_server.start()  # the same port, empty
        time.sleep(2.0)
        after = counters(cached_server.url)
        stop.set()
        sent = sum(c.result() for c in clients)
    print(  # the closing note's outage figures (pytest -s)
        f"outage: {sent} requests, {len(failures)} failed; errors during outage "
        f"{delta(before_outage, during, 'errors'):.0f}, hits after restart {delta(during, after, 'hits'):.0f}"
    )
    assert failures == [] and sent > 50
    assert delta(before_outage, during, "errors") > 0  # the outage was seen and counted
    assert delta(during, after, "hits") > 0  # hits resumed by themselves after the restart


def test_two_server_processes_share_entries(cached_server: LiveServer, cached_repo: Path, tmp_path: Path) -> None:
    settings: Any = cached_server.server.settings
    port = free_port()
    command = [sys.executable, "-m", "layerserve", "serve", str(cached_repo), "--port", str(port), "--grpc-port", "0",
               "--engine-cache-dir", str(settings.engine_cache_dir), "--redis-url", settings.redis_url,
               "--cache-key-prefix", settings.cache_key_prefix]  # fmt: skip
    log = tmp_path / "other.log"
    with log.open("wb") as output:
        other = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        )
    try:
        other_url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(f"{other_url}/v2/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        x = np.random.default_rng(7).normal(size=(2, 10)).astype(np.float32)
        httpx.post(f"{cached_server.url}/v2/models/mlp/infer", content=_body(x))  # stored by this process
        before = counters(other_url)
        answer = httpx.post(f"{other_url}/v2/models/mlp/infer", content=_body(x))
        assert answer.status_code == 200, log.read_text()
        assert delta(before, counters(other_url), "hits") == 2  # served from the other process's entries
    finally:
        other.terminate()
        other.wait(timeout=30)


def test_slow_redis_is_a_miss(cached_server: LiveServer, redis_server: RedisServer) -> None:
    url = f"{cached_server.url}/v2/models/mlp/infer"
    x = np.random.default_rng(8).normal(size=(1, 10)).astype(np.float32)
    before = counters(cached_server.url)
    sleeper = subprocess.Popen(["redis-cli", "-p", str(redis_server.port), "debug", "sleep", "1.5"])
    try:
        time.sleep(0.3)  # Redis is now blocked for 1.5 s; its socket timeout here is 100 ms
        response = httpx.post(url, content=_body(x), timeout=30)
        during = counters(cached_server.url)
    finally:
        sleeper.wait(timeout=30)
    assert response.status_code == 200
    assert delta(before, during, "errors") >= 1  # the lookup timed out and was counted; computed as a miss
    assert delta(before, during, "misses") == 1
