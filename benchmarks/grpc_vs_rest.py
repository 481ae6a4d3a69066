"""gRPC against REST binary, in one run: the demo token classifier and EfficientNet-Lite0, V2 infer of one row per
request, REST and gRPC alternating per model and concurrency so that a change of load hits both.

    .venv/bin/python benchmarks/grpc_vs_rest.py [--duration-s 10] [--concurrency 1 8 32] [--json PATH]

Each step is `layerserve bench URL --model M --workload tensor --no-cache --concurrency C` against `layerserve serve
REPO --grpc-port P` (one worker), with `--protocol grpc --grpc-port P` for gRPC (the load generator's own HTTP/2
client). For the small model each step also measures its bare stack (`--bare`): uvicorn and httptools answering a
constant for REST, the gRPC door's connection on uvloop answering a constant ModelInferResponse for gRPC. The
target of issue 17: gRPC req/s at least REST binary's for the small model, and its c=1 p50 no higher.
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from demo_server import demo_server
from layerserve.bench.generator import BenchOptions, run_bench
from results import arguments, load_parser, table, write_result
from soak_server import free_port

MODELS = ("token_classifier", "efficientnet_lite0")
WITH_BARE = ("token_classifier",)  # where the stack's own cost matters
PROTOCOLS = {"http": "REST binary", "grpc": "gRPC"}


def render(result: dict[str, Any]) -> str:
    """Each model, concurrency and protocol: req/s, latency and CPU, and gRPC over REST."""
    header = ["model", "concurrency", "protocol", "req/s", "p50 ms", "p99 ms", "load CPU %", "server CPU %",
              "gRPC / REST req/s", "bare stack req/s", "served / bare"]  # fmt: skip
    rows = []
    for model in result["models"]:
        for concurrency in result["parameters"]["concurrency"]:
            steps = {row["protocol"]: row["step"] for row in result["rows"]
                     if row["model"] == model and row["step"]["concurrency"] == concurrency}  # fmt: skip
            for protocol, step in steps.items():
                ratio = steps["grpc"]["req_s"] / steps["http"]["req_s"] if protocol == "grpc" else "-"
                cpu, bare = step["server_cpu_percent"], step.get("bare_req_s")
                rows.append([
                    model, concurrency, PROTOCOLS[protocol], step["req_s"], step["p50_ms"], step["p99_ms"],
                    step["client_cpu_percent"], "-" if cpu is None else cpu, ratio, "-" if bare is None else bare,
                    step.get("vs_bare", "-"),
                ])  # fmt: skip
    return table(header, rows)


def main() -> None:
    """Alternate REST and gRPC per model and concurrency; print the table (and write JSON with `--json`)."""
    args = load_parser(__doc__, 8772, [1, 8, 32]).parse_args()
    grpc_port = free_port()
    rows = []
    with demo_server(args.port, None, "--grpc-port", str(grpc_port)) as (url, _):
        for model in MODELS:
            for concurrency in args.concurrency:
                for protocol in PROTOCOLS:
                    options = BenchOptions(
                        url, model, "tensor", [concurrency], args.duration_s, use_cache=False, protocol=protocol,
                        grpc_port=grpc_port, bare=model in WITH_BARE,
                    )  # fmt: skip
                    report = run_bench(options)
                    step = report["steps"][0]
                    if "bare" in report:
                        step["bare_req_s"] = report["bare"][0]["req_s"]
                    rows.append({"model": model, "protocol": protocol, "step": step})
    result = {"parameters": arguments(args), "models": list(MODELS), "rows": rows}
    print(render(result))
    if args.json:
        write_result(args.json, result)


if __name__ == "__main__":
    main()
