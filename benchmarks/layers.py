"""Full model vs a middle layer vs a feature layer, served, and the first-request latency of a new cut.

    .venv/bin/python benchmarks/layers.py [--layer block7_add] [--duration-s 8] [--concurrency 4]

Builds the demo repository when --repository is not given and serves it in a subprocess. For each
requested output it times the very first request (the cut is built and served on the Keras compiled
call at once), then the time until the cut's background ONNX export is verified and serving, then
the served throughput (V2 binary infer, one image per request).
"""

from __future__ import annotations

import argparse
import http.client
import os
import tempfile
import time
from pathlib import Path

import orjson

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from layerserve.demo import build_demo_repository
from layerserve.tensors import TensorSpec
from loadgen import binary_request, drive, start_server


def _get(port: int, path: str) -> dict[str, object]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("GET", path)
    body: dict[str, object] = orjson.loads(connection.getresponse().read())
    return body


def _post(port: int, path: str, body: bytes, headers: dict[str, str]) -> float:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    started = time.perf_counter()
    connection.request("POST", path, body=body, headers=headers)
    response = connection.getresponse()
    response.read()
    if response.status != 200:
        raise RuntimeError(f"{response.status} for {path}")
    return time.perf_counter() - started


def _wait_for_onnx(port: int, model: str, output: str, limit_s: float = 300) -> float:
    """Seconds until the cut for `output` runs on ONNX (polls the model's metadata)."""
    started = time.perf_counter()
    while time.perf_counter() - started < limit_s:
        cuts = _get(port, f"/v2/models/{model}")["cuts"]
        assert isinstance(cuts, list)
        if any(c["outputs"] == [output] and c["engine"] == "onnx" for c in cuts):
            return time.perf_counter() - started
        time.sleep(0.1)
    return float("nan")


def main() -> None:
    """Run the benchmark and print a table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=None)
    parser.add_argument("--model", default="efficientnet_lite0")
    parser.add_argument("--layer", default="block7_add", help="a middle layer")
    parser.add_argument("--feature", default="avg_pool", help="a feature-vector layer")
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--port", type=int, default=8766)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="layerserve-bench-"))
    repository = args.repository or work / "repo"
    if args.repository is None:
        build_demo_repository(repository)
    process = start_server(repository, work / "cache", args.port)
    try:
        meta = _get(args.port, f"/v2/models/{args.model}")
        inputs = tuple(TensorSpec(i["name"], i["datatype"], tuple(i["shape"])) for i in meta["inputs"])  # type: ignore[attr-defined]
        path = f"/v2/models/{args.model}/infer"
        rows = []
        for output in ("", args.layer, args.feature):
            body, headers = binary_request(inputs, [output] if output else [])
            first_s = _post(args.port, path, body, headers)
            onnx_s = _wait_for_onnx(args.port, args.model, output) if output else 0.0
            result = drive(args.port, path, body, headers, args.concurrency, args.duration_s)
            rows.append((output or "(model output)", first_s, onnx_s, result))
        full = rows[0][3]["req_s"]
        print(f"\n| output | first request ms | ONNX ready after s | req/s (c={args.concurrency}) | p50 ms | vs full |")
        print("|---|---|---|---|---|---|")
        for name, first_s, onnx_s, result in rows:
            print(
                f"| {name} | {first_s * 1000:.0f} | {onnx_s:.1f} | {result['req_s']:.1f} | {result['p50_ms']:.1f} "
                f"| {result['req_s'] / full:.2f} |"
            )
    finally:
        process.terminate()
        process.wait(timeout=30)


if __name__ == "__main__":
    main()
