"""Shared by the benchmarks: a closed-loop HTTP load generator and a server in a subprocess."""

from __future__ import annotations

import http.client
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import orjson

from layerserve.engine import probe_batch
from layerserve.tensors import TensorSpec


def binary_request(inputs: tuple[TensorSpec, ...], outputs: list[str]) -> tuple[bytes, dict[str, str]]:
    """A V2 binary infer body of one probe row, asking for `outputs` (all when empty) as binary data."""
    batch = probe_batch(inputs, 1)
    entries = [
        {"name": spec.name, "shape": list(array.shape), "datatype": spec.datatype,
         "parameters": {"binary_data_size": array.nbytes}}
        for spec, array in zip(inputs, batch, strict=True)
    ]  # fmt: skip
    header: dict[str, object] = {"inputs": entries, "parameters": {"binary_data_output": True}}
    if outputs:
        header["outputs"] = [{"name": name} for name in outputs]
    raw = orjson.dumps(header)
    headers = {"Inference-Header-Content-Length": str(len(raw)), "Content-Type": "application/octet-stream"}
    return raw + b"".join(a.tobytes() for a in batch), headers


def drive(port: int, path: str, body: bytes, headers: dict[str, str], clients: int, seconds: float) -> dict[str, float]:
    """Closed-loop clients on keep-alive connections for `seconds`: req/s, p50, p99 and errors."""
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def client() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        mine = []
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            connection.request("POST", path, body=body, headers=headers)
            response = connection.getresponse()
            response.read()
            mine.append(time.perf_counter() - started)
            if response.status != 200:
                with lock:
                    errors[0] += 1
        connection.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    ms = np.array(latencies) * 1000
    return {
        "req_s": len(latencies) / elapsed,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "errors": errors[0],
    }


def start_server(repository: Path, cache: Path, port: int) -> subprocess.Popen[bytes]:
    """`layerserve serve` in a subprocess; returns once it is ready."""
    command = [sys.executable, "-m", "layerserve", "serve", str(repository), "--port", str(port)]
    process = subprocess.Popen(
        [*command, "--engine-cache-dir", str(cache), "--log-level", "warning"], stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/v2/health/ready")
            if connection.getresponse().status == 200:
                return process
        except OSError:
            pass
        time.sleep(0.2)
    process.kill()
    raise TimeoutError("server did not become ready")
