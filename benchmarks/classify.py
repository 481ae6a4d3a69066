"""Photos/s through /classify vs the in-process decode + preprocess + model ceiling, on the demo repository.

    .venv/bin/python benchmarks/classify.py [--duration-s 10] [--concurrency 1 8 32] [--plot classify.png]
                                            [--json PATH]

The same as `layerserve bench URL --model efficientnet_lite0 --workload image --image cat.jpg --no-cache
--in-process REPO`: every photo is computed (the demo turns the feature cache on, and the requests bypass it).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from demo_server import demo_server, sample_jpeg
from layerserve.bench.generator import BenchOptions, print_report, run_bench
from results import arguments, bench_tables, load_parser, write_result


def render(result: dict[str, Any]) -> str:
    """Photos/s, latency and server load per concurrency, against the in-process ceiling per batch size."""
    return bench_tables(result)


def main() -> None:
    """Run the benchmark and print the report (and write it as JSON with `--json`)."""
    parser = load_parser(__doc__, 8767, [1, 8, 32])
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    photo = sample_jpeg(Path(tempfile.mkdtemp()) / "chelsea.jpg")
    with demo_server(args.port) as (url, repository):
        options = BenchOptions(
            url, "efficientnet_lite0", "image", args.concurrency, args.duration_s, image=photo, use_cache=False,
            in_process=repository, plot=args.plot,
        )  # fmt: skip
        report = run_bench(options)
    print_report(report)
    if args.json:
        write_result(args.json, {"parameters": arguments(args), **report})


if __name__ == "__main__":
    main()
