"""Served throughput (V2 binary infer over HTTP) vs the model's in-process ceiling, in one run.

    .venv/bin/python benchmarks/serve_vs_inprocess.py [--model efficientnet_lite0] [--duration-s 10]

Builds the demo repository when --repository is not given, measures the engine in-process at several
batch sizes (the ceiling: best samples/s), then starts `layerserve serve` in a subprocess and drives it
with closed-loop clients at each concurrency (one sample per request), and prints the ratios.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from layerserve.demo import build_demo_repository
from layerserve.engine import probe_batch
from layerserve.registry import ModelVersion
from layerserve.repository import scan
from layerserve.settings import Settings
from loadgen import binary_request, drive, start_server


def measure_in_process(version: ModelVersion, batch_sizes: list[int], seconds: float) -> dict[int, float]:
    """Samples/s of the version's engine at each batch size (the same engine the server uses)."""
    assert version.engine is not None
    results = {}
    for size in batch_sizes:
        batch = probe_batch(version.signature.inputs, size)
        version.engine.run(batch)
        calls, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            version.engine.run(batch)
            calls += 1
        results[size] = calls * size / (time.perf_counter() - started)
    return results


def main() -> None:
    """Run the benchmark and print a report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=None)
    parser.add_argument("--model", default="efficientnet_lite0")
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="layerserve-bench-"))
    repository = args.repository or work / "repo"
    if args.repository is None:
        build_demo_repository(repository)
    settings = Settings(model_repository=repository, engine_cache_dir=work / "cache")
    (spec,) = [s for s in scan(repository) if s.name == args.model]
    number, path = max(spec.versions.items())
    version = ModelVersion(spec.name, number, path, spec.config)
    version.load(settings, ThreadPoolExecutor(1))
    print(f"model {args.model} version {number}: engine {version.engine_name} ({version.engine_reason})")

    ceiling = measure_in_process(version, args.batch_sizes, args.duration_s / 2)
    best = max(ceiling, key=lambda size: ceiling[size])
    batch1_ms = 1000 / ceiling[1] if 1 in ceiling else float("nan")
    for size, rate in ceiling.items():
        print(f"in-process batch {size:3d}: {rate:8.1f} samples/s")
    version.close()

    process = start_server(repository, work / "cache", args.port)
    try:
        body, headers = binary_request(version.signature.inputs, [])
        path = f"/v2/models/{args.model}/infer"
        drive(args.port, path, body, headers, 1, 1.0)  # warm the connection path
        print(f"\n| concurrency | req/s | p50 ms | p99 ms | errors | served / in-process best (batch {best}) |")
        print("|---|---|---|---|---|---|")
        for clients in args.concurrency:
            result = drive(args.port, path, body, headers, clients, args.duration_s)
            print(
                f"| {clients} | {result['req_s']:.1f} | {result['p50_ms']:.1f} | {result['p99_ms']:.1f} "
                f"| {result['errors']} | {result['req_s'] / ceiling[best]:.2f} |"
            )
        print(f"\nin-process best: {ceiling[best]:.1f} samples/s at batch {best}; batch-1 latency {batch1_ms:.1f} ms")
    finally:
        process.terminate()
        process.wait(timeout=30)


if __name__ == "__main__":
    main()
