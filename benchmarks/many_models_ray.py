"""A thousand models across Ray Serve replicas: the many-models benchmark's repository (many_models.py) served by
`layerserve ray serve --replicas 2 --model-memory-budget B`, each replica under a budget of its own, once with model
affinity (layerserve's request router, the default) and once with Ray Serve's own routing (`model_affinity: false`
in the `ray:` section of a `--config` file), under the same Zipf mix over HTTP through Ray's proxy.

    .venv/bin/python benchmarks/many_models_ray.py [--models 1000] [--big 3] [--duration-s 180] [--concurrency 8]
        [--replicas 2] [--replica-cpus 1] [--budget 167MB | --budget-fraction 0.05]
        [--routing affinity ray] [--folder DIR] [--quick] [--json PATH]

The repository and its ONNX exports (the replicas' `--engine-cache-dir`) are many_models.py's, built once into
`--folder` and reused. The budget per replica is many_models.py's budget per worker: that of
benchmarks/figures/many_models.json where it measured the same repository (`--budget-fraction` of the sum of the
versions' own figures), else `--budget-fraction` of the sum of the server's own estimate for a version it has not
loaded (twice its file, and 2 MB); `--budget` gives it.

For each routing, `layerserve ray serve --address local` starts Ray on this machine (a fresh one: a proxy keeps the
router it made), then `--concurrency` closed loops send, for `--duration-s`, V2 binary infer requests each to a
model drawn from Zipf(s) over popularity ranks dealt to the models at random (many_models_load.py, the same seeds
for both routings), each after a readiness check of its model in the same write. Ray's proxy routes the check as it
routes the infer, but not always to the same replica: a request is told warm or cold only when the same replica
(the `layerserve-replica` header) answered both, and its latency counts from the write of both to the infer's
answer; the share of requests that their model's usual replica (the one that answered it most) answered says how
well each routing keeps a model on one replica. Answers: 200 with outputs; 503 with Retry-After and an error naming
`model_memory_budget`, the budget's documented refusal; anything else is a failure. Loads and evictions are the
deltas of `layerserve_model_loads_total` and `layerserve_model_evictions_total` over the run from /metrics, which
sums what every replica posts each second (read until two readings agree). Ray's processes started for a run are
gone before the next starts (those left 30 s after the server exits are killed, and reported).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from many_models import Options as RepositoryOptions
from many_models import _step, budget_for, counters, ensure_repository, parse_bytes, summarize
from many_models_load import Tally, draws, http_loop, http_request, zipf_order
from many_models_repo import Manifest
from results import arguments, table, write_result
from soak_server import free_port

HERE = Path(__file__).resolve().parent
MB = 1 << 20
_HOST = "127.0.0.1"
REPLICA_HEADER = "layerserve-replica"  # layerserve.transports.ray.replica's: which replica answered
ROUTINGS = {"affinity": "model affinity", "ray": "Ray Serve's own routing"}
READY_LINE = "layerserve on Ray Serve:"  # what `layerserve ray serve` prints once every replica is ready


@dataclass
class Options:
    """What to build and run."""

    folder: Path
    models: int = 1000
    big: int = 3
    seed: int = 1
    zipf_s: float = 1.1
    duration_s: float = 180.0
    concurrency: int = 8
    replicas: int = 2
    replica_cpus: float = 1.0
    budget_bytes: int = 0  # 0: many_models.py's, or budget_fraction of the estimated figures
    budget_fraction: float = 0.05
    routings: tuple[str, ...] = ("affinity", "ray")
    ready_timeout_s: float = 600.0
    log_dir: Path | None = None  # the servers' logs (default: the folder's `logs/`)


def ray_processes() -> set[int]:
    """Pids of Ray's own processes (GCS, raylets, workers) on this machine."""
    found = set()
    for folder in Path("/proc").iterdir():
        if folder.name.isdigit():
            with contextlib.suppress(OSError):
                command = (folder / "cmdline").read_bytes().replace(b"\0", b" ")
                if b"gcs_server" in command or b"raylet" in command or command.startswith(b"ray::"):
                    found.add(int(folder.name))
    return found


class RayServer:
    """`layerserve ray serve REPOSITORY --address local` in a process of its own, its log in a file."""

    def __init__(self, options: Options, budget: int, routing: str, log: Path) -> None:
        self.port = free_port()
        self.before = ray_processes()
        self.killed: list[int] = []  # Ray's processes that outlived it (killed)
        self.config = Path(tempfile.mkstemp(prefix="layerserve-ray-", suffix=".yaml")[1])
        self.config.write_text(f"ray:\n  model_affinity: {'true' if routing == 'affinity' else 'false'}\n")
        command = [sys.executable, "-m", "layerserve", "ray", "serve", str(options.folder / "repo"), "--address",
                   "local", "--http-port", str(self.port), "--grpc-port", "0", "--replicas", str(options.replicas),
                   "--replica-cpus", str(options.replica_cpus), "--engine-cache-dir", str(options.folder / "onnx"),
                   "--model-memory-budget", str(budget), "--config", str(self.config), "--log-level", "info",
                   "--ready-timeout-s", str(options.ready_timeout_s)]  # fmt: skip
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        with log.open("wb") as output:
            self.started = time.perf_counter()
            self.process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds from start until it says every replica is ready and its proxy answers ready.

        Raises:
            RuntimeError: it exited, or was not ready within `timeout_s`.
        """
        url = f"http://{_HOST}:{self.port}/v2/health/ready"
        while time.perf_counter() - self.started < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"layerserve ray serve exited ({self.process.returncode}): {self.log_tail()}")
            if READY_LINE in self.log.read_text(errors="replace"):
                with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as answer:
                    if answer.status == 200:
                        return time.perf_counter() - self.started
            time.sleep(0.25)
        raise RuntimeError(f"not ready within {timeout_s:.0f} s: {self.log_tail()}")

    def metrics(self) -> str:
        """Its /metrics text (every replica's, summed by the application)."""
        with urllib.request.urlopen(f"http://{_HOST}:{self.port}/metrics", timeout=30) as answer:
            return answer.read().decode()

    def settled_counters(self) -> dict[str, float]:
        """The budget's counters, once two readings a replica's post apart agree (each posts every second)."""
        readings = [counters(self.metrics())]
        while len(readings) < 2 or readings[-1] != readings[-2]:
            time.sleep(1.5)
            readings.append(counters(self.metrics()))
        return readings[-1]

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of its log."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM (it shuts Serve and its Ray down), and wait for it (killed after 120 s); then for Ray's processes
        it started to go (those left after 30 s are killed, into `killed`)."""
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)
        self.config.unlink(missing_ok=True)
        deadline = time.monotonic() + 30
        while (left := ray_processes() - self.before) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self.killed = sorted(left)


@contextlib.contextmanager
def ray_serving(options: Options, budget: int, routing: str, log: Path) -> Iterator[RayServer]:
    """A Ray server for the length of the block."""
    server = RayServer(options, budget, routing, log)
    try:
        yield server
    finally:
        server.stop()


def default_budget(options: Options, manifest: Manifest) -> tuple[int, int, str]:
    """(the budget per replica, the sum of every model's figure it is a fraction of, where it comes from)."""
    measured = HERE / "figures" / "many_models.json"
    with contextlib.suppress(OSError, ValueError, KeyError):
        result = json.loads(measured.read_text())
        repository, parameters = result["repository"], result["parameters"]
        same = (repository["models"], repository["big"], parameters["seed"]) == (manifest.models, manifest.big,
                                                                                manifest.seed)  # fmt: skip
        if same and parameters["budget_fraction"] == options.budget_fraction and not parameters["budget"]:
            return int(result["budget_bytes"]), int(result["figures_total_bytes"]), "many_models.json"
    estimate = RepositoryOptions(options.folder, budget_fraction=options.budget_fraction)
    budget, total = budget_for(estimate, manifest, {"figures": {}})
    return budget, total, "estimate"


async def _drive(port: int, manifest: Manifest, options: Options) -> Tally:
    """The closed loops for `duration_s` through the proxy at `port`; their tally."""
    entries = manifest.entries
    order, probabilities = zipf_order(len(entries), options.zipf_s, options.seed)
    tally = Tally()
    stop_at = tally.started + options.duration_s
    requests = [http_request(e, f"{_HOST}:{port}", options.seed + i) for i, e in enumerate(entries)]
    await asyncio.gather(*(
        http_loop(_HOST, port, requests, draws(order, probabilities, options.seed * 1000 + i), stop_at, tally,
                  REPLICA_HEADER)
        for i in range(options.concurrency)
    ))  # fmt: skip
    return tally


def usual_replica_share(tally: Tally) -> float | None:
    """The share of answered requests that each model's usual replica (the one that answered it most) answered."""
    by_model: dict[int, Counter[str]] = defaultdict(Counter)
    for model, replica in tally.replicas:
        if replica:
            by_model[model][replica] += 1
    answered = sum(sum(counts.values()) for counts in by_model.values())
    usual = sum(counts.most_common(1)[0][1] for counts in by_model.values())
    return usual / answered if answered else None


def run_routing(options: Options, manifest: Manifest, routing: str, budget: int) -> dict[str, Any]:
    """One Ray server with `routing`, driven for `duration_s`: its figures."""
    log = (options.log_dir or options.folder / "logs") / f"ray-{routing}-r{options.replicas}.log"
    with ray_serving(options, budget, routing, log) as server:
        startup_s = server.wait_ready(options.ready_timeout_s)
        before = server.settled_counters()
        tally = asyncio.run(_drive(server.port, manifest, options))
        elapsed = time.perf_counter() - tally.started
        after = server.settled_counters()
        alive = server.process.poll() is None
    result = summarize(tally, elapsed)
    result.update({
        "routing": routing, "replicas": options.replicas, "budget_bytes": budget, "startup_s": startup_s,
        "server_alive": alive, "killed_ray_processes": server.killed, "log": str(log),
        **{name: after[name] - before[name] for name in after},
    })  # fmt: skip
    result["loads_per_request"] = result["loads"] / max(1, result["requests"])
    result["usual_replica_share"] = usual_replica_share(tally)
    result["evictions_per_request"] = result["evictions"] / max(1, result["requests"])
    return result


def run_benchmark(options: Options) -> dict[str, Any]:
    """Build (or reuse) the repository, then serve it on Ray with each routing."""
    timings: dict[str, float] = {}
    with _step("repository", timings):
        manifest = ensure_repository(RepositoryOptions(options.folder, options.models, options.big, options.seed))
    budget, figures_total, source = default_budget(options, manifest)
    budget = options.budget_bytes or budget
    runs = []
    for routing in options.routings:
        with _step(f"{ROUTINGS[routing]}, {options.replicas} replicas", timings):
            runs.append(run_routing(options, manifest, routing, budget))
    onnx = [e.onnx_bytes for e in manifest.entries]
    return {
        "repository": {"models": len(manifest.entries), "big": manifest.big, "onnx_bytes": sum(onnx)},
        "budget_bytes": budget, "figures_total_bytes": figures_total,
        "budget_source": "--budget" if options.budget_bytes else source, "timings_s": timings, "runs": runs,
    }  # fmt: skip


def problems(result: dict[str, Any]) -> list[str]:
    """Failures other than the budget's 503, a server that died or left Ray's processes behind, and model affinity
    not loading fewer models per request than Ray's own routing."""
    found = []
    for run in result["runs"]:
        name = ROUTINGS[run["routing"]]
        if run["failed"]:
            found.append(f"{name}: {run['failed']} failed requests, e.g. {run['failure_examples'][:2]}")
        if not run["server_alive"]:
            found.append(f"{name}: the server exited during the run")
        if run["killed_ray_processes"]:
            found.append(f"{name}: {len(run['killed_ray_processes'])} Ray processes outlived the server (killed)")
    per_request = {run["routing"]: run["loads_per_request"] for run in result["runs"]}
    if {"affinity", "ray"} <= set(per_request) and per_request["affinity"] >= per_request["ray"]:
        found.append(f"model affinity loaded {per_request['affinity']:.3f} models per request, Ray Serve's own "
                     f"routing {per_request['ray']:.3f}")  # fmt: skip
    return found


def _ms(value: float | None) -> Any:
    return "-" if value is None else value


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def render(result: dict[str, Any]) -> str:
    """Each routing's run, and how many fewer loads per request model affinity made."""
    repo, parameters = result["repository"], result["parameters"]
    runs = result["runs"]
    source = {"many_models.json": "many_models.py's budget per worker", "estimate": "estimated",
              "--budget": "given"}[result["budget_source"]]  # fmt: skip
    figures = "estimates" if result["budget_source"] == "estimate" else "own figures"
    text = (
        f"{repo['models']:,} models ({repo['big']} EfficientNet-sized), ONNX {repo['onnx_bytes'] / MB:,.0f} MB in "
        f"all, on `layerserve ray serve` with {parameters['replicas']} replicas of {parameters['replica_cpus']:g} "
        f"CPU each; budget {result['budget_bytes'] / MB:,.0f} MB per replica ({source}, "
        f"{100 * result['budget_bytes'] / result['figures_total_bytes']:.1f}% of the "
        f"{result['figures_total_bytes'] / MB:,.0f} MB the versions' {figures} add up to); Zipf s = "
        f"{parameters['zipf_s']}, {parameters['concurrency']} closed loops over HTTP through Ray's proxy, "
        f"{parameters['duration_s']:,.0f} s a run."
    )
    header = ["routing", "start-up s", "req/s", "requests", "503", "failed", "loads", "loads per request",
              "evictions", "to its usual replica", "hit rate", "warm p50 ms", "warm p99 ms", "cold p50 ms",
              "cold p99 ms", "told warm or cold"]  # fmt: skip
    rows = [
        [ROUTINGS[run["routing"]], run["startup_s"], run["req_s"], run["requests"], run["refused"], run["failed"],
         run["loads"], f"{run['loads_per_request']:.3f}", run["evictions"], _share(run["usual_replica_share"]),
         run["hit_rate"], _ms(run["warm_ms"][0]),
         _ms(run["warm_ms"][1]), _ms(run["cold_ms"][0]), _ms(run["cold_ms"][1]),
         f"{(run['warm'] + run['cold']) / max(1, run['requests']):.0%}"]
        for run in runs
    ]  # fmt: skip
    text += "\n\n" + table(header, rows)
    per_request = {run["routing"]: run["loads_per_request"] for run in runs}
    if {"affinity", "ray"} <= set(per_request) and per_request["affinity"] > 0:
        text += (f"\n\nModel affinity: {per_request['affinity']:.3f} loads per request, against "
                 f"{per_request['ray']:.3f} with Ray Serve's own routing ("
                 f"{per_request['ray'] / per_request['affinity']:.1f} times as many).")  # fmt: skip
    text += (
        "\n\nLoads and evictions: every replica's, over the run. To its usual replica: the share of requests "
        "answered by the replica that answered their model most. Warm or cold: the readiness check sent with each "
        "request, counted only where the same replica answered both (the last column: the share of requests "
        "told)."
    )
    return text + "".join(f"\n\n**Problem:** {problem}." for problem in result.get("problems", []))


QUICK: dict[str, Any] = {"models": 80, "big": 0, "duration_s": 12.0, "concurrency": 4, "budget_fraction": 0.08}


def main() -> None:
    """Run it, print the table, write JSON with `--json`; exit 1 on a problem."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--big", type=int, default=3, help="EfficientNet-sized models among them")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--zipf-s", type=float, default=1.1)
    parser.add_argument("--duration-s", type=float, default=180.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--replica-cpus", type=float, default=1.0)
    parser.add_argument("--budget", type=parse_bytes, default=0, help="per replica, e.g. 167MB (default: see above)")
    parser.add_argument("--budget-fraction", type=float, default=0.05, help="of the sum of every model's figure")
    parser.add_argument("--routing", nargs="+", choices=list(ROUTINGS), default=list(ROUTINGS))
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    parser.add_argument("--folder", type=Path, help="the repository and its ONNX cache, kept for later runs")
    parser.add_argument("--quick", action="store_true", help="the CI version: 80 small models, 12 s runs")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args()
    cache = Path.home() / ".cache" / "layerserve" / "bench"
    folder = args.folder or cache / f"many-models-{args.models}-big{args.big}-seed{args.seed}"
    options = Options(
        folder, args.models, args.big, args.seed, args.zipf_s, args.duration_s, args.concurrency, args.replicas,
        args.replica_cpus, args.budget, args.budget_fraction, tuple(args.routing), args.ready_timeout_s,
    )  # fmt: skip
    result = {"parameters": arguments(args), **run_benchmark(options)}
    result["problems"] = problems(result)
    print(render(result))
    for problem in result["problems"]:
        print(f"PROBLEM: {problem}")
    if args.json:
        write_result(args.json, result)
    sys.exit(1 if result["problems"] else 0)


if __name__ == "__main__":
    main()
