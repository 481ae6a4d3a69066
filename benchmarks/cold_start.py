"""Cold starts under a memory budget: the first request for a model that is not loaded, next to a warm one, for the
demo token classifier and EfficientNet-Lite0, with the export cache warm.

    .venv/bin/python benchmarks/cold_start.py [--rounds 20] [--warm 50] [--json PATH]

A first server (no budget) exports every demo model into an export cache; a second, `layerserve serve REPO
--model-memory-budget 2GB` over the same cache, lists them without loading. Each round unloads the model (`POST
/v2/repository/models/M/unload`: under a budget it is listed again, and its next request loads it), waits until its
memory is freed, then times one V2 infer of one row (JSON, on a kept-alive connection): the cold request, a session
load and warm-up, never an export. Then `--warm` requests of the same row time the warm model. The serving process
is checked not to have imported TensorFlow (its /proc maps list no libtensorflow).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import httpx
import numpy as np

from demo_server import demo_server, server_pid
from results import arguments, table, write_result
from soak_server import free_port

MODELS = ("token_classifier", "efficientnet_lite0")
_DTYPES = {"FP32": np.float32, "INT32": np.int32, "INT64": np.int64, "UINT8": np.uint8, "FP16": np.float16}


def percentile(samples: list[float], share: float) -> float:
    """The nearest-rank percentile of `samples` (share in 0..1)."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(share * len(ordered)) - 1))]


def infer_body(metadata: dict[str, Any]) -> dict[str, Any]:
    """One row of zeros for every input of the model (V2 JSON)."""
    inputs = []
    for spec in metadata["inputs"]:
        shape = [1] + [1 if size == -1 else size for size in spec["shape"][1:]]
        data = np.zeros(shape, _DTYPES[spec["datatype"]]).ravel().tolist()
        inputs.append({"name": spec["name"], "datatype": spec["datatype"], "shape": shape, "data": data})
    return {"inputs": inputs}


def loads_tensorflow(pid: int) -> bool:
    """Whether the process has TensorFlow's library mapped."""
    return "libtensorflow" in Path(f"/proc/{pid}/maps").read_text()


def measure(client: httpx.Client, model: str, rounds: int, warm: int) -> dict[str, Any]:
    """`rounds` cold requests (each after an unload) and `warm` warm ones, in milliseconds."""
    body = infer_body(client.get(f"/v2/models/{model}").raise_for_status().json())
    cold, hot = [], []
    for _ in range(rounds):
        client.post(f"/v2/repository/models/{model}/unload").raise_for_status()
        time.sleep(0.5)  # the version closes once idle, in the background
        started = time.perf_counter()
        client.post(f"/v2/models/{model}/infer", json=body).raise_for_status()
        cold.append((time.perf_counter() - started) * 1000)
    for _ in range(warm):
        started = time.perf_counter()
        client.post(f"/v2/models/{model}/infer", json=body).raise_for_status()
        hot.append((time.perf_counter() - started) * 1000)
    memory = client.get(f"/v2/models/{model}").json()["memory"]["total_bytes"]
    return {
        "model": model, "cold_p50_ms": statistics.median(cold), "cold_p99_ms": percentile(cold, 0.99),
        "warm_p50_ms": statistics.median(hot), "warm_p99_ms": percentile(hot, 0.99), "memory_bytes": memory,
        "cold_ms": cold,
    }  # fmt: skip


def render(result: dict[str, Any]) -> str:
    """Per model: cold and warm p50/p99, and what its version takes."""
    header = ["model", "cold p50 ms", "cold p99 ms", "warm p50 ms", "warm p99 ms", "memory MB"]
    rows = [
        [row["model"], row["cold_p50_ms"], row["cold_p99_ms"], row["warm_p50_ms"], row["warm_p99_ms"],
         row["memory_bytes"] / 2**20]
        for row in result["rows"]
    ]  # fmt: skip
    tensorflow = "imported TensorFlow" if result["serving_process_loads_tensorflow"] else "never imported TensorFlow"
    return (
        f"{result['parameters']['rounds']} cold requests per model (each after an unload), "
        f"{result['parameters']['warm']} warm; the serving process {tensorflow}.\n\n{table(header, rows)}"
    )


def main() -> None:
    """Warm the export cache, then time cold and warm requests under a budget; print the table (and write JSON)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warm", type=int, default=50)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with demo_server(free_port(), None, "--grpc-port", "0") as (_, repository):
        pass  # every demo model exported into the first server's cache
    cache = ["--engine-cache-dir", str(repository.parent / "cache")]
    port = free_port()
    with demo_server(port, repository, "--grpc-port", "0", *cache, "--model-memory-budget", "2GB") as (url, _):
        with httpx.Client(base_url=url, timeout=120) as client:
            rows = [measure(client, model, args.rounds, args.warm) for model in MODELS]
        uses_tensorflow = loads_tensorflow(server_pid(port))
    result = {"parameters": arguments(args), "rows": rows, "serving_process_loads_tensorflow": uses_tensorflow}
    print(render(result))
    if args.json:
        write_result(args.json, result)


if __name__ == "__main__":
    main()
