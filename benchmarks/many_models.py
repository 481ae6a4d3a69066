"""A thousand models on one machine: a repository of N distinct small models served under a memory budget that
holds about 5% of them, with a Zipf mix of requests, over HTTP and gRPC, with one worker and two; and the same
repository served without a budget, to show what holding them all takes.

    .venv/bin/python benchmarks/many_models.py [--models 1000] [--big 3] [--duration-s 300] [--concurrency 8]
        [--protocol http grpc] [--workers 1 2] [--budget 200MB | --budget-fraction 0.05] [--full-models K]
        [--folder DIR] [--quick] [--json PATH]

The repository (many_models_repo.py: dense and convolutional Keras models of 100 KB - 5 MB, and `--big`
EfficientNet-Lite0-sized ones, each with weights of its own) is built once into `--folder` with its ONNX exports
(the servers' `--engine-cache-dir`), and reused by every later run with the same `--models`, `--big` and `--seed`.

1. An empty repository is served: the memory of a server with no model (its base, per worker).
2. Without a budget, `layerserve serve` loads every model at start (or `--full-models K` of them, spread through
   the names, then extrapolated to N in proportion to their ONNX sizes, as said in the table): its start-up time
   and memory, and each version's own memory figure (`layerserve_version_memory_bytes{part="total"}`), which the
   budget counts.
3. The budget is `--budget-fraction` of the sum of every model's figure (models not measured in 2: a straight
   line through the measured ones against their ONNX size), unless `--budget` gives it.
4. For each worker count and protocol, a server with `--model-memory-budget` (which scans the repository at
   start and loads nothing): the time to readiness, then `--concurrency` closed loops for `--duration-s`, each
   request to a model drawn from Zipf(s) over popularity ranks dealt to the models at random. Each request is
   told warm or cold by a readiness check of its model just before it, on its connection (many_models_load.py).
   The memory of the server and every process below it is sampled from /proc twice a second, PSS summed (a
   page that several of them share is counted once in all) and RSS summed (counted in each); the limit the PSS is
   held to is the base (from step 4's own server at readiness, before any request) plus, per worker, the budget
   and the first ONNX Runtime session's cost beyond its graph (one worker serving only the smallest model).
   Answers: 200 with outputs; 503 with Retry-After and an error naming `model_memory_budget` (over gRPC,
   UNAVAILABLE naming it): the budget's documented refusal; anything else is a failure. Loads and evictions per
   second come from the server's counters over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

from many_models_load import (
    OK,
    REFUSED,
    MemorySample,
    Tally,
    draws,
    fetch_metrics,
    grpc_loop,
    grpc_requests,
    http_loop,
    http_request,
    metric_by_model,
    metric_sum,
    sample_memory,
    zipf_order,
)
from many_models_repo import Manifest
from results import arguments, table, write_result
from soak_server import free_port

HERE = Path(__file__).resolve().parent
MB = 1 << 20
_HOST = "127.0.0.1"


@dataclass
class Options:
    """What to build and run."""

    folder: Path
    models: int = 1000
    big: int = 3
    seed: int = 1
    zipf_s: float = 1.1
    duration_s: float = 300.0
    concurrency: int = 8
    protocols: tuple[str, ...] = ("http", "grpc")
    workers: tuple[int, ...] = (1, 2)
    budget_bytes: int = 0  # 0: budget_fraction of every model's figure
    budget_fraction: float = 0.05
    full_models: int = 0  # models served without a budget (0: all)
    full_timeout_s: float = 1800.0
    reload_interval_s: float | None = None  # the servers' repository poll under the budget (None: their default)
    sample_every_s: float = 0.5
    metrics_every_s: float = 5.0
    log_dir: Path | None = None  # the servers' logs (default: the folder's `logs/`)


def ensure_repository(options: Options) -> Manifest:
    """The folder's manifest, after building (in a process of its own, with Keras) what is missing."""
    manifest = Manifest.read(options.folder)
    if manifest is None or not _complete(options.folder, manifest):
        command = [sys.executable, str(HERE / "many_models_repo.py"), str(options.folder), "--models",
                   str(options.models), "--big", str(options.big), "--seed", str(options.seed)]  # fmt: skip
        subprocess.run(command, check=True)
        manifest = Manifest.read(options.folder)
    assert manifest is not None
    if (manifest.models, manifest.big, manifest.seed) != (options.models, options.big, options.seed):
        raise SystemExit(f"{options.folder} holds another repository: use another --folder")
    return manifest


def _complete(folder: Path, manifest: Manifest) -> bool:
    """Whether every model file and ONNX export of the manifest is there (the hashes are not read again)."""
    exports = {path.name[:40] for path in (folder / "onnx").glob("*.onnx")}
    return all((folder / "repo" / e.name / "1" / "model.keras").exists() and e.digest[:40] in exports
               for e in manifest.entries)  # fmt: skip


class Server:
    """`layerserve serve REPOSITORY` in a process of its own, its log in a file."""

    def __init__(self, repository: Path, cache: Path, log: Path, *flags: str) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        command = [sys.executable, "-m", "layerserve", "serve", str(repository), "--port", str(self.port),
                   "--grpc-port", str(self.grpc_port), "--engine-cache-dir", str(cache), "--log-level", "info",
                   *flags]  # fmt: skip
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        with log.open("wb") as output:
            self.started = time.perf_counter()
            self.process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        self.is_supervisor = "--workers" in flags and flags[flags.index("--workers") + 1] != "1"

    def wait_ready(self, timeout_s: float) -> float | None:
        """Seconds from start to readiness (every worker ready), or None if not ready within `timeout_s`.

        Raises:
            RuntimeError: the server exited.
        """
        url = f"http://{_HOST}:{self.port}/v2/health/ready"
        while time.perf_counter() - self.started < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}): {self.log_tail()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as answer:
                if answer.status == 200:
                    return time.perf_counter() - self.started
            time.sleep(0.05)
        return None

    def memory(self, t_s: float = 0.0) -> MemorySample:
        """The resident memory of the server and every process below it now."""
        return sample_memory(self.process.pid, self.is_supervisor, t_s)

    def metrics(self) -> str:
        """Its /metrics text."""
        return asyncio.run(fetch_metrics(_HOST, self.port))

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of its log."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM, and wait for it (killed after 60 s)."""
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)


@contextlib.contextmanager
def serving(repository: Path, cache: Path, log: Path, *flags: str) -> Iterator[Server]:
    """A server for the length of the block."""
    server = Server(repository, cache, log, *flags)
    try:
        yield server
    finally:
        server.stop()


def settled_memory(server: Server, samples: int = 3) -> MemorySample:
    """The memory once the server is idle: the median of a few samples a quarter of a second apart."""
    taken = []
    for _ in range(samples):
        time.sleep(0.25)
        taken.append(server.memory())
    return sorted(taken, key=lambda sample: sample.pss_bytes)[samples // 2]


def empty_base(options: Options, workers: int) -> dict[str, Any]:
    """A server of `workers` over an empty repository, under a budget: its start-up time and memory (ONNX Runtime's
    one-time set-up included, which a server under a budget does at start)."""
    with tempfile.TemporaryDirectory(prefix="layerserve-empty-") as empty:
        flags = ("--workers", str(workers), "--model-memory-budget", "1GB")
        with serving(Path(empty), options.folder / "onnx", _log(options, f"empty-w{workers}"), *flags) as server:
            startup_s = server.wait_ready(120)
            memory = settled_memory(server)
    return {"workers": workers, "startup_s": startup_s, "rss_bytes": memory.rss_bytes, "pss_bytes": memory.pss_bytes}


def first_session(options: Options, manifest: Manifest, empty_pss: int) -> dict[str, Any]:
    """One worker serving only the smallest model: what its first ONNX Runtime session costs beyond its graph and
    the runtime's set-up (once per process; the budget cannot count it once that version is gone)."""
    smallest = min(manifest.entries, key=lambda entry: entry.onnx_bytes)
    flags = ("--workers", "1", "--models", smallest.name)
    with serving(options.folder / "repo", options.folder / "onnx", _log(options, "first-session"), *flags) as server:
        server.wait_ready(120)
        memory = settled_memory(server)
        figure = metric_sum(server.metrics(), "layerserve_version_memory_bytes", 'part="total"')
    engine = max(0, memory.pss_bytes - empty_pss - smallest.onnx_bytes)
    return {"model": smallest.name, "onnx_bytes": smallest.onnx_bytes, "rss_bytes": memory.rss_bytes,
            "pss_bytes": memory.pss_bytes, "figure_bytes": figure, "engine_bytes": engine}  # fmt: skip


def _log(options: Options, name: str) -> Path:
    return (options.log_dir or options.folder / "logs") / f"{name}.log"


def hold_all(options: Options, manifest: Manifest) -> dict[str, Any]:
    """Serve every model (or `full_models` of them) without a budget: start-up, memory, each version's figure."""
    entries = manifest.entries
    count = options.full_models or len(entries)
    chosen = entries
    if count < len(entries):
        chosen = tuple(entries[int(i)] for i in np.linspace(0, len(entries) - 1, count).round())
    flags = ["--workers", "1"] + (["--models", ",".join(e.name for e in chosen)] if count < len(entries) else [])
    with serving(options.folder / "repo", options.folder / "onnx", _log(options, "hold-all"), *flags) as server:
        startup_s = server.wait_ready(options.full_timeout_s)
        memory = settled_memory(server) if startup_s is not None else server.memory()
        text = server.metrics()
    figures = metric_by_model(text, "layerserve_version_memory_bytes", 'part="total"')
    ready = int(metric_sum(text, "layerserve_model_state", 'state="READY"'))
    onnx_served = sum(e.onnx_bytes for e in chosen)
    onnx_all = sum(e.onnx_bytes for e in entries)
    return {
        "models": len(chosen), "of": len(entries), "startup_s": startup_s, "timeout_s": options.full_timeout_s,
        "ready": ready, "rss_bytes": memory.rss_bytes, "pss_bytes": memory.pss_bytes, "by_role": memory.by_role,
        "figures": figures, "onnx_bytes_served": onnx_served, "onnx_bytes_all": onnx_all,
        "figures_sum": sum(figures.values()),
    }  # fmt: skip


def budget_for(options: Options, manifest: Manifest, full: dict[str, Any]) -> tuple[int, int]:
    """(the budget, the estimated sum of every model's figure): `budget_fraction` of that sum, unless given."""
    figures: dict[str, float] = full["figures"]
    measured = [(e.onnx_bytes, figures[e.name]) for e in manifest.entries if e.name in figures]
    if len(measured) >= 2:
        sizes, taken = np.array(measured, dtype=np.float64).T
        slope, intercept = (float(value) for value in np.polyfit(sizes, taken, 1))
    else:  # nothing measured: the server's own estimate of a version not loaded yet (twice its file, 2 MB more)
        slope, intercept = 2.0, 2 * MB
    total = sum(figures.get(e.name, slope * e.onnx_bytes + intercept) for e in manifest.entries)
    return options.budget_bytes or int(options.budget_fraction * total), int(total)


async def _drive(server: Server, manifest: Manifest, protocol: str, options: Options) -> tuple[Tally, list[Any]]:
    """The closed loops for `duration_s`, the memory sampled meanwhile; (the tally, [memory samples, metrics])."""
    entries = manifest.entries
    order, probabilities = zipf_order(len(entries), options.zipf_s, options.seed)
    tally = Tally()
    stop_at = tally.started + options.duration_s
    host = f"{_HOST}:{server.port}"
    if protocol == "http":
        requests = [http_request(e, host, options.seed + i) for i, e in enumerate(entries)]
        loops = [http_loop(_HOST, server.port, requests, draws(order, probabilities, options.seed * 1000 + i),
                           stop_at, tally) for i in range(options.concurrency)]  # fmt: skip
    else:
        messages = grpc_requests(entries, options.seed)
        target = f"{_HOST}:{server.grpc_port}"
        loops = [grpc_loop(target, entries, messages, draws(order, probabilities, options.seed * 1000 + i),
                           stop_at, tally) for i in range(options.concurrency)]  # fmt: skip
    samples: list[MemorySample] = []
    resident: list[tuple[float, float]] = []

    async def sample() -> None:
        next_metrics = 0.0
        while (now := time.perf_counter()) < stop_at:
            samples.append(await asyncio.to_thread(server.memory, now - tally.started))
            if now >= next_metrics:
                text = await fetch_metrics(_HOST, server.port)
                resident.append((now - tally.started, metric_sum(text, "layerserve_model_resident_bytes")))
                next_metrics = now + options.metrics_every_s
            await asyncio.sleep(options.sample_every_s)

    await asyncio.gather(*loops, sample())
    return tally, [samples, resident]


def counters(text: str) -> dict[str, float]:
    """The budget's counters of a /metrics text."""
    return {
        "loads": metric_sum(text, "layerserve_model_loads_total"),
        "evictions": metric_sum(text, "layerserve_model_evictions_total"),
        "cold_starts": metric_sum(text, "layerserve_cold_start_seconds_count"),
        "cold_start_s": metric_sum(text, "layerserve_cold_start_seconds_sum"),
    }


def run_scenario(
    options: Options, manifest: Manifest, protocol: str, workers: int, budget: int, engine: int
) -> dict[str, Any]:
    """One server under the budget, driven for `duration_s` over one protocol: its figures. Its memory limit: its
    base, and per worker the budget and the first session's cost (`engine`)."""
    flags = ["--workers", str(workers)] + (["--model-memory-budget", str(budget)] if budget else [])
    if options.reload_interval_s is not None:
        flags += ["--reload-interval-s", str(options.reload_interval_s)]
    log = _log(options, f"budget-{protocol}-w{workers}")
    with serving(options.folder / "repo", options.folder / "onnx", log, *flags) as server:
        startup_s = server.wait_ready(options.full_timeout_s)
        if startup_s is None:
            raise RuntimeError(f"not ready within {options.full_timeout_s} s: {server.log_tail()}")
        base = settled_memory(server)
        before = counters(server.metrics())
        tally, (samples, resident) = asyncio.run(_drive(server, manifest, protocol, options))
        elapsed = time.perf_counter() - tally.started
        after_text = server.metrics()
        after = counters(after_text)
        alive = server.process.poll() is None
    result = summarize(tally, elapsed)
    rss = [sample.rss_bytes for sample in samples]
    pss = [sample.pss_bytes for sample in samples]
    result.update({
        "protocol": protocol, "workers": workers, "budget_bytes": budget, "startup_s": startup_s,
        "base_rss_bytes": base.rss_bytes, "base_pss_bytes": base.pss_bytes, "base_by_role": base.by_role,
        "limit_bytes": base.pss_bytes + workers * (budget + engine), "peak_pss_bytes": max(pss, default=0),
        "over_budget_bytes": max(pss, default=0) - base.pss_bytes - workers * budget,
        "peak_rss_bytes": max(rss, default=0), "last_pss_bytes": pss[-1] if pss else 0,
        "peak_by_role": max(samples, key=lambda s: s.pss_bytes).by_role if samples else {},
        "resident_figure_bytes": max((value for _, value in resident), default=0.0),
        "memory_timeline": [(s.t_s, s.rss_bytes, s.pss_bytes) for s in samples[:: max(1, len(samples) // 300)]],
        "server_alive": alive, "log": str(log),
        **{name: after[name] - before[name] for name in after},
    })  # fmt: skip
    result["loads_per_s"] = result["loads"] / elapsed
    result["evictions_per_s"] = result["evictions"] / elapsed
    return result


def summarize(tally: Tally, elapsed: float) -> dict[str, Any]:
    """Counts, the hit rate and the warm and cold latency percentiles of a tally."""
    status = np.array(tally.status)
    latency = np.array(tally.latency_s) * 1000
    warm = np.array([w is True for w in tally.warm])
    cold = np.array([w is False for w in tally.warm])
    ok = status == OK

    def percentiles(mask: np.ndarray) -> list[float | None]:
        return [float(np.percentile(latency[mask], q)) if mask.any() else None for q in (50, 99)]

    return {
        "requests": len(status), "duration_s": elapsed, "req_s": len(status) / elapsed, "ok": int(ok.sum()),
        "refused": int((status == REFUSED).sum()), "failed": int((~ok & (status != REFUSED)).sum()),
        "refusals_without_retry_after": tally.refusals_without_retry_after,
        "warm": int(warm.sum()), "cold": int(cold.sum()), "unknown": int((~warm & ~cold).sum()),
        "hit_rate": float(warm.sum() / max(1, warm.sum() + cold.sum())),
        "warm_ms": percentiles(ok & warm), "cold_ms": percentiles(ok & cold),
        "refusal_examples": tally.refusals, "failure_examples": tally.failures,
        "models_requested": len(set(tally.models)),
    }  # fmt: skip


@contextlib.contextmanager
def _step(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Time one step of the benchmark into `timings`, saying so on standard error."""
    print(f"== {name}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - started, 1)
    print(f"== {name}: {timings[name]} s", file=sys.stderr, flush=True)


def run_benchmark(options: Options) -> dict[str, Any]:
    """Build (or reuse) the repository, measure the bases and the budget-off server, then every scenario."""
    timings: dict[str, float] = {}
    with _step("repository", timings):
        manifest = ensure_repository(options)
    with _step("bases", timings):
        bases = [empty_base(options, workers) for workers in sorted({1, *options.workers})]
        first = first_session(options, manifest, bases[0]["pss_bytes"])  # one worker's, as its own
    with _step("without a budget", timings):
        full = hold_all(options, manifest)
    budget, figures_total = budget_for(options, manifest, full)
    scenarios = []
    for workers in options.workers:
        for protocol in options.protocols:
            with _step(f"{protocol}, {workers} worker(s)", timings):
                scenarios.append(run_scenario(options, manifest, protocol, workers, budget, first["engine_bytes"]))
    onnx = [e.onnx_bytes for e in manifest.entries]
    prepared = [e.prepare_s for e in manifest.entries if e.prepare_s and e.kind != "efficientnet"]
    return {
        "repository": {
            "models": len(manifest.entries), "big": manifest.big, "onnx_bytes": sum(onnx),
            "onnx_min_bytes": min(onnx), "onnx_median_bytes": float(np.median(onnx)), "onnx_max_bytes": max(onnx),
            "prepare_median_s": float(np.median(prepared)) if prepared else None,
        },
        "budget_bytes": budget, "figures_total_bytes": figures_total, "bases": bases, "first_session": first,
        "hold_all": full, "timings_s": timings,
        "scenarios": scenarios,
    }  # fmt: skip


# Per worker, what its memory may reach past the limit: a load in flight (its graph read and its session
# built, a few times its ONNX size at once, which its figure counts only once it is loaded) and what the C
# allocator keeps of the versions it freed.
TOLERANCE_PER_WORKER_BYTES = 48 * MB


def problems(result: dict[str, Any]) -> list[str]:
    """What the run found wrong: failures other than the budget's 503, memory past the limit (and the tolerance),
    a server that died."""
    found = []
    for run in result["scenarios"]:
        name = f"{run['protocol']}, {run['workers']} worker(s)"
        if run["failed"]:
            found.append(f"{name}: {run['failed']} failed requests, e.g. {run['failure_examples'][:2]}")
        if run["peak_pss_bytes"] > run["limit_bytes"] + run["workers"] * TOLERANCE_PER_WORKER_BYTES:
            over = (run["peak_pss_bytes"] - run["limit_bytes"]) / MB
            found.append(f"{name}: memory (PSS) peaked {over:.0f} MB over its limit")
        if not run["server_alive"]:
            found.append(f"{name}: the server exited during the run")
    return found


def _ms(value: float | None) -> Any:
    return "-" if value is None else value


def render(result: dict[str, Any]) -> str:
    """The repository, each budget run, and the server holding every model."""
    repo, full = result["repository"], result["hold_all"]
    parameters = result["parameters"]
    text = (
        f"{repo['models']:,} models ({repo['big']} EfficientNet-sized), ONNX {repo['onnx_bytes'] / MB:,.0f} MB in all "
        f"({repo['onnx_min_bytes'] / 1e3:,.0f} KB - {repo['onnx_max_bytes'] / 1e6:,.1f} MB, median "
        f"{repo['onnx_median_bytes'] / 1e6:,.2f} MB); Zipf s = {parameters['zipf_s']}, {parameters['concurrency']} "
        f"closed loops, {parameters['duration_s']:,.0f} s a run; budget {result['budget_bytes'] / MB:,.0f} MB per "
        f"worker, {100 * result['budget_bytes'] / result['figures_total_bytes']:.1f}% of the "
        f"{result['figures_total_bytes'] / MB:,.0f} MB the versions' own figures add up to."
    )
    if repo["prepare_median_s"]:
        text += f" One small model's export (prepare_model) took {repo['prepare_median_s']:.2f} s (median)."
    header = ["door", "workers", "start-up s", "req/s", "requests", "503", "failed", "hit rate", "warm p50 ms",
              "warm p99 ms", "cold p50 ms", "cold p99 ms", "loads/s", "evictions/s", "base PSS MB",
              "peak PSS MB", "of it engine processes MB", "limit MB", "peak RSS MB"]  # fmt: skip
    rows = [
        [run["protocol"], run["workers"], run["startup_s"], run["req_s"], run["requests"], run["refused"],
         run["failed"], run["hit_rate"], _ms(run["warm_ms"][0]), _ms(run["warm_ms"][1]), _ms(run["cold_ms"][0]),
         _ms(run["cold_ms"][1]), run["loads_per_s"], run["evictions_per_s"], run["base_pss_bytes"] / MB,
         run["peak_pss_bytes"] / MB, run["peak_by_role"].get("engine process", 0) / MB, run["limit_bytes"] / MB,
         run["peak_rss_bytes"] / MB]
        for run in result["scenarios"]
    ]  # fmt: skip
    text += "\n\n" + table(header, rows)
    bases = ", ".join(f"{b['workers']} worker(s) {b['pss_bytes'] / MB:,.0f} MB" for b in result["bases"])
    first = result["first_session"]
    text += (
        f"\n\nBase: the server's processes at readiness, before any request (an empty repository's: {bases}); "
        f"limit: the base and, per worker, the budget and the first ONNX Runtime session's cost beyond its graph "
        f"and the runtime's set-up (which the base holds), "
        f"{first['engine_bytes'] / MB:,.0f} MB (one worker serving only the smallest model, {first['model']}, "
        f"whose own figure is {first['figure_bytes'] / MB:,.1f} MB); a run passes within "
        f"{TOLERANCE_PER_WORKER_BYTES // MB} MB a worker over it. PSS sums every process of the server's, a page "
        f"that several share counted once in all (the libraries that workers and engine processes map, the pages a "
        f"worker shares with the supervisor it was forked from); RSS, summed, counts it in each."
    )
    if full["startup_s"] is None:
        held = (f"Without a budget, the server was not ready within {full['timeout_s']:,.0f} s: {full['ready']:,} "
                f"of {full['models']:,} models loaded, {full['rss_bytes'] / MB:,.0f} MB resident.")  # fmt: skip
    else:
        held = (f"Without a budget, {full['models']:,} models loaded at start in {full['startup_s']:,.1f} s and took "
                f"{full['rss_bytes'] / MB:,.0f} MB resident (PSS {full['pss_bytes'] / MB:,.0f} MB); the versions' "
                f"own figures add up to {full['figures_sum'] / MB:,.0f} MB.")  # fmt: skip
    if full["models"] < full["of"]:
        base = result["bases"][0]["rss_bytes"]
        extrapolated = base + (full["rss_bytes"] - base) * full["onnx_bytes_all"] / full["onnx_bytes_served"]
        held += (f" Extrapolated to all {full['of']:,} in proportion to their ONNX sizes (not measured): about "
                 f"{extrapolated / MB:,.0f} MB.")  # fmt: skip
    text += "\n\n" + held
    return text + "".join(f"\n\n**Problem:** {problem}." for problem in result.get("problems", []))


def parse_bytes(value: str) -> int:
    """`200MB`, `1.5GB` or a number of bytes (binary units, as the server's setting)."""
    units = {"KB": 1 << 10, "MB": MB, "GB": 1 << 30}
    suffix = value.strip().upper()[-2:]
    return int(float(value.strip()[:-2]) * units[suffix]) if suffix in units else int(value)


QUICK: dict[str, Any] = {"models": 80, "big": 0, "duration_s": 12.0, "concurrency": 4, "budget_fraction": 0.08}


def main() -> None:
    """Run it, print the tables, write JSON with `--json`; exit 1 on a problem."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--big", type=int, default=3, help="EfficientNet-sized models among them")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--zipf-s", type=float, default=1.1)
    parser.add_argument("--duration-s", type=float, default=300.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--protocol", nargs="+", choices=["http", "grpc"], default=["http", "grpc"])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--budget", type=parse_bytes, default=0, help="per worker, e.g. 200MB (default: a fraction)")
    parser.add_argument("--budget-fraction", type=float, default=0.05, help="of the sum of every model's figure")
    parser.add_argument("--full-models", type=int, default=0, help="models served without a budget (0: all)")
    parser.add_argument("--full-timeout-s", type=float, default=1800.0)
    parser.add_argument("--reload-interval-s", type=float, help="the budget runs' repository poll (default: 2 s)")
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
        folder, args.models, args.big, args.seed, args.zipf_s, args.duration_s, args.concurrency,
        tuple(args.protocol), tuple(args.workers), args.budget, args.budget_fraction, args.full_models,
        args.full_timeout_s, args.reload_interval_s,
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
