"""`layerserve ray serve --address local` as a user runs it: a local Ray, every model served (one in a group of
its own), over HTTP (Ray's proxy, and the replica's own direct port) and gRPC, its replicas at niceness 0;
SIGTERM stops it with status 0 and no Ray process left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from layerserve.settings import Settings
from layerserve.transports.ray.replica import REPLICA_HEADER
from tests.live_server import free_port
from tests.tls_files import make_authority
from tests.transports.ray.processes import ray_processes

pytestmark = pytest.mark.slow


def _check_serving(process: subprocess.Popen[str], port: int, grpc_port: int, direct_port: int) -> None:
    """The command prints its URLs once every model is ready, serves (HTTP through Ray's proxy and the direct
    port, and gRPC), and exits 0 on SIGTERM (killed otherwise)."""
    import tritonclient.grpc as grpcclient

    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # printed once every model is ready
        assert f"http://127.0.0.1:{port}" in line and f"direct http://127.0.0.1:{direct_port}" in line, line
        ready = httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=30)
        assert ready.status_code == 200 and REPLICA_HEADER in ready.headers
        metadata = httpx.get(f"http://127.0.0.1:{port}/v2/models/mlp", timeout=30).json()
        assert metadata["state"] == "READY" and metadata["inputs"][0]["name"] == "x"
        grouped = httpx.get(f"http://127.0.0.1:{port}/v2/models/multi", timeout=30)  # the group's replica
        assert grouped.status_code == 200 and grouped.json()["state"] == "READY", grouped.text
        x = {"inputs": [{"name": "x", "shape": [1, 10], "datatype": "FP32", "data": list(range(10))}]}
        proxied = httpx.post(f"http://127.0.0.1:{port}/v2/models/mlp/infer", json=x, timeout=30)
        direct = httpx.post(f"http://127.0.0.1:{direct_port}/v2/models/mlp/infer", json=x, timeout=30)
        assert direct.status_code == 200 and direct.json()["outputs"] == proxied.json()["outputs"], direct.text
        assert direct.headers[REPLICA_HEADER] == proxied.headers[REPLICA_HEADER]  # the one replica
        grouped = httpx.get(f"http://127.0.0.1:{direct_port}/v2/models/multi", timeout=30)  # handed to the group
        assert grouped.status_code == 200 and grouped.json()["state"] == "READY", grouped.text
        replicas = [pid for pid in ray_processes() if b"ServeReplica" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert replicas and all(os.getpriority(os.PRIO_PROCESS, pid) == 0 for pid in replicas)  # not Ray's 15
        grpc_client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        assert grpc_client.is_server_ready() and grpc_client.is_model_ready("mlp")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    except BaseException:
        process.kill()
        raise


def test_ray_serve_command_serves_until_sigterm(repository: Path, settings: Settings, tmp_path: Path) -> None:
    small = tmp_path / "repo"
    small.mkdir()
    (small / "mlp").symlink_to(repository / "mlp")
    (small / "multi").symlink_to(repository / "multi")
    before, port, grpc_port, direct_port = ray_processes(), free_port(), free_port(), free_port()
    command = [
        sys.executable, "-m", "layerserve", "ray", "serve", str(small), "--address", "local", "--http-port",
        str(port), "--replicas", "1", "--replica-cpus", "0.5", "--engine-cache-dir", str(settings.engine_cache_dir),
        "--reload-interval-s", "0", "--grpc-port", str(grpc_port), "--group", "multi:1:0.25", "--direct-port",
        str(direct_port),
    ]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
        _check_serving(process, port, grpc_port, direct_port)
    deadline = time.monotonic() + 30
    while ray_processes() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not ray_processes() - before, "Ray processes outlived `layerserve ray serve`"


def test_replicas_a_local_ray_cannot_place_are_refused_with_what_to_change(repository: Path, tmp_path: Path) -> None:
    before = ray_processes()
    command = [
        sys.executable, "-m", "layerserve", "ray", "serve", str(repository / "mlp"), "--address", "local",
        "--http-port", str(free_port()), "--replicas", "2", "--replica-cpus", "4096", "--grpc-port", "0",
    ]  # fmt: skip
    finished = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 2, finished.stderr[-2000:]
    assert "a replica of layerserve needs 4096 CPU and no node has more than" in finished.stderr
    assert "--replica-cpus" in finished.stderr  # what to change
    deadline = time.monotonic() + 30
    while ray_processes() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not ray_processes() - before, "Ray processes outlived the refusal"


def test_ray_serve_over_tls_on_proxy_and_direct_port(repository: Path, settings: Settings, tmp_path: Path) -> None:
    authority = make_authority(tmp_path / "ca")
    issued = authority.issue(tmp_path, "server")
    small = tmp_path / "repo"
    small.mkdir()
    (small / "mlp").symlink_to(repository / "mlp")
    before, port, direct_port = ray_processes(), free_port(), free_port()
    tls = ["--tls-cert-file", str(issued.cert), "--tls-key-file", str(issued.key)]
    command = [
        sys.executable, "-m", "layerserve", "ray", "serve", str(small), "--address", "local", "--http-port",
        str(port), "--replicas", "1", "--replica-cpus", "0.5", "--engine-cache-dir", str(settings.engine_cache_dir),
        "--reload-interval-s", "0", "--direct-port", str(direct_port), *tls,
    ]  # fmt: skip
    refused = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)  # gRPC on by default
    assert refused.returncode == 2 and "Ray Serve's gRPC proxy speaks no TLS" in refused.stderr, refused.stderr
    mutual = ["--tls-client-ca-file", str(authority.cert_file)]
    refused = subprocess.run([*command, "--grpc-port", "0", *mutual], check=False, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
    assert refused.returncode == 2 and "no mutual TLS there" in refused.stderr, refused.stderr
    x = {"inputs": [{"name": "x", "shape": [1, 10], "datatype": "FP32", "data": list(range(10))}]}
    with subprocess.Popen([*command, "--grpc-port", "0"], stdout=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline()  # printed once every model is ready
            assert f"https://127.0.0.1:{port}" in line and f"direct https://127.0.0.1:{direct_port}" in line, line
            with httpx.Client(verify=authority.client_context(), timeout=30) as client:
                proxied = client.post(f"https://127.0.0.1:{port}/v2/models/mlp/infer", json=x)
                direct = client.post(f"https://127.0.0.1:{direct_port}/v2/models/mlp/infer", json=x)
            assert proxied.status_code == 200 and direct.json()["outputs"] == proxied.json()["outputs"], direct.text
            with pytest.raises(httpx.TransportError):
                httpx.get(f"http://127.0.0.1:{direct_port}/v2/health/live", timeout=30)
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=60) == 0
        except BaseException:
            process.kill()
            raise
    deadline = time.monotonic() + 30
    while ray_processes() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not ray_processes() - before, "Ray processes outlived `layerserve ray serve`"
