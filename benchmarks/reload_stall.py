"""p99 of a small model while the demo EfficientNet reloads in a loop, vs its steady p99.

    .venv/bin/python benchmarks/reload_stall.py [--duration-s 15] [--concurrency 4]

Steady: the token classifier alone. Then the same load while another thread rewrites EfficientNet's
model file (new modification time, same bytes) and asks for `POST /v2/repository/models/.../load`,
again and again: each round loads the Keras model, rebuilds its layer graph, verifies the cached ONNX
graph and warms it up, all off the event loop.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import threading
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from demo_server import demo_server
from layerserve.bench import build_workload, run_step


def reload_forever(url: str, model_file: Path, stop: threading.Event, rounds: list[float]) -> None:
    """Touch the model file and reload it until `stop`; records each round's seconds."""
    while not stop.is_set():
        started = time.perf_counter()
        model_file.write_bytes(model_file.read_bytes())
        request = urllib.request.Request(f"{url}/v2/repository/models/efficientnet_lite0/load", method="POST")
        with urllib.request.urlopen(request, timeout=300) as response:
            response.read()
        rounds.append(time.perf_counter() - started)


def main() -> None:
    """Run the benchmark and print the two p99s and their ratio."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--port", type=int, default=8768)
    args = parser.parse_args()
    with demo_server(args.port) as (url, repository), multiprocessing.get_context("spawn").Pool(1) as pool:
        workload = build_workload(url, "token_classifier", "tensor", 1, None)
        run_step(url, workload, args.concurrency, 2.0, pool)
        steady = run_step(url, workload, args.concurrency, args.duration_s, pool)
        stop, rounds = threading.Event(), []
        reloader = threading.Thread(
            target=reload_forever, args=(url, repository / "efficientnet_lite0" / "1" / "model.keras", stop, rounds)
        )
        reloader.start()
        during = run_step(url, workload, args.concurrency, args.duration_s, pool)
        stop.set()
        reloader.join()
    print("| | req/s | p50 ms | p99 ms | errors |")
    print("|---|---|---|---|---|")
    for name, step in (("steady", steady), ("during reloads", during)):
        print(f"| {name} | {step.req_s:.0f} | {step.p50_ms:.2f} | {step.p99_ms:.2f} | {step.errors or 0} |")
    print(f"\np99 during reloads / steady: {during.p99_ms / steady.p99_ms:.2f}; "
          f"{len(rounds)} reloads of {sum(rounds) / max(1, len(rounds)):.1f} s each")  # fmt: skip


if __name__ == "__main__":
    main()
