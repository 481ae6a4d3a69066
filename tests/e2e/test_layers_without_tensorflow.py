"""Layer outputs and cuts of the demo EfficientNet from `layerserve serve` in a process of its own: they equal
Keras', and the server process never maps TensorFlow (the cuts come out of the verified export)."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import httpx
import keras
import numpy as np
import pytest

from tests.demo.test_demo import chelsea_batch, package_file
from tests.live_server import free_port, server_log, start_server_process, wait_process_ready

pytestmark = pytest.mark.slow


def _maps_tensorflow(pid: int) -> bool:
    return "tensorflow" in Path(f"/proc/{pid}/maps").read_text()


def _resident_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    assert match is not None
    return int(match[1]) / 1024


def test_layer_outputs_and_cuts_never_load_tensorflow_into_the_server(
    demo_repository: Path, demo_engine_cache: Path, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "efficientnet_lite0").symlink_to(demo_repository / "efficientnet_lite0", target_is_directory=True)
    model = keras.saving.load_model(demo_repository / "efficientnet_lite0" / "1" / "model.keras")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_server_process(repo, demo_engine_cache, port)
    try:
        wait_process_ready(url, process, server_log(repo))
        assert not _maps_tensorflow(process.pid)
        before = _resident_mb(process.pid)
        photo = package_file("skimage", "data/chelsea.png").read_bytes()
        # head_relu has a tensor of its own in the export; block7_expand is a convolution whose batch normalization
        # the export folded in (found at the normalization's output, scaled back).
        for layer in ("head_relu", "block7_expand"):
            answer = httpx.post(
                f"{url}/v2/models/efficientnet_lite0/features?layer={layer}&pool=avg&cache=false",
                files={"image": ("chelsea.png", photo, "image/png")}, timeout=120,
            )  # fmt: skip
            assert answer.status_code == 200, answer.text
            keras_layer = keras.Model(model.inputs, model.get_layer(layer).output)(chelsea_batch())
            want = np.asarray(keras_layer).mean(axis=(1, 2))[0]
            np.testing.assert_allclose(answer.json()["features"][0], want, atol=2e-3)

        pooled = np.random.default_rng(0).uniform(0, 6, (2, 1280)).astype(np.float32)
        tensor = {"name": "avg_pool", "shape": [2, 1280], "datatype": "FP32", "data": pooled.ravel().tolist()}
        body = {"inputs": [tensor], "parameters": {"cache": False}}
        cut = httpx.post(f"{url}/v2/models/efficientnet_lite0/infer", json=body, timeout=120)
        assert cut.status_code == 200, cut.text
        tail = keras.Model(model.get_layer("avg_pool").output, model.output)
        scores = np.array(cut.json()["outputs"][0]["data"], np.float32).reshape(2, 1000)
        np.testing.assert_allclose(scores, np.asarray(tail(pooled)), atol=1e-5)

        cuts = httpx.get(f"{url}/v2/models/efficientnet_lite0").json()["cuts"]
        assert len(cuts) == 3 and all("cut out of the verified export" in c["engine_reason"] for c in cuts), cuts
        assert not _maps_tensorflow(process.pid)  # the server never loaded TensorFlow
        # Three sessions (two are nearly the whole network, with their activations) and the onnx package; TensorFlow
        # alone would add about 750 MB.
        assert _resident_mb(process.pid) - before < 300
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
