"""The Python API's examples, run as a user would: a Flask app and a Tornado app with their own routes,
serving the demo repository to concurrent clients; answers equal Keras."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import keras
import numpy as np
import pytest

from tests.live_server import free_port

EXAMPLES = Path(__file__).parents[2] / "examples"


def _wait(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert process.poll() is None, "the example exited"
        try:
            httpx.get(url, timeout=5)
            return
        except httpx.TransportError:
            time.sleep(0.3)
    raise AssertionError("the example did not start")


@pytest.mark.slow
@pytest.mark.parametrize("example", ["flask_app.py", "tornado_app.py"])
def test_example_apps_serve_concurrent_requests_equal_to_keras(example: str, demo_repository: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, str(EXAMPLES / example), str(demo_repository), str(port)])
    try:
        _wait(url, process)
        model = keras.saving.load_model(demo_repository / "token_classifier" / "1" / "model.keras", compile=False)
        rng = np.random.default_rng(8)
        tokens = [rng.integers(0, 1000, (1, 64)).astype(np.int32) for _ in range(48)]
        with httpx.Client(timeout=60) as client, ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(
                lambda t: client.post(f"{url}/predict/token_classifier", json={"inputs": {"tokens": t.tolist()}}),
                tokens,
            ))  # fmt: skip
            bad = client.post(f"{url}/predict/token_classifier", json={"inputs": {"tokens": [[5000] * 64]}})
        for sent, answer in zip(tokens, answers, strict=True):
            assert answer.status_code == 200, answer.text
            scores = np.array(answer.json()["outputs"]["scores"], np.float32)
            np.testing.assert_allclose(scores, np.asarray(model(sent)), atol=1e-5)
        assert bad.status_code == 400 and "Embedding" in bad.json()["error"], bad.text
    finally:
        process.terminate()
        process.wait(timeout=60)
