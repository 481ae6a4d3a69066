"""`layerserve export` fills the export cache a server then starts on (no preparer child, no TensorFlow in the
serving process, answers equal to Keras'); a model that cannot be prepared is reported by name and fails the exit
status; an unwritable cache is one clear error."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.live_server import (
    free_port,
    maps_tensorflow,
    preparer_children,
    server_log,
    start_server_process,
    wait_process_ready,
)
from tests.models import build_mlp, build_multi, load_reference, save_model
from tests.read_only import read_only

pytestmark = pytest.mark.slow


def _export(repository: Path, cache: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "layerserve", "export", str(repository), "--engine-cache-dir", str(cache)]
    return subprocess.run([*command, *flags], capture_output=True, text=True, timeout=600, check=False)


def _infer(url: str, model: str, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    tensors = [
        {"name": name, "shape": list(array.shape), "datatype": "FP32" if array.dtype == np.float32 else "INT32",
         "data": array.ravel().tolist()}
        for name, array in inputs.items()
    ]  # fmt: skip
    answer = httpx.post(f"{url}/v2/models/{model}/infer", json={"inputs": tensors}, timeout=60)
    assert answer.status_code == 200, answer.text
    return [np.array(output["data"]).reshape(output["shape"]) for output in answer.json()["outputs"]]


def test_a_server_starts_on_the_exported_cache_without_preparing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo, cache = tmp_path / "repo", tmp_path / "cache"
    save_model(build_mlp(1), repo / "mlp" / "1", "model.keras")
    save_model(build_multi(), repo / "multi" / "1", "model.keras")
    save_model(build_mlp(4), repo / "on_keras" / "1", "model.keras")
    (repo / "on_keras" / "config.yaml").write_text("engine: keras\n")
    (repo / "corrupt" / "1").mkdir(parents=True)
    (repo / "corrupt" / "1" / "model.keras").write_bytes(b"PK\x03\x04 this is not a zip file")

    first = _export(repo, cache)
    assert first.returncode == 1, first.stdout + first.stderr
    lines = first.stdout.splitlines()
    assert any(line.startswith("corrupt version 1: FAILED: ") and "not a .keras archive" in line for line in lines)
    for model in ("mlp", "multi"):
        assert any(line.startswith(f"{model} version 1: exported: ONNX verified against Keras") for line in lines)
    assert "on_keras version 1: skipped: engine: keras" in first.stdout
    assert lines[-1] == f"4 models, 4 versions into {cache}: 2 exported, 0 cached, 0 on Keras, 1 skipped, 1 failed"

    shutil.rmtree(repo / "corrupt")
    again = _export(repo, cache, "--models", "!on_keras")
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.splitlines()[-1] == (
        f"2 models, 2 versions into {cache}: 0 exported, 2 cached, 0 on Keras, 0 skipped, 0 failed"
    )

    for path in cache.rglob("*"):  # readable by the server's user, if another exported (an image build's root)
        wanted = 0o055 if path.is_dir() else 0o044
        assert path.stat().st_mode & wanted == wanted, (path, oct(path.stat().st_mode))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the server's job records go there
    with read_only(repo), read_only(cache):  # as a container mounts them
        _serve_without_preparing(repo, cache)


def _serve_without_preparing(repo: Path, cache: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # A preparer child that ran at this start would still be there, 10 minutes long.
    process = start_server_process(repo, cache, port, "--models", "!on_keras", "--preparer-idle-s", "600")
    try:
        wait_process_ready(url, process, server_log(repo))
        rng = np.random.default_rng(7)
        x = rng.normal(size=(3, 10)).astype(np.float32)
        (scores,) = _infer(url, "mlp", {"x": x})
        np.testing.assert_allclose(scores, np.asarray(load_reference(repo, "mlp", 1)(x)), atol=1e-5)
        features = rng.normal(size=(2, 4)).astype(np.float32)
        tokens = rng.integers(0, 10, (2, 3)).astype(np.int32)
        regression, probs = _infer(url, "multi", {"features": features, "tokens": tokens})
        want = load_reference(repo, "multi", 1)([features, tokens])
        np.testing.assert_allclose(regression, np.asarray(want[0]), atol=1e-5)
        np.testing.assert_allclose(probs, np.asarray(want[1]), atol=1e-5)
        index = httpx.post(f"{url}/v2/repository/index", timeout=30).json()
        assert sorted((row["name"], row["state"]) for row in index) == [("mlp", "READY"), ("multi", "READY")]
        assert preparer_children(process.pid) == []
        assert not maps_tensorflow(process.pid)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0


def test_an_unwritable_cache_or_a_missing_repository_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    unwritable = _export(tmp_path, tmp_path / "a-file" / "cache")
    assert unwritable.returncode == 2 and unwritable.stdout == ""
    assert f"the engine cache {tmp_path / 'a-file' / 'cache'} cannot be written" in unwritable.stderr
    missing = _export(tmp_path / "nowhere", tmp_path / "cache")
    assert missing.returncode == 2 and f"model repository {tmp_path / 'nowhere'} is not a folder" in missing.stderr
