"""Full model vs a middle layer vs a feature layer, served, and the first-request latency of a new cut.

    .venv/bin/python benchmarks/layers.py [--layer block7_add] [--duration-s 8] [--concurrency 4]

For each requested output, on the demo EfficientNet: the very first request (the cut is built and served
on the Keras compiled call at once), the time until the cut's background ONNX export is verified and
serving, then the served throughput (V2 binary infer, one image per request).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
import urllib.request

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from demo_server import demo_server
from layerserve.bench.generator import Workload, build_workload, run_step


def _first_request_s(url: str, workload: Workload) -> float:
    request = urllib.request.Request(f"{url}{workload.path}", data=workload.body, headers=workload.headers)
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()
    return time.perf_counter() - started


def _onnx_ready_s(url: str, model: str, output: str, limit_s: float = 300) -> float:
    """Seconds until the cut for `output` runs on ONNX (polls the model's metadata)."""
    started = time.perf_counter()
    while time.perf_counter() - started < limit_s:
        with urllib.request.urlopen(f"{url}/v2/models/{model}", timeout=30) as response:
            cuts = json.loads(response.read())["cuts"]
        if any(c["outputs"] == [output] and c["engine"] == "onnx" for c in cuts):
            return time.perf_counter() - started
        time.sleep(0.1)
    return float("nan")


def main() -> None:
    """Run the benchmark and print a table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="efficientnet_lite0")
    parser.add_argument("--layer", default="block7_add", help="a middle layer")
    parser.add_argument("--feature", default="avg_pool", help="a feature-vector layer")
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--port", type=int, default=8766)
    args = parser.parse_args()
    rows = []
    with demo_server(args.port) as (url, _), multiprocessing.get_context("spawn").Pool(1) as pool:
        for output in ("", args.layer, args.feature):
            workload = build_workload(url, args.model, "tensor", 1, None, (output,) if output else (), use_cache=False)
            first_s = _first_request_s(url, workload)
            onnx_s = _onnx_ready_s(url, args.model, output) if output else 0.0
            rows.append(
                (
                    output or "(model output)",
                    first_s,
                    onnx_s,
                    run_step(url, workload, args.concurrency, args.duration_s, pool),
                )
            )
    full = rows[0][3].req_s
    print(f"| output | first request ms | ONNX ready after s | req/s (c={args.concurrency}) | p50 ms | vs full |")
    print("|---|---|---|---|---|---|")
    for name, first_s, onnx_s, step in rows:
        ratio = step.req_s / full
        print(f"| {name} | {first_s * 1000:.0f} | {onnx_s:.1f} | {step.req_s:.1f} | {step.p50_ms:.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
