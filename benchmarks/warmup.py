"""The first requests after ready, with and without warm-up requests in the version folders, for the demo token
classifier and EfficientNet-Lite0 (encoded images), with the export cache warm.

    .venv/bin/python benchmarks/warmup.py [--rounds 3] [--requests 100] [--json PATH]

A first server exports the two models into an export cache. Then each round starts `layerserve serve REPO --models
token_classifier,efficientnet_lite0` over that cache twice, without and then with a `warmup/rows.json` in each
version folder (one V2 request of one row, which the server repeats to every batch size up to the model's
`max_batch_size` before it reports ready), and times, from the moment it is ready, the first `--requests` V2
infers of each model, one at a time on a kept-alive connection, their rows going 1, 2, ... `max_batch_size` and
round again (so that every batch size is met early, as concurrent clients make them), with the feature cache off.
Also: the time from the server's start to ready, which the warm-up lengthens.
"""

from __future__ import annotations

import argparse
import base64
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import httpx
import numpy as np
import orjson

from cold_start import percentile
from demo_server import demo_server
from layerserve.demo import write_demo_photos
from results import arguments, table, write_result
from soak_server import free_port

MODELS = ("token_classifier", "efficientnet_lite0")
MAX_BATCH_SIZES = {"token_classifier": 16, "efficientnet_lite0": 8}  # the server's default, the demo's config.yaml
_SERVE = ("--grpc-port", "0", "--models", ",".join(MODELS))


def infer_body(metadata: dict[str, Any], rows: int, photo: bytes, rng: np.random.Generator) -> bytes:
    """`rows` rows for the model's one input: the demo photo for an image model (BYTES, base64 in JSON), else random
    token ids; the feature cache is off, so that every row is computed."""
    spec = metadata["inputs"][0]
    if metadata.get("input") == "image":
        data: list[Any] = [base64.b64encode(photo).decode()] * rows
        entry = {"name": spec["name"], "datatype": "BYTES", "shape": [rows], "data": data}
    else:
        tokens = rng.integers(0, 1000, size=(rows, spec["shape"][1]))
        entry = {
            "name": spec["name"],
            "datatype": spec["datatype"],
            "shape": list(tokens.shape),
            "data": tokens.tolist(),
        }
    return orjson.dumps({"inputs": [entry], "parameters": {"cache": False}})


def first_requests(client: httpx.Client, model: str, count: int, photo: bytes) -> list[float]:
    """The first `count` infers of `model`, in milliseconds, their rows cycling through 1..max_batch_size."""
    metadata = client.get(f"/v2/models/{model}").raise_for_status().json()
    largest = MAX_BATCH_SIZES[model]
    assert metadata["batching"]["max_batch_size"] == largest, metadata["batching"]
    rng = np.random.default_rng(0)
    bodies = [infer_body(metadata, 1 + index % largest, photo, rng) for index in range(count)]
    times = []
    for body in bodies:
        started = time.perf_counter()
        client.post(f"/v2/models/{model}/infer", content=body).raise_for_status()
        times.append((time.perf_counter() - started) * 1000)
    return times


def set_warmup(repository: Path, photo: bytes, is_on: bool) -> None:
    """Write (or remove) one one-row warm-up request in each model's version folder."""
    rng = np.random.default_rng(1)
    metadata = {
        "token_classifier": {"inputs": [{"name": "tokens", "datatype": "INT32", "shape": [-1, 64]}]},
        "efficientnet_lite0": {"inputs": [{"name": "image", "datatype": "FP32"}], "input": "image"},
    }
    for model in MODELS:
        folder = repository / model / "1" / "warmup"
        shutil.rmtree(folder, ignore_errors=True)
        if is_on:
            folder.mkdir()
            (folder / "rows.json").write_bytes(infer_body(metadata[model], 1, photo, rng))


def measure(repository: Path, cache: Path, photo: bytes, count: int, is_warm: bool) -> dict[str, Any]:
    """One server start: its time to ready and the first `count` requests of each model."""
    set_warmup(repository, photo, is_warm)
    started = time.perf_counter()
    with demo_server(free_port(), repository, *_SERVE, "--engine-cache-dir", str(cache)) as (url, _):
        ready_s = time.perf_counter() - started
        with httpx.Client(base_url=url, timeout=120) as client:
            times = {model: first_requests(client, model, count, photo) for model in MODELS}
    return {"warmup": is_warm, "ready_s": ready_s, "times_ms": times}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and setting: p50, p99 and the slowest of the first requests over every round, and the time to ready."""
    rows = []
    for model in MODELS:
        for is_warm in (False, True):
            chosen = [run for run in runs if run["warmup"] is is_warm]
            times = [t for run in chosen for t in run["times_ms"][model]]
            largest = MAX_BATCH_SIZES[model]
            first = [t for run in chosen for t in run["times_ms"][model][:largest]]
            later = [t for run in chosen for t in run["times_ms"][model][largest : 2 * largest]]
            rows.append({
                "model": model, "warmup": is_warm, "p50_ms": statistics.median(times),
                "p99_ms": percentile(times, 0.99), "max_ms": max(times),
                "first_pass_ms": statistics.mean(first), "second_pass_ms": statistics.mean(later),
                "ready_s": statistics.median(run["ready_s"] for run in chosen),
            })  # fmt: skip
    return rows


def render(result: dict[str, Any]) -> str:
    """Per model: the first requests' p50, p99 and slowest, without and with warm-up requests; the time to ready."""
    header = ["model", "warm-up requests", "p50 ms", "p99 ms", "slowest ms", "1st pass mean ms", "2nd pass mean ms",
              "start to ready s"]  # fmt: skip
    rows = [
        [row["model"], "yes" if row["warmup"] else "no (probe batches only)", row["p50_ms"], row["p99_ms"],
         row["max_ms"], row["first_pass_ms"], row["second_pass_ms"], row["ready_s"]]
        for row in result["rows"]
    ]  # fmt: skip
    parameters = result["parameters"]
    return (
        f"The first {parameters['requests']} requests of each model after ready, {parameters['rounds']} server "
        f"start(s) per setting; their rows go 1, 2, ... max_batch_size (16 and 8) and round again: the first pass "
        f"meets each batch size for the first time, the second meets them again.\n\n"
        f"{table(header, rows)}"
    )


def main() -> None:
    """Warm the export cache, then start servers without and with warm-up requests; print the table (and JSON)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.requests < 2 * max(MAX_BATCH_SIZES.values()):
        parser.error(f"--requests must be at least {2 * max(MAX_BATCH_SIZES.values())}: two passes of batch sizes")
    with demo_server(free_port(), None, *_SERVE) as (_, repository):
        pass  # both models exported into the first server's cache
    cache = repository.parent / "cache"
    photo = write_demo_photos(repository.parent / "photos")[0].read_bytes()
    runs = [
        measure(repository, cache, photo, args.requests, is_warm)
        for _ in range(args.rounds)
        for is_warm in (False, True)
    ]
    result = {"parameters": arguments(args), "rows": summarize(runs), "runs": runs}
    print(render(result))
    if args.json:
        write_result(args.json, result)


if __name__ == "__main__":
    main()
