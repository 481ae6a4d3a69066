"""Many concurrent clients with distinct inputs against two models: every answer equals Keras."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from tests.live_server import LiveServer
from tests.models import load_reference

CLIENTS = 16
DURATION_S = 4.0


@pytest.mark.slow
def test_16_clients_two_models_no_errors_no_mismatches(server: LiveServer, repository: Path) -> None:
    mlp = load_reference(repository, "mlp", 2)
    multi = load_reference(repository, "multi", 1)
    lock = threading.Lock()
    errors: list[str] = []
    checked = [0]

    def client(index: int) -> None:
        rng = np.random.default_rng(index)
        deadline = time.monotonic() + DURATION_S
        with httpx.Client(base_url=server.url, timeout=30) as http:
            while time.monotonic() < deadline:
                rows = int(rng.integers(1, 5))
                if index % 2:
                    x = rng.normal(size=(rows, 10)).astype(np.float32)
                    body = {"inputs": [{"name": "x", "shape": [rows, 10], "datatype": "FP32", "data": x.tolist()}]}
                    response = http.post("/v2/models/mlp/versions/2/infer", content=orjson.dumps(body))
                    expected = [mlp(x).numpy()]
                else:
                    f = rng.normal(size=(rows, 4)).astype(np.float32)
                    t = rng.integers(0, 10, size=(rows, 3)).astype(np.int32)
                    body = {
                        "inputs": [
                            {"name": "features", "shape": [rows, 4], "datatype": "FP32", "data": f.tolist()},
                            {"name": "tokens", "shape": [rows, 3], "datatype": "INT32", "data": t.tolist()},
                        ]
                    }
                    response = http.post("/v2/models/multi/infer", content=orjson.dumps(body))
                    expected = [o.numpy() for o in multi([f, t])]
                with lock:
                    if response.status_code != 200:
                        errors.append(f"{response.status_code}: {response.text}")
                        continue
                    outputs = response.json()["outputs"]
                    for output, reference in zip(outputs, expected, strict=True):
                        got = np.array(output["data"], dtype=np.float32).reshape(reference.shape)
                        if not np.allclose(got, reference, atol=1e-4):
                            errors.append(f"mismatch in {output['name']}: {np.abs(got - reference).max()}")
                    checked[0] += 1

    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(client, range(CLIENTS)))
    assert errors == []
    assert checked[0] > CLIENTS
