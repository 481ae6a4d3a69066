"""Overload: 64 clients for 60 s against a slow model with a small queue; only 200 and 503 may come back,
nothing hangs, the p99 stays under the deadline, and the server's memory does not grow.

    .venv/bin/python benchmarks/overload.py [--duration-s 60] [--concurrency 64] [--json PATH]

The model: six 2048-wide dense layers (about 50 MFLOP a row), `max_batch_size: 4`, `max_queue_size: 8`;
the server's deadline is `--request-timeout-ms 2000`. One row a request, V2 binary infer. RSS is read
from /metrics after a 10 s warm-up at the same load, and after the run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from demo_server import demo_server
from layerserve.bench.generator import build_workload, run_step
from results import arguments, by_status, table, write_result

REQUEST_TIMEOUT_MS = 2000


def slow_repository(root: Path) -> Path:
    """A repository with the one slow model."""
    import keras

    keras.utils.set_random_seed(0)
    x = keras.Input((2048,), name="x")
    h = x
    for i in range(6):
        h = keras.layers.Dense(2048, activation="tanh", name=f"dense_{i}")(h)
    (root / "slow" / "1").mkdir(parents=True)
    keras.Model(x, h).save(root / "slow" / "1" / "model.keras")
    (root / "slow" / "config.yaml").write_text("max_batch_size: 4\nmax_queue_size: 8\n")
    return root


def render(result: dict[str, Any]) -> str:
    """What came back under overload, by status; the 200s' rate and latency against the deadline; RSS growth."""
    step, rss = result["step"], result["rss_mb"]
    header = ["concurrency", "seconds (wall)", "answers by status", "200/s", "p50 ms", "p99 ms (200)",
              "p99 / deadline", "RSS after warm-up MB", "RSS after MB", "growth MB"]  # fmt: skip
    row = [step["concurrency"], f"{step['duration_s']:.1f} ({result['wall_s']:.1f})", by_status(result["statuses"]),
           step["req_s"], step["p50_ms"], step["p99_ms"], step["p99_ms"] / result["request_timeout_ms"],
           rss["after_warm_up"], rss["after"], rss["after"] - rss["after_warm_up"]]  # fmt: skip
    return table(header, [row])


def main() -> None:
    """Run the overload and print what came back (and write it as JSON with `--json`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--port", type=int, default=8771)
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    repository = slow_repository(Path(tempfile.mkdtemp(prefix="layerserve-overload-")) / "repo")
    flags = ("--request-timeout-ms", str(REQUEST_TIMEOUT_MS))
    with demo_server(args.port, repository, *flags) as (url, _), multiprocessing.get_context("spawn").Pool(2) as pool:
        workload = build_workload(url, "slow", "tensor", 1, None, use_cache=False)
        warm_up = run_step(url, workload, args.concurrency, 10.0, pool)  # at the same load
        started = time.perf_counter()
        step = run_step(url, workload, args.concurrency, args.duration_s, pool)
        wall = time.perf_counter() - started
    before, after = ((s.server_rss_bytes or float("nan")) / 2**20 for s in (warm_up, step))
    statuses = {"200": step.requests - sum(step.errors.values()), **step.errors}
    print("| concurrency | seconds (wall) | answers by status | 200/s | p50 ms | p99 ms (200) | RSS after warm-up "
          "| RSS after | growth |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.concurrency} | {args.duration_s:g} ({wall:.1f}) | {statuses} | {step.req_s:.0f} | "
          f"{step.p50_ms:.0f} | {step.p99_ms:.0f} | {before:.0f} MB | {after:.0f} MB | "
          f"{after - before:+.1f} MB |")  # fmt: skip
    if args.json:
        result = {
            "request_timeout_ms": REQUEST_TIMEOUT_MS, "wall_s": wall, "statuses": statuses, "warm_up": asdict(warm_up),
            "step": asdict(step), "rss_mb": {"after_warm_up": before, "after": after},
        }  # fmt: skip
        write_result(args.json, {"parameters": arguments(args), **result})


if __name__ == "__main__":
    main()
