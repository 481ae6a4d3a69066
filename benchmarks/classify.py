"""Photos/s through /classify vs the in-process decode + preprocess + model ceiling, on the demo repository.

    .venv/bin/python benchmarks/classify.py [--duration-s 10] [--concurrency 1 8 32] [--plot docs/bench-classify.png]

The same as `layerserve bench URL --model efficientnet_lite0 --workload image --image cat.jpg --in-process REPO`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from demo_server import demo_server, sample_jpeg
from layerserve.bench.generator import BenchOptions, print_report, run_bench


def main() -> None:
    """Run the benchmark and print the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--port", type=int, default=8767)
    args = parser.parse_args()
    photo = sample_jpeg(Path(tempfile.mkdtemp()) / "chelsea.jpg")
    with demo_server(args.port) as (url, repository):
        options = BenchOptions(
            url, "efficientnet_lite0", "image", args.concurrency, args.duration_s, image=photo,
            in_process=repository, plot=args.plot,
        )  # fmt: skip
        print_report(run_bench(options))


if __name__ == "__main__":
    main()
