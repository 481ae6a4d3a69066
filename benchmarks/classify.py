"""Photos/s through /classify vs the in-process decode + preprocess + model ceiling, in one run.

    .venv/bin/python benchmarks/classify.py [--duration-s 8] [--concurrency 1 8 32]

Builds the demo repository when --repository is not given. The ceiling decodes each batch of JPEGs on a
thread pool (as the server does) and runs the same engine; the served figures send one JPEG per request.
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from layerserve.demo import build_demo_repository
from layerserve.images import load_one
from layerserve.registry import ModelVersion
from layerserve.repository import scan
from layerserve.settings import Settings
from loadgen import drive, start_server


def sample_jpeg() -> bytes:
    """scikit-image's chelsea.png (451x300) as a quality-90 JPEG."""
    import importlib.util

    spec = importlib.util.find_spec("skimage")
    assert spec is not None and spec.submodule_search_locations
    buffer = io.BytesIO()
    Image.open(Path(spec.submodule_search_locations[0]) / "data" / "chelsea.png").convert("RGB").save(
        buffer, "JPEG", quality=90
    )
    return buffer.getvalue()


def measure_ceiling(version: ModelVersion, photo: bytes, sizes: list[int], seconds: float) -> dict[int, float]:
    """Photos/s decoding on a thread pool then running the engine, per batch size."""
    assert version.engine is not None and version.image is not None
    image, engine = version.image, version.engine
    results = {}
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        for size in sizes:
            done, started = 0, time.perf_counter()
            while time.perf_counter() - started < seconds:
                batch = np.stack(list(pool.map(lambda raw: load_one(raw, image, 10**8), [photo] * size)))
                engine.run([batch])
                done += size
            results[size] = done / (time.perf_counter() - started)
    return results


def main() -> None:
    """Run the benchmark and print a table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=None)
    parser.add_argument("--model", default="efficientnet_lite0")
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--port", type=int, default=8767)
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
    photo = sample_jpeg()
    ceiling = measure_ceiling(version, photo, args.batch_sizes, args.duration_s / 2)
    best = max(ceiling, key=lambda size: ceiling[size])
    for size, rate in ceiling.items():
        print(f"in-process decode+preprocess+model, batch {size:3d}: {rate:7.1f} photos/s")
    version.close()

    process = start_server(repository, work / "cache", args.port)
    try:
        path = f"/v2/models/{args.model}/classify?top_k=5"
        headers = {"Content-Type": "image/jpeg"}
        drive(args.port, path, photo, headers, 1, 1.0)
        print(f"\n| concurrency | photos/s | p50 ms | p99 ms | errors | served / ceiling (batch {best}) |")
        print("|---|---|---|---|---|---|")
        for clients in args.concurrency:
            result = drive(args.port, path, photo, headers, clients, args.duration_s)
            print(
                f"| {clients} | {result['req_s']:.1f} | {result['p50_ms']:.1f} | {result['p99_ms']:.1f} "
                f"| {result['errors']} | {result['req_s'] / ceiling[best]:.2f} |"
            )
        print(f"\nceiling: {ceiling[best]:.1f} photos/s at batch {best}; batch 1: {ceiling[args.batch_sizes[0]]:.1f}")
    finally:
        process.terminate()
        process.wait(timeout=30)


if __name__ == "__main__":
    main()
