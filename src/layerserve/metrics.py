"""Every Prometheus metric layerserve exports (module-level metric objects, per STYLE.md rule 5)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import weakref
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

_LABELS = ("model", "version")
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

BATCH_SIZE = Histogram(
    "layerserve_batch_size", "Rows per model call (dynamic batching).", _LABELS, buckets=_BATCH_BUCKETS
)
QUEUE_SECONDS = Histogram(
    "layerserve_queue_seconds", "Time a request waited in its batcher's queue.", _LABELS, buckets=_SECONDS_BUCKETS
)
COMPUTE_SECONDS = Histogram(
    "layerserve_compute_seconds", "Time of one batched model call.", _LABELS, buckets=_SECONDS_BUCKETS
)
BATCH_ISOLATIONS = Counter(
    "layerserve_batch_isolations",
    "Batched calls that failed and were split and run again so that only the failing requests got the error.",
    _LABELS,
)
REQUESTS_CANCELLED = Counter(
    "layerserve_requests_cancelled",
    "Requests dropped from their queue, never computed, because the client went away (HTTP disconnect, gRPC cancel).",
    _LABELS,
)

_CACHE_LABELS = ("model", "backend")
CACHE_HITS = Counter("layerserve_cache_hits", "Output rows served from the feature cache.", _CACHE_LABELS)
CACHE_MISSES = Counter("layerserve_cache_misses", "Output rows computed because the cache had none.", _CACHE_LABELS)
CACHE_ERRORS = Counter(
    "layerserve_cache_errors", "Feature cache failures (backend errors, malformed values).", _CACHE_LABELS
)
CACHE_BYTES = Counter("layerserve_cache_stored_bytes", "Bytes written to the feature cache.", _CACHE_LABELS)
TRACE_SPANS_DROPPED = Counter(
    "layerserve_trace_spans_dropped",
    "Finished trace spans not sent to the collector: the export queue was full, or the collector refused them.",
    ("reason",),
)

_REQUEST_LABELS = ("model", "version", "route", "status")
REQUESTS = Counter("layerserve_requests", "HTTP requests answered.", _REQUEST_LABELS)
REQUEST_SECONDS = Histogram(
    "layerserve_request_seconds", "Time from request to answer.", ("model", "route"), buckets=_SECONDS_BUCKETS
)
QUEUED = Gauge(
    "layerserve_queued_requests", "Requests waiting in a version's batcher queues (sampled every second).", _LABELS,
    multiprocess_mode="livesum",
)  # fmt: skip
IN_FLIGHT = Gauge(
    "layerserve_requests_in_flight", "Requests being answered now (sampled when read, and every second).",
    multiprocess_mode="livesum",
)  # fmt: skip
MODEL_LOAD_SECONDS = Gauge(
    "layerserve_model_load_seconds", "Seconds the last load of a version took.", _LABELS, multiprocess_mode="max"
)
MODEL_STATE = Gauge(
    "layerserve_model_state", "1 for a version's state (LOADING, READY, FAILED; 0 for all once unloaded), per process.",
    ("model", "version", "state"), multiprocess_mode="liveall",
)  # fmt: skip
VERSION_MEMORY_BYTES = Gauge(
    "layerserve_version_memory_bytes",
    "A ready version's resident memory by part (server, session, process_share, cuts, total; see the metadata).",
    ("model", "version", "part"), multiprocess_mode="liveall",
)  # fmt: skip
MODEL_LOADS = Counter("layerserve_model_loads", "Versions loaded (at start, on demand, reloaded).", ("model",))
MODEL_EVICTIONS = Counter(
    "layerserve_model_evictions", "Versions unloaded to make room under the memory budget.", ("model",)
)
COLD_START_SECONDS = Histogram(
    "layerserve_cold_start_seconds",
    "Time from a request for a version not loaded to the version serving (on-demand loads under a memory budget).",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
MODEL_MEMORY_BUDGET_BYTES = Gauge(
    "layerserve_model_memory_budget_bytes", "The memory budget of the loaded versions (model_memory_budget; 0: none).",
    multiprocess_mode="livesum",
)  # fmt: skip
MODEL_RESIDENT_BYTES = Gauge(
    "layerserve_model_resident_bytes",
    "Memory the loaded versions take as their own figures say (the sum of their `total`; sampled every second).",
    multiprocess_mode="livesum",
)
PROCESS_CPU_SECONDS = Gauge(
    "layerserve_process_cpu_seconds",
    "CPU seconds used by the server process and its engine processes.",
    multiprocess_mode="liveall",
)
PROCESS_RSS_BYTES = Gauge(
    "layerserve_process_resident_memory_bytes",
    "Resident memory of the server process and its engine processes.",
    multiprocess_mode="liveall",
)
GPU_MEMORY_USED_BYTES = Gauge(
    "layerserve_gpu_memory_used_bytes", "GPU memory in use, per device.", ("device",), multiprocess_mode="max"
)
GPU_MEMORY_TOTAL_BYTES = Gauge(
    "layerserve_gpu_memory_total_bytes", "GPU memory, per device.", ("device",), multiprocess_mode="max"
)

_STATES = ("LOADING", "READY", "FAILED")

# The model and version a request was answered by, for the request metrics and the access log.
SERVED_BY: ContextVar[tuple[str, int] | None] = ContextVar("served_by", default=None)


# What IN_FLIGHT sums: objects whose `in_flight` int counts their requests being answered (each door's recorder).
_IN_FLIGHT_COUNTERS: weakref.WeakSet[Any] = weakref.WeakSet()
_IN_FLIGHT_LOCK = threading.Lock()  # counters come and go with runtimes (several in one process in tests)


def count_in_flight(counter: Any) -> None:
    """Sum `counter.in_flight` (an int updated by its own event loop alone) into IN_FLIGHT at each sample."""
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT_COUNTERS.add(counter)


def set_model_state(name: str, version: int, state: str) -> None:
    """Record a version's state for /metrics (UNAVAILABLE, listed and not loaded: 0 for every state; a version
    never loaded has no series at all, so that a thousand listed models do not make thousands)."""
    for known in _STATES:
        MODEL_STATE.labels(name, str(version), known).set(1.0 if known == state else 0.0)


# How many registries hold each (model, version) pair, over every runtime of this process (tests and programs using
# the Python API may run several): a version's own series leave /metrics with the last of them. Book-keeping of the
# metric objects above, and so module-level with them.
_SERIES_HOLDERS: dict[tuple[str, str], int] = {}


def hold_version_series(name: str, version: int) -> None:
    """A registry has a version of this number now (its series may be written)."""
    key = (name, str(version))
    _SERIES_HOLDERS[key] = _SERIES_HOLDERS.get(key, 0) + 1


def release_version_series(name: str, version: int) -> None:
    """A registry no longer has this version number: once none has, its own series (state, queue, batches, load
    time, memory) leave /metrics, so that versions that come and go do not pile up series. The request counters,
    labelled by route and status too, stay."""
    key = (name, str(version))
    holders = _SERIES_HOLDERS.pop(key, 0) - 1
    if holders > 0:
        _SERIES_HOLDERS[key] = holders
        return
    for metric in _VERSION_SERIES:
        with contextlib.suppress(KeyError):
            metric.remove(*key)
    for part in _MEMORY_PARTS:
        with contextlib.suppress(KeyError):
            VERSION_MEMORY_BYTES.remove(*key, part)
    for known in _STATES:
        with contextlib.suppress(KeyError):
            MODEL_STATE.remove(*key, known)


_MEMORY_PARTS = ("server", "session", "process_share", "cuts", "total")
# Series labelled (model, version) alone, made by a loaded version and its batchers.
_VERSION_SERIES = (QUEUED, BATCH_SIZE, QUEUE_SECONDS, COMPUTE_SECONDS, BATCH_ISOLATIONS, REQUESTS_CANCELLED,
                   MODEL_LOAD_SECONDS)  # fmt: skip


# Servers in one process (embedded, or a test's) share these gauges: each samples them and reads them back as
# one step under this lock, so that its /metrics never shows a neighbour's budget or resident bytes.
GAUGES_SAMPLED = threading.Lock()


def set_version_memory(name: str, version: int, memory: dict[str, int]) -> None:
    """Record a version's resident memory by part (`ModelVersion.memory`) for /metrics."""
    for part in _MEMORY_PARTS:
        VERSION_MEMORY_BYTES.labels(name, str(version), part).set(memory.get(f"{part}_bytes", 0))


def sample_process(engine_usage: tuple[float, int] = (0.0, 0), with_gpu: bool = True) -> None:
    """Refresh the process (and GPU) gauges, counting the engine processes' `(CPU seconds, resident bytes)` as
    this process's, and the requests in flight; each worker does, so that /metrics can sum them."""
    import resource

    with _IN_FLIGHT_LOCK:
        IN_FLIGHT.set(sum(counter.in_flight for counter in _IN_FLIGHT_COUNTERS))

    engine_cpu_seconds, engine_resident = engine_usage
    usage = resource.getrusage(resource.RUSAGE_SELF)
    PROCESS_CPU_SECONDS.set(usage.ru_utime + usage.ru_stime + engine_cpu_seconds)
    with contextlib.suppress(OSError, ValueError, IndexError):
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        PROCESS_RSS_BYTES.set(pages * os.sysconf("SC_PAGE_SIZE") + engine_resident)
    for device, used, total in gpu_memory() if with_gpu else ():
        GPU_MEMORY_USED_BYTES.labels(device).set(used)
        GPU_MEMORY_TOTAL_BYTES.labels(device).set(total)


def gpu_memory() -> list[tuple[str, int, int]]:
    """(device, used bytes, total bytes) per GPU from nvidia-smi; empty where there is none."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=5, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    rows = []
    for line in result.stdout.strip().splitlines():
        with contextlib.suppress(ValueError):
            index, used, total = (part.strip() for part in line.split(","))
            rows.append((index, int(used) << 20, int(total) << 20))
    return rows
