"""Served throughput (V2 binary infer) vs the model's in-process ceiling, in one run, on the demo repository.

    .venv/bin/python benchmarks/serve_vs_inprocess.py [--model efficientnet_lite0] [--duration-s 10]
                                                      [--engine-process-min-mb 8] [--json PATH]

The same as `layerserve bench URL --model M --no-cache --in-process REPO --concurrency 1 8` against a demo
server (the feature cache is bypassed: every request is computed).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from demo_server import demo_server
from layerserve.bench.generator import BenchOptions, print_report, run_bench
from results import arguments, bench_tables, write_result


def render(result: dict[str, Any]) -> str:
    """Served tensors/s, latency and server load per concurrency, against the in-process ceiling per batch size."""
    return bench_tables(result)


def main() -> None:
    """Run the benchmark and print the report (and write it as JSON with `--json`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="efficientnet_lite0")
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument(
        "--engine-process-min-mb", default="8", help="the server setting (1e9: EfficientNet in the server process)"
    )
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    with demo_server(args.port, None, "--engine-process-min-mb", args.engine_process_min_mb) as (url, repository):
        options = BenchOptions(
            url, args.model, "tensor", args.concurrency, args.duration_s, use_cache=False, in_process=repository
        )
        report = run_bench(options)
    print_report(report)
    if args.json:
        write_result(args.json, {"parameters": arguments(args), **report})


if __name__ == "__main__":
    main()
