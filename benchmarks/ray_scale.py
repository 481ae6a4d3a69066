"""Native `layerserve serve` vs `layerserve ray serve` with 1 and 2 replicas, in one run, on the demo repository.

    .venv/bin/python benchmarks/ray_scale.py [--duration-s 10] [--concurrency 8 32] [--replica-cpus 1]
                                             [--ingress proxy haproxy haproxy-lean direct]
                                             [--models token_classifier ...] [--json PATH]

Each setup serves the demo repository on this machine (Ray: `--address local`, its proxy in front); each model
gets the V2 binary tensor workload of `layerserve bench` (the feature cache bypassed), one concurrency level at
a time after a warm-up. The native server keeps serving while Ray's setups run: each Ray step is measured in
slices that take turns with slices of the native server (as `layerserve bench --bare` does with the bare
stack), and "x native" is the median of the side-by-side ratios, so that the machine's drift between steps does
not enter it. The table gives req/s, p50 and p99 per setup and that ratio. On 2 cores the replicas, Ray's proxy
and the load generator share the same cores, so the ratio measures the cost of Ray's path (proxy, router,
replica actor) per request, not what more nodes would add.
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
from layerserve.bench.generator import PAIRED_ROUNDS, References, StepResult, build_workload, run_paired_step, run_step
from layerserve.demo import build_demo_repository
from results import arguments, table, write_result

MODELS = ("token_classifier", "efficientnet_lite0")
# Ray Serve 2.60's ingresses: its Python proxy (the default); HAProxy in front of replicas that serve HTTP
# themselves (direct ingress); "direct": layerserve's own server in each replica, on `--direct-port` (no proxy).
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
    "direct": {},
}


@contextmanager
def ray_server(
    port: int, repository: Path, cache: Path, replicas: int, replica_cpus: float, ingress: str
) -> Iterator[str]:
    """`layerserve ray serve --address local` in a subprocess; once every replica is ready, the URL of the
    ingress (the proxy's; with "direct", the replicas' own port, `port` + 1)."""
    direct = ["--direct-port", str(port + 1)] if ingress == "direct" else []
    command = [
        sys.executable, "-m", "layerserve", "ray", "serve", str(repository), "--address", "local",
        "--http-port", str(port), "--replicas", str(replicas), "--replica-cpus", str(replica_cpus),
        "--engine-cache-dir", str(cache), "--log-level", "warning", "--grpc-port", "0", *direct,
    ]  # fmt: skip
    env = {**os.environ, **INGRESS[ingress]}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # printed once every model of every replica is ready
        if "http://" not in line:
            raise RuntimeError(f"layerserve ray serve did not start: {line!r}")
        yield f"http://127.0.0.1:{port + 1 if direct else port}"
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)


def _ready(url: str) -> None:
    with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=30) as response:
        assert response.status == 200


def measure(
    url: str, models: list[str], concurrency: list[int], seconds: float, pool: object, native: str | None = None
) -> dict[tuple[str, int], tuple[StepResult, float | None]]:
    """Each model at each concurrency, after a 2 s warm-up per model; with `native` (its URL), in slices that take
    turns with the native server's, and the ratio to native (the median of side-by-side slices' ratios)."""
    _ready(url)
    results = {}
    for model in models:
        workload = build_workload(url, model, "tensor", 1, None, use_cache=False)
        references = References()
        if native is not None:
            references = References(bare=(native, build_workload(native, model, "tensor", 1, None, use_cache=False)))
        run_step(url, workload, concurrency[0], 2.0, pool)  # type: ignore[arg-type]
        for level in concurrency:
            step, _, ratios = run_paired_step(url, workload, level, seconds, pool, references)  # type: ignore[arg-type]
            results[(model, level)] = (step, ratios.get("vs_bare"))
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
    setups: dict[str, dict[tuple[str, int], tuple[StepResult, float | None]]] = {}
    ready_s: dict[str, float] = {}
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        flags = ("--grpc-port", "0", "--engine-cache-dir", str(cache))
        with demo_server(args.port, repository, *flags) as (native, _):  # serves throughout: the reference
            setups["native serve"] = measure(native, args.models, args.concurrency, args.duration_s, pool)
            for ingress in args.ingress:
                for replicas in (1, 2):
                    started = time.perf_counter()
                    with ray_server(args.port + 1, repository, cache, replicas, args.replica_cpus, ingress) as url:
                        name = f"Ray {ingress}, {replicas} replica(s)"
                        ready_s[name] = time.perf_counter() - started
                        print(f"{name}: ready in {ready_s[name]:.0f} s", flush=True)
                        setups[name] = measure(url, args.models, args.concurrency, args.duration_s, pool, native)
    print("| model | setup | concurrency | req/s | p50 ms | p99 ms | x native | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for name, results in setups.items():
            for level in args.concurrency:
                step, ratio = results[(model, level)]
                print(f"| {model} | {name} | {level} | {step.req_s:,.0f} | {step.p50_ms:.2f} | {step.p99_ms:.2f} | "
                      f"{ratio or 1.0:.2f} | {sum(step.errors.values())} |")  # fmt: skip
    if args.json:
        result = [
            {"name": name, "ready_s": ready_s.get(name),
             "steps": [{"model": model, **asdict(step), "x_native": 1.0 if ratio is None else ratio}
                       for (model, level), (step, ratio) in results.items()]}
            for name, results in setups.items()
        ]  # fmt: skip
        parameters = {**arguments(args), "use_cache": False, "paired_rounds": PAIRED_ROUNDS}
        write_result(args.json, {"parameters": parameters, "setups": result})


if __name__ == "__main__":
    main()
