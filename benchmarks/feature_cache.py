"""The feature cache: `/features?layer=block7_add&pool=avg` of the demo EfficientNet, the same JPEG again and again,
served from the cache and computed (`cache=false`), with the cache in the server's memory (the demo's default) and
in a `redis-server` of the script's own on 127.0.0.1.

    .venv/bin/python benchmarks/feature_cache.py [--duration-s 10] [--concurrency 8] [--json PATH]

Each step is `layerserve bench URL --model efficientnet_lite0 --workload image --image chelsea.jpg --outputs
block7_add --concurrency C [--no-cache]`, one worker; with Redis, the server runs with `--redis-url`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from demo_server import demo_server, sample_jpeg
from layerserve.bench.generator import BenchOptions, run_bench
from results import arguments, load_parser, table, write_result
from soak_server import RedisProcess

LAYER = "block7_add"
BACKENDS = {"memory": "process memory (default)", "redis": "Redis on 127.0.0.1 (`--redis-url`)"}


def render(result: dict[str, Any]) -> str:
    """Each backend and concurrency: cached and computed req/s and p50, and their ratio."""
    header = ["backend", "concurrency", "cached req/s", "cached p50 ms", "computed req/s", "computed p50 ms",
              "cached / computed"]  # fmt: skip
    rows = []
    for backend, steps in result["backends"].items():
        for cached, computed in zip(steps["cached"], steps["computed"], strict=True):
            rows.append([
                BACKENDS[backend], cached["concurrency"], cached["req_s"], cached["p50_ms"], computed["req_s"],
                computed["p50_ms"], f"{cached['req_s'] / computed['req_s']:.1f}x",
            ])  # fmt: skip
    return table(header, rows)


def measure(url: str, photo: Path, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Cached (after the first request) and computed steps against one server."""
    steps = {}
    for label, use_cache in (("cached", True), ("computed", False)):
        options = BenchOptions(
            url, "efficientnet_lite0", "image", args.concurrency, args.duration_s, image=photo, outputs=(LAYER,),
            use_cache=use_cache,
        )  # fmt: skip
        steps[label] = run_bench(options)["steps"]
    return steps


def main() -> None:
    """Measure both backends; print the table (and write the result as JSON with `--json`)."""
    args = load_parser(__doc__, 8773, [8]).parse_args()
    photo = sample_jpeg(Path(tempfile.mkdtemp()) / "chelsea.jpg")
    backends = {}
    with demo_server(args.port) as (url, _):
        backends["memory"] = measure(url, photo, args)
    redis = RedisProcess()
    redis.start()
    try:
        with demo_server(args.port, None, "--redis-url", f"redis://127.0.0.1:{redis.port}/0") as (url, _):
            backends["redis"] = measure(url, photo, args)
    finally:
        redis.kill()
    result = {"parameters": arguments(args), "layer": LAYER, "backends": backends}
    print(render(result))
    if args.json:
        write_result(args.json, result)


if __name__ == "__main__":
    main()
