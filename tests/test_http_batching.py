"""Dynamic batching over HTTP: 32 concurrent clients get exactly their rows; 503 and 504 under pressure."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from layerserve.settings import Settings
from tests.conftest import load_reference
from tests.live_server import LiveServer, start_server

CLIENTS = 32
REQUESTS_PER_CLIENT = 12


def _body(x: np.ndarray, parameters: dict[str, object] | None = None) -> bytes:
    body: dict[str, object] = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x}]}
    if parameters:
        body["parameters"] = parameters
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def _batch_sizes(server: LiveServer, model: str, version: str) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    pattern = rf'layerserve_batch_size_bucket{{le="([^"]+)",model="{model}",version="{version}"}} (\S+)'
    return {le: float(count) for le, count in re.findall(pattern, text)}


@pytest.mark.slow
def test_32_clients_with_1_to_7_rows_get_their_own_rows(server: LiveServer, repository: Path) -> None:
    reference = load_reference(repository, "mlp", 1)
    before = _batch_sizes(server, "mlp", "1")

    def client(index: int) -> list[str]:
        rng = np.random.default_rng(1000 + index)
        problems = []
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for _ in range(REQUESTS_PER_CLIENT):
                x = rng.normal(size=(int(rng.integers(1, 8)), 10)).astype(np.float32)
                response = http.post("/v2/models/mlp/versions/1/infer", content=_body(x))
                if response.status_code != 200:
                    problems.append(f"{response.status_code} {response.text}")
                    continue
                (output,) = response.json()["outputs"]
                got = np.array(output["data"], np.float32).reshape(output["shape"])
                if got.shape != (x.shape[0], 3) or not np.allclose(got, reference(x), atol=1e-4):
                    problems.append(f"client {index}: wrong rows for a request of {x.shape[0]}")
        return problems

    with ThreadPoolExecutor(CLIENTS) as pool:
        problems = [p for result in pool.map(client, range(CLIENTS)) for p in result]
    assert problems == []
    calls = _batch_sizes(server, "mlp", "1")["+Inf"] - before.get("+Inf", 0)
    assert calls < CLIENTS * REQUESTS_PER_CLIENT  # requests shared model calls


class GatedEngine:
    """Wraps a real engine; each call waits until the test opens the gate."""

    def __init__(self, engine: Any, gate: threading.Event) -> None:
        self.name = engine.name
        self._engine = engine
        self.gate = gate
        self.entered = threading.Event()

    def run(self, inputs: list[Any]) -> list[Any]:
        self.entered.set()
        self.gate.wait(timeout=60)
        result: list[Any] = self._engine.run(inputs)
        return result


@pytest.fixture
def gated(repository: Path, tmp_path: Path) -> Iterator[tuple[LiveServer, GatedEngine]]:
    mlp_only = tmp_path / "repo"
    (mlp_only / "mlp").mkdir(parents=True)
    (mlp_only / "mlp" / "1").symlink_to(repository / "mlp" / "1")
    settings = Settings(
        model_repository=mlp_only, engine_cache_dir=tmp_path / "cache", max_queue_size=2, inline_max_ms=0
    )
    live = start_server(settings)  # inline_max_ms=0: the gated engine must block its thread, not the loop
    version = live.server.config.app.state.registry.get("mlp")
    engine = GatedEngine(version.engine, threading.Event())
    version.engine = engine
    yield live, engine
    engine.gate.set()
    live.stop()


def test_queue_full_is_503_and_deadline_is_504(gated: tuple[LiveServer, GatedEngine]) -> None:
    live, engine = gated
    x = np.ones((1, 10), np.float32)
    with ThreadPoolExecutor(4) as pool, httpx.Client(base_url=live.url, timeout=60) as http:
        url = "/v2/models/mlp/infer"
        running = pool.submit(httpx.post, f"{live.url}{url}", content=_body(x), timeout=60)
        assert engine.entered.wait(timeout=30)
        queued = [pool.submit(httpx.post, f"{live.url}{url}", content=_body(x), timeout=60) for _ in range(2)]
        version = live.server.config.app.state.registry.get("mlp")
        for _ in range(3000):  # the two requests are on their way into the queue (at most 30 s)
            if version.batching()["queued"] == 2:
                break
            threading.Event().wait(0.01)
        full = http.post(url, content=_body(x))
        assert full.status_code == 503 and full.headers["Retry-After"] == "1"
        assert "queue of model mlp is full (2 requests)" in full.json()["error"]
        engine.gate.set()
        assert [f.result().status_code for f in (running, *queued)] == [200, 200, 200]

        engine.gate.clear()
        engine.entered.clear()
        blocker = pool.submit(httpx.post, f"{live.url}{url}", content=_body(x), timeout=60)
        assert engine.entered.wait(timeout=30)
        late = http.post(url, content=_body(x, {"timeout_ms": 50}))
        assert late.status_code == 504 and "timed out" in late.json()["error"]
        engine.gate.set()
        assert blocker.result().status_code == 200
        assert http.get("/v2/health/live").status_code == 200
