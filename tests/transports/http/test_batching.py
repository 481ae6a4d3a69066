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
from tests.live_server import LiveServer, start_server
from tests.models import load_reference

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

    def resident(self) -> tuple[int, int]:
        """The wrapped engine's (for the version's memory in /metrics)."""
        resident: tuple[int, int] = self._engine.resident()
        return resident

    def close(self) -> None:
        """Free the wrapped engine (the server stops)."""
        self._engine.close()


@pytest.fixture
def gated(repository: Path, tmp_path: Path, engine_cache: Path) -> Iterator[tuple[LiveServer, GatedEngine]]:
    mlp_only = tmp_path / "repo"
    (mlp_only / "mlp").mkdir(parents=True)
    (mlp_only / "mlp" / "1").symlink_to(repository / "mlp" / "1")
    settings = Settings(model_repository=mlp_only, engine_cache_dir=engine_cache, max_queue_size=2, inline_max_ms=0)
    live = start_server(settings)  # inline_max_ms=0: the gated engine must block its thread, not the loop
    version = live.server.runtime.registry.get("mlp")
    engine = GatedEngine(version.engine, threading.Event())
    version.engine = engine
    yield live, engine
    engine.gate.set()
    live.stop()


def _in_flight(http: httpx.Client) -> float:
    found = re.search(r"^layerserve_requests_in_flight (\S+)$", http.get("/metrics").text, re.M)
    assert found, "no layerserve_requests_in_flight"
    return float(found[1])


def test_queue_full_is_503_and_deadline_is_504(gated: tuple[LiveServer, GatedEngine]) -> None:
    live, engine = gated
    x = np.ones((1, 10), np.float32)
    with ThreadPoolExecutor(4) as pool, httpx.Client(base_url=live.url, timeout=60) as http:
        url = "/v2/models/mlp/infer"
        running = pool.submit(httpx.post, f"{live.url}{url}", content=_body(x), timeout=60)
        assert engine.entered.wait(timeout=30)
        queued = [pool.submit(httpx.post, f"{live.url}{url}", content=_body(x), timeout=60) for _ in range(2)]
        version = live.server.runtime.registry.get("mlp")
        for _ in range(3000):  # the two requests are on their way into the queue (at most 30 s)
            if version.batching()["queued"] == 2:
                break
            threading.Event().wait(0.01)
        full = http.post(url, content=_body(x))
        assert full.status_code == 503 and full.headers["Retry-After"] == "1"
        assert "queue of model mlp is full (2 requests)" in full.json()["error"]
        assert _in_flight(http) == 4  # the three held, and this very request
        engine.gate.set()
        assert [f.result().status_code for f in (running, *queued)] == [200, 200, 200]
        assert _in_flight(http) == 1

        engine.gate.clear()
        engine.entered.clear()
        blocker = pool.submit(httpx.post, f"{live.url}{url}", content=_body(x), timeout=60)
        assert engine.entered.wait(timeout=30)
        late = http.post(url, content=_body(x, {"timeout_ms": 50}))
        assert late.status_code == 504 and "timed out" in late.json()["error"]
        engine.gate.set()
        assert blocker.result().status_code == 200
        assert http.get("/v2/health/live").status_code == 200


def _multi_body(features: np.ndarray, tokens: np.ndarray, outputs: tuple[str, ...] = ()) -> bytes:
    body: dict[str, object] = {
        "inputs": [
            {"name": "features", "shape": list(features.shape), "datatype": "FP32", "data": features},
            {"name": "tokens", "shape": list(tokens.shape), "datatype": "INT32", "data": tokens},
        ]
    }
    if outputs:
        body["outputs"] = [{"name": name} for name in outputs]
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


@pytest.mark.parametrize("bad_token", [10, 1073, -1])
def test_a_token_past_the_vocabulary_fails_alone_and_its_batch_mates_equal_keras(
    server: LiveServer, repository: Path, bad_token: int
) -> None:
    reference = load_reference(repository, "multi", 1)
    rng = np.random.default_rng(bad_token % 97)
    url = f"{server.url}/v2/models/multi/infer"
    with httpx.Client(timeout=60) as client, ThreadPoolExecutor(25) as pool:
        for _ in range(10):
            features = rng.normal(size=(25, 1, 4)).astype(np.float32)
            tokens = rng.integers(0, 10, size=(25, 1, 3)).astype(np.int32)
            culprit = int(rng.integers(25))
            tokens[culprit, 0, 2] = bad_token
            bodies = [_multi_body(features[i], tokens[i]) for i in range(25)]
            answers = list(pool.map(lambda body: client.post(url, content=body), bodies))
            for index, answer in enumerate(answers):
                if index == culprit:
                    assert answer.status_code == 400, answer.text
                    message = answer.json()["error"]
                    assert f"input 'tokens': value {bad_token} at position [0, 2]" in message, message
                    assert "Embedding 'embedding' of 10 rows" in message and "from 0 to 9" in message, message
                    continue
                assert answer.status_code == 200, (index, answer.text)
                outputs = {o["name"]: np.array(o["data"], np.float32) for o in answer.json()["outputs"]}
                expected = reference([features[index], tokens[index]])
                np.testing.assert_allclose(outputs["regression"], np.ravel(expected[0]), atol=1e-5)
                np.testing.assert_allclose(outputs["probs"], np.ravel(expected[1]), atol=1e-5)
        tokens = np.array([[1, 2, bad_token]], np.int32)
        cut = client.post(url, content=_multi_body(np.zeros((1, 4), np.float32), tokens, ("embedding",)))
        assert cut.status_code == 400 and "input 'tokens'" in cut.json()["error"], cut.text
