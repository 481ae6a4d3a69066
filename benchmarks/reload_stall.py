"""p99 of a small model while the demo EfficientNet reloads in a loop, vs its steady p99.

    .venv/bin/python benchmarks/reload_stall.py [--duration-s 15] [--rounds 3] [--concurrency 4] [--every-s 0]
                                                [--fresh] [--engine-process-min-mb 8] [--json PATH]

Steady: the token classifier alone. Then the same load while another thread touches EfficientNet's
model file (new modification time, same bytes) and asks for `POST /v2/repository/models/.../load`,
again and again (back to back, or one round every `--every-s`): each round hashes the file, reads its
stored preparation, opens an ONNX Runtime session, warms it up, and frees the session it replaces. With
`--fresh` the engine cache is emptied first, so each round also loads, exports and verifies the model in
the preparer's child process. Steady and reloading steps alternate `--rounds` times (this machine's
speed drifts); the ratio printed is the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import threading
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from demo_server import demo_server
from layerserve.bench.generator import build_workload, run_step
from results import arguments, table, write_result


def reload_forever(
    url: str, model_file: Path, every_s: float, fresh: Path | None, stop: threading.Event, rounds: list[float]
) -> None:
    """Touch the model file and reload it, a round every `every_s` at most, until `stop`; records each
    round's seconds. With `fresh` (the engine cache folder), every round exports the model again."""
    while not stop.wait(max(0.0, every_s - (rounds[-1] if rounds else every_s))):
        started = time.perf_counter()
        for cached in fresh.iterdir() if fresh else ():
            cached.unlink()
        os.utime(model_file)  # a new modification time: the server sees a changed file and reloads it
        request = urllib.request.Request(f"{url}/v2/repository/models/efficientnet_lite0/load", method="POST")
        with urllib.request.urlopen(request, timeout=300) as response:
            response.read()
        rounds.append(time.perf_counter() - started)


def render(result: dict[str, Any]) -> str:
    """Each round's steady and reloading throughput and p99, their ratio, and the median ratio over the rounds."""
    header = ["round", "steady req/s", "steady p99 ms", "reloading req/s", "reloading p99 ms", "errors", "reloads/s",
              "ratio"]  # fmt: skip
    rows = [
        [number, r["steady"]["req_s"], r["steady"]["p99_ms"], r["reloading"]["req_s"], r["reloading"]["p99_ms"],
         r["errors"], r["reloads_per_s"], r["ratio"]]
        for number, r in enumerate(result["rounds"], 1)
    ]  # fmt: skip
    summary = [[result["median_ratio"], len(result["reload_s"]), result["mean_reload_ms"]]]
    return (
        f"{table(header, rows)}\n\n"
        f"{table(['p99 reloading / steady (median of rounds)', 'reloads', 'mean reload ms'], summary)}"
    )


def main() -> None:
    """Run the benchmark and print each round's two p99s and the median ratio (and write them with `--json`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=15.0, help="seconds of each kind of step, in all")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of a steady and a reloading step")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--port", type=int, default=8768)
    parser.add_argument("--every-s", type=float, default=0.0, help="start a reload every N s (0: back to back)")
    parser.add_argument("--fresh", action="store_true", help="empty the engine cache first: every reload exports")
    parser.add_argument(
        "--engine-process-min-mb", default="8", help="the server setting (1e9: EfficientNet in the server process)"
    )
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    flags = ("--engine-process-min-mb", args.engine_process_min_mb)
    with (
        demo_server(args.port, None, *flags) as (url, repository),
        multiprocessing.get_context("spawn").Pool(1) as pool,
    ):
        workload = build_workload(url, "token_classifier", "tensor", 1, None, use_cache=False)
        run_step(url, workload, args.concurrency, 2.0, pool)
        seconds = args.duration_s / args.rounds
        model_file = repository / "efficientnet_lite0" / "1" / "model.keras"
        cache = repository.parent / "cache" if args.fresh else None
        results, reloads = [], []
        for _ in range(args.rounds):
            steady = run_step(url, workload, args.concurrency, seconds, pool)
            stop, rounds = threading.Event(), []
            reloader = threading.Thread(
                target=reload_forever, args=(url, model_file, args.every_s, cache, stop, rounds)
            )
            reloader.start()
            during = run_step(url, workload, args.concurrency, seconds, pool)
            stop.set()
            reloader.join()
            results.append((steady, during, len(rounds) / seconds))
            reloads += rounds
    print("| round | steady req/s | steady p99 ms | reloading req/s | reloading p99 ms | errors | reloads/s | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for number, (steady, during, rate) in enumerate(results, 1):
        print(
            f"| {number} | {steady.req_s:.0f} | {steady.p99_ms:.2f} | {during.req_s:.0f} | {during.p99_ms:.2f} | "
            f"{sum(steady.errors.values()) + sum(during.errors.values())} | {rate:.1f} | "
            f"{during.p99_ms / steady.p99_ms:.2f} |"
        )
    ratio = statistics.median(during.p99_ms / steady.p99_ms for steady, during, _ in results)
    print(f"\np99 while reloading / steady p99 (median of {args.rounds} rounds): {ratio:.2f}; "
          f"{len(reloads)} reloads of {1000 * statistics.mean(reloads or [0]):.0f} ms each")  # fmt: skip
    if args.json:
        per_round = [
            {"steady": asdict(steady), "reloading": asdict(during), "reloads_per_s": rate,
             "errors": sum(steady.errors.values()) + sum(during.errors.values()),
             "ratio": during.p99_ms / steady.p99_ms}
            for steady, during, rate in results
        ]  # fmt: skip
        result = {"rounds": per_round, "median_ratio": ratio, "reload_s": reloads,
                  "mean_reload_ms": 1000 * statistics.mean(reloads or [0])}  # fmt: skip
        write_result(args.json, {"parameters": arguments(args), **result})


if __name__ == "__main__":
    main()
