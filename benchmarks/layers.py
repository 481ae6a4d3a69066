"""Full model vs layers, served, with each new cut's first request and the server's memory after it.

    .venv/bin/python benchmarks/layers.py [--layer block7_add] [--folded block7_expand] [--duration-s 8] [--json PATH]

For each requested output, on the demo EfficientNet: the very first request (a cut taken out of the verified
export, or, for a layer the export folded away, exported by the preparer's child while the request waits), how
the cut runs, the server process's resident memory afterwards and whether it mapped TensorFlow, then the served
throughput (V2 binary infer, one image per request).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from demo_server import demo_server, server_pid
from layerserve.bench.generator import Workload, build_workload, run_step
from results import arguments, table, write_result


def _first_request_s(url: str, workload: Workload) -> float:
    request = urllib.request.Request(f"{url}{workload.path}", data=workload.body, headers=workload.headers)
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()
    return time.perf_counter() - started


def _memory(pid: int) -> tuple[float, bool]:
    """The process's resident MB, and whether it has TensorFlow mapped."""
    resident = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    assert resident is not None
    return int(resident[1]) / 1024, "tensorflow" in Path(f"/proc/{pid}/maps").read_text()


def _how(url: str, model: str, output: str) -> str:
    with urllib.request.urlopen(f"{url}/v2/models/{model}", timeout=30) as response:
        cuts = json.loads(response.read())["cuts"]
    reasons = [c["engine_reason"] for c in cuts if c["outputs"] == [output]]
    if not reasons:
        return "the model's own call"
    return "cut out of the export" if "cut out of" in reasons[0] else f"exported by the child ({reasons[0][:40]})"


def render(result: dict[str, Any]) -> str:
    """Per output: how its cut runs, its first request, the server's memory after it, and its served throughput."""
    start = result["server_at_start"]
    header = ["output", "cut", "first request ms", "server MB after", "TensorFlow in server",
              f"req/s (c={result['parameters']['concurrency']})", "p50 ms", "vs full"]  # fmt: skip
    rows = [
        [row["output"], row["cut"], row["first_request_ms"], row["server_rss_mb"], "yes" if row["tensorflow"] else "no",
         row["step"]["req_s"], row["step"]["p50_ms"], row["vs_full"]]
        for row in result["outputs"]
    ]  # fmt: skip
    return (
        f"Server at start: {start['rss_mb']:,.0f} MB resident, TensorFlow mapped: "
        f"{'yes' if start['tensorflow'] else 'no'}.\n\n{table(header, rows)}"
    )


def main() -> None:
    """Run the benchmark and print a table (and write it as JSON with `--json`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="efficientnet_lite0")
    parser.add_argument("--layer", default="block7_add", help="a middle layer")
    parser.add_argument("--feature", default="avg_pool", help="a feature-vector layer")
    parser.add_argument("--folded", default="block7_expand", help="a convolution whose batch norm the export folded")
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    rows = []
    with demo_server(args.port) as (url, _), multiprocessing.get_context("spawn").Pool(1) as pool:
        pid = server_pid(args.port)
        start = _memory(pid)
        print(f"server at start: {start[0]:.0f} MB resident, TensorFlow mapped: {start[1]}")
        for output in ("", args.layer, args.feature, args.folded):
            workload = build_workload(url, args.model, "tensor", 1, None, (output,) if output else (), use_cache=False)
            first_s = _first_request_s(url, workload)
            resident, tensorflow = _memory(pid)
            step = run_step(url, workload, args.concurrency, args.duration_s, pool)
            rows.append(
                (output or "(model output)", _how(url, args.model, output), first_s, resident, tensorflow, step)
            )
    full = rows[0][5].req_s
    print(f"| output | cut | first request ms | server MB after | TensorFlow in server | req/s (c={args.concurrency}) "
          "| p50 ms | vs full |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, how, first_s, resident, tensorflow, step in rows:
        print(f"| {name} | {how} | {first_s * 1000:.0f} | {resident:.0f} | {'yes' if tensorflow else 'no'} | "
              f"{step.req_s:.1f} | {step.p50_ms:.1f} | {step.req_s / full:.2f} |")  # fmt: skip
    if args.json:
        outputs = [
            {"output": name, "cut": how, "first_request_ms": first_s * 1000, "server_rss_mb": resident,
             "tensorflow": tensorflow, "step": asdict(step), "vs_full": step.req_s / full}
            for name, how, first_s, resident, tensorflow, step in rows
        ]  # fmt: skip
        result = {"server_at_start": {"rss_mb": start[0], "tensorflow": start[1]}, "outputs": outputs}
        write_result(args.json, {"parameters": arguments(args), **result})


if __name__ == "__main__":
    main()
