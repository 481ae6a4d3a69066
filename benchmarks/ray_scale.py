"""Native `layerserve serve` vs `layerserve ray serve` with 1 and 2 replicas, in one run, on the demo repository.

    .venv/bin/python benchmarks/ray_scale.py [--duration-s 10] [--concurrency 8 32] [--replica-cpus 1]
                                             [--ingress proxy haproxy haproxy-lean] [--models token_classifier ...]
                                             [--json PATH]

Each setup serves the demo repository on this machine (Ray: `--address local`, its proxy in front); each model
gets the V2 binary tensor workload of `layerserve bench` (the feature cache bypassed), one concurrency level at
a time after a warm-up. The table gives req/s, p50 and p99 per setup and the ratio to native. On 2 cores the
replicas, Ray's proxy and the load generator share the same cores, so the ratio measures the cost of Ray's path
(proxy, router, replica actor) per request, not what more nodes would add.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from demo_server import demo_server
from layerserve.bench.generator import StepResult, build_workload, run_step
from layerserve.demo import build_demo_repository
from results import arguments, table, write_result

MODELS = ("token_classifier", "efficientnet_lite0")
# Ray Serve 2.60's ingresses: its Python proxy (the default); HAProxy in front of replicas that serve HTTP
# themselves (direct ingress).
# "haproxy-lean" also runs the app on the replica's own event loop (Ray Serve hands each request to a second loop,
# in another thread, by default) and gives HAProxy one thread (4 by default) on these 2 cores.
INGRESS = {
    "proxy": {},
    "haproxy": {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"},
    "haproxy-lean": {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
        "RAY_SERVE_HAPROXY_NBTHREAD": "1",
    },
}


@contextmanager
def ray_server(
    port: int, repository: Path, cache: Path, replicas: int, replica_cpus: float, ingress: str
) -> Iterator[str]:
    """`layerserve ray serve --address local` in a subprocess; the proxy's URL once every replica is ready."""
    command = [
        sys.executable, "-m", "layerserve", "ray", "serve", str(repository), "--address", "local",
        "--http-port", str(port), "--replicas", str(replicas), "--replica-cpus", str(replica_cpus),
        "--engine-cache-dir", str(cache), "--log-level", "warning", "--grpc-port", "0",
    ]  # fmt: skip
    env = {**os.environ, **INGRESS[ingress]}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # printed once every model of every replica is ready
        if "http://" not in line:
            raise RuntimeError(f"layerserve ray serve did not start: {line!r}")
        yield f"http://127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)


def _ready(url: str) -> None:
    with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=30) as response:
        assert response.status == 200


def measure(
    url: str, models: list[str], concurrency: list[int], seconds: float, pool: object
) -> dict[tuple[str, int], StepResult]:
    """Each model at each concurrency, after a 2 s warm-up per model."""
    _ready(url)
    results = {}
    for model in models:
        workload = build_workload(url, model, "tensor", 1, None, use_cache=False)
        run_step(url, workload, concurrency[0], 2.0, pool)  # type: ignore[arg-type]
        for level in concurrency:
            results[(model, level)] = run_step(url, workload, level, seconds, pool)  # type: ignore[arg-type]
    return results


def render(result: dict[str, Any]) -> str:
    """Each model under each setup at each concurrency: req/s, p50, p99 and the ratio to native; Ray's start times."""
    header = ["model", "setup", "concurrency", "req/s", "p50 ms", "p99 ms", "x native", "errors"]
    rows = [
        [step["model"], setup["name"], step["concurrency"], step["req_s"], step["p50_ms"], step["p99_ms"],
         step["x_native"], sum(step["errors"].values())]
        for model in result["parameters"]["models"]
        for setup in result["setups"]
        for step in setup["steps"]
        if step["model"] == model
    ]  # fmt: skip
    ready = [[setup["name"], setup["ready_s"]] for setup in result["setups"] if setup["ready_s"] is not None]
    return f"{table(header, rows)}\n\n{table(['setup', 'ready in s'], ready)}" if ready else table(header, rows)


def main() -> None:
    """Run the setups and print the table (and write it as JSON with `--json`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--replica-cpus", type=float, default=1.0)
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--ingress", nargs="+", choices=sorted(INGRESS), default=["proxy"])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="layerserve-ray-scale-"))
    repository, cache = work / "repo", work / "cache"
    build_demo_repository(repository)
    setups: dict[str, dict[tuple[str, int], StepResult]] = {}
    ready_s: dict[str, float] = {}
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        flags = ("--grpc-port", "0", "--engine-cache-dir", str(cache))
        with demo_server(args.port, repository, *flags) as (url, _):
            setups["native serve"] = measure(url, args.models, args.concurrency, args.duration_s, pool)
        for ingress in args.ingress:
            for replicas in (1, 2):
                started = time.perf_counter()
                with ray_server(args.port + 1, repository, cache, replicas, args.replica_cpus, ingress) as url:
                    name = f"Ray {ingress}, {replicas} replica(s)"
                    ready_s[name] = time.perf_counter() - started
                    print(f"{name}: ready in {ready_s[name]:.0f} s", flush=True)
                    setups[name] = measure(url, args.models, args.concurrency, args.duration_s, pool)
    native = setups["native serve"]
    print("| model | setup | concurrency | req/s | p50 ms | p99 ms | x native | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for name, results in setups.items():
            for level in args.concurrency:
                step = results[(model, level)]
                ratio = step.req_s / native[(model, level)].req_s
                print(f"| {model} | {name} | {level} | {step.req_s:,.0f} | {step.p50_ms:.2f} | {step.p99_ms:.2f} | "
                      f"{ratio:.2f} | {sum(step.errors.values())} |")  # fmt: skip
    if args.json:
        result = [
            {"name": name, "ready_s": ready_s.get(name),
             "steps": [{"model": model, **asdict(step), "x_native": step.req_s / native[(model, level)].req_s}
                       for (model, level), step in results.items()]}
            for name, results in setups.items()
        ]  # fmt: skip
        write_result(args.json, {"parameters": {**arguments(args), "use_cache": False}, "setups": result})


if __name__ == "__main__":
    main()
