"""Metrics of versions that come and go: a version's own series leave /metrics with the last registry holding it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import REGISTRY, generate_latest

from layerserve import metrics


def _series_of(model: str, version: str) -> list[str]:
    text = generate_latest(REGISTRY).decode()
    return [line for line in text.splitlines() if f'model="{model}"' in line and f'version="{version}"' in line]


def _write_series(model: str, version: int) -> None:
    labels = (model, str(version))
    metrics.set_model_state(model, version, "READY")
    metrics.BATCH_SIZE.labels(*labels).observe(4)
    metrics.QUEUE_SECONDS.labels(*labels).observe(0.001)
    metrics.COMPUTE_SECONDS.labels(*labels).observe(0.002)
    metrics.REQUESTS_CANCELLED.labels(*labels).inc()
    metrics.MODEL_LOAD_SECONDS.labels(*labels).set(1.5)
    metrics.QUEUED.labels(*labels).set(0)
    metrics.set_version_memory(model, version, {"total_bytes": 100})
    metrics.REQUESTS.labels(model, str(version), "v2.infer", "200").inc()


def test_a_versions_own_series_go_with_its_last_holder_and_its_request_counts_stay() -> None:
    model, version = "gone_model", 7
    metrics.hold_version_series(model, version)  # two runtimes of one process serve the same version
    metrics.hold_version_series(model, version)
    _write_series(model, version)
    before = _series_of(model, "7")
    for name in ("batch_size_bucket", "queue_seconds", "compute_seconds", "requests_cancelled", "load_seconds",
                 "queued_requests", "version_memory_bytes", "model_state"):  # fmt: skip
        assert any(name in line for line in before), name
    metrics.release_version_series(model, version)  # one runtime unloads it: the other still writes its series
    assert _series_of(model, "7") == before
    metrics.release_version_series(model, version)
    after = _series_of(model, "7")
    kept = ("layerserve_requests_total{", "layerserve_requests_created{")  # the request counter alone
    assert after and all(line.startswith(kept) for line in after), after
    metrics.hold_version_series(model, version)  # loaded again: its series come back as it writes them
    _write_series(model, version)
    assert len(_series_of(model, "7")) == len(before)
    metrics.release_version_series(model, version)


_MANY_MODELS_SCRIPT = """
import ctypes, gc, json, sys, threading, time
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from layerserve import metrics
from layerserve.metric_files import exposition_of_files

def resident_kb():
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS"))

def in_process():
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return generate_latest(registry)

for number in range(1000):
    model = f"model_{number:04d}"
    metrics.set_model_state(model, 1, "READY")
    metrics.set_version_memory(model, 1, {"total_bytes": 100})
    for histogram in (metrics.BATCH_SIZE, metrics.QUEUE_SECONDS, metrics.COMPUTE_SECONDS):
        histogram.labels(model, "1").observe(1)
    metrics.MODEL_LOADS.labels(model).inc()
expected = in_process()
kept = []

def serve_requests(count):  # what requests keep while a text is made: small objects, a few at a time
    for _ in range(count // 200):
        kept.extend({"row": [1.0, 2.0]} for _ in range(200))
        time.sleep(0.002)

grown, same = {}, True
for make in (exposition_of_files, in_process):
    before = resident_kb()
    for _ in range(3):
        requests = threading.Thread(target=serve_requests, args=(20_000,))
        requests.start()
        same = same and make() == expected
        requests.join()
    grown[make.__name__] = (resident_kb() - before) // 1024
print(json.dumps({"same": same, "series": expected.count(b"\\n"), "grown_mb": grown}))
"""


def test_every_workers_metric_files_are_read_in_a_child_that_gives_its_memory_back(tmp_path: Path) -> None:
    """With several workers, /metrics is the text of every worker's metric files: made by a child process, it
    equals what prometheus_client makes in process, and the worker keeps little of the memory making it takes.
    Made in process while requests keep small objects (a thousand models' series), the worker kept several times
    more, which the memory budget would count against its models."""
    folder = tmp_path / "metrics"
    folder.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", _MANY_MODELS_SCRIPT], capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["same"]
    assert found["series"] > 40_000  # a thousand models' series
    grown = found["grown_mb"]
    assert grown["exposition_of_files"] * 2 < grown["in_process"], found  # measured: 17 MB against 87 MB
