"""The command line, run as a real subprocess."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from tests.live_server import free_port

LAYERSERVE = [sys.executable, "-m", "layerserve"]
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}


def test_models_lists_versions_inputs_outputs_and_layers(repository: Path) -> None:
    result = subprocess.run(
        [*LAYERSERVE, "models", str(repository)], capture_output=True, text=True, env=ENV, check=True
    )
    lines = result.stdout.splitlines()
    assert "multi" in lines
    assert "  version 1: 7 layers" in lines
    assert "    input  tokens: INT32 [-1, 3]" in lines
    assert "    output probs: FP32 [-1, 5]" in lines
    assert "  version 1: FAILED: model.keras is not a .keras archive (a zip file): corrupt or truncated" in lines
    assert "misconfigured  INVALID: " in "\n".join(lines)
    # TensorFlow's import notices, written whatever TF_CPP_MIN_LOG_LEVEL says, are left out: only the warning comes.
    assert result.stderr.splitlines() == [
        f"model misconfigured: {repository}/misconfigured/config.yaml: key 'max_batch_sise': unknown key"
    ]


def test_models_of_a_folder_without_model_folders_says_what_it_expected(tmp_path: Path) -> None:
    result = subprocess.run(
        [*LAYERSERVE, "models", str(tmp_path)], capture_output=True, text=True, env=ENV, check=False
    )
    assert result.returncode == 2 and result.stdout == ""
    assert (
        result.stderr
        == f"layerserve: {tmp_path} has no model folders: expected {tmp_path}/<model>/<version>/model.keras\n"
    )


def test_ray_serve_without_the_ray_extra_says_how_to_install_it(repository: Path) -> None:
    # As in a checkout set up by scripts/demo (no extras): `import ray` fails.
    code = "import sys; sys.modules['ray'] = None; from layerserve.cli import main; sys.exit(main(sys.argv[1:]))"
    command = [sys.executable, "-c", code, "ray", "serve", str(repository), "--address", "local"]
    result = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=120, check=False)
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr == (
        "layerserve: layerserve ray serve needs the ray extra (ray is not installed): in a checkout, "
        "scripts/install --dev, or .venv/bin/pip install -c constraints.txt -e '.[ray]'\n"
    )


def test_serve_rejects_a_missing_repository(tmp_path: Path) -> None:
    result = subprocess.run(
        [*LAYERSERVE, "serve", str(tmp_path / "nope")], capture_output=True, text=True, env=ENV, check=False
    )
    assert result.returncode == 2 and "is not a folder" in result.stderr


def test_bad_setting_is_named(tmp_path: Path) -> None:
    env = {**ENV, "LAYERSERVE_PORT": "eighty"}
    result = subprocess.run([*LAYERSERVE, "serve", str(tmp_path)], capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 2 and "setting 'port'" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flag", "workers"),
    [("--port", "1"), ("--grpc-port", "1"), ("--grpc-port", "2")],
    ids=["http", "grpc", "grpc of 2 workers"],
)
def test_serve_refuses_a_port_another_program_listens_on_before_loading(
    repository: Path, flag: str, workers: str
) -> None:
    ports = {"--port": free_port(), "--grpc-port": free_port()}
    with socket.create_server(("127.0.0.1", ports[flag])):  # another program, listening
        command = [*LAYERSERVE, "serve", str(repository), "--workers", workers]
        command += [part for name, port in ports.items() for part in (name, str(port))]
        result = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=120, check=False)
    # Several workers bind the gRPC port with SO_REUSEPORT: without the check, each bound it beside the other program.
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"layerserve: cannot listen on 127.0.0.1:{ports[flag]}: another program listens there; stop it, or choose "
        f"another port with {flag}" + (" (0: no gRPC service)" if flag == "--grpc-port" else "")
    ]  # one line, before anything loads


def test_serve_end_to_end(repository: Path, tmp_path: Path) -> None:
    port = free_port()
    command = [*LAYERSERVE, "serve", str(repository), "--port", str(port), "--grpc-port", "0"]
    command += ["--engine-cache-dir", str(tmp_path), "--engine", "keras"]
    log = tmp_path / "server.log"
    with log.open("wb") as output:
        process = subprocess.Popen(command, env=ENV, stdout=output, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        ready = False
        while time.monotonic() < deadline and not ready:
            try:
                ready = httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200
            except httpx.TransportError:
                time.sleep(0.2)
        assert ready, log.read_text()
        body = {"inputs": [{"name": "x", "shape": [1, 10], "datatype": "FP32", "data": np.ones(10).tolist()}]}
        answer = httpx.post(f"{url}/v2/models/mlp/infer", content=orjson.dumps(body)).json()
        assert sum(answer["outputs"][0]["data"]) == pytest.approx(1.0, abs=1e-5)
        assert httpx.get(f"{url}/v2/models/mlp").json()["engine"] == "keras"
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    # The server imported TensorFlow for Keras: its import notices (absl's, oneDNN's) are left out of the log.
    assert "absl::InitializeLog" not in log.read_text() and "oneDNN" not in log.read_text(), log.read_text()
