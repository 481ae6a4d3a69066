"""GET /v2/overview: every model with its versions, and the server's request, batching and cache counters,
latency histograms and processes, summed over its workers (and Ray Serve replicas) as /metrics sums them: the one
document the console draws. Counters are cumulative; a client takes rates and quantiles from two of them."""

from __future__ import annotations

import os
import time
from collections import defaultdict
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from layerserve import __version__
from layerserve.dataplane import DataPlane
from layerserve.errors import LayerserveError
from layerserve.protocols.v2 import metadata_json
from layerserve.transports.http.bodies import JSONResponse
from layerserve.transports.http.services import services

_HISTOGRAMS = {
    "layerserve_request_seconds": "latency_s",
    "layerserve_batch_size": "batch_size",
    "layerserve_queue_seconds": "queue_s",
    "layerserve_compute_seconds": "compute_s",
}
_COUNTERS = {
    "layerserve_cache_hits_total": "cache_hits",
    "layerserve_cache_misses_total": "cache_misses",
    "layerserve_requests_cancelled_total": "cancelled",
    "layerserve_batch_isolations_total": "isolations",
}
_BUDGET_GAUGES = {
    "layerserve_model_memory_budget_bytes": "budget_bytes",
    "layerserve_model_resident_bytes": "resident_bytes",
}
_PROCESS_GAUGES = {
    "layerserve_process_cpu_seconds": "cpu_s",
    "layerserve_process_resident_memory_bytes": "rss_bytes",
}


def model_rows(data: DataPlane) -> list[dict[str, Any]]:
    """Every model: its active and pinned version, and each version's metadata (state, reason, engine, batching,
    inputs, outputs); a model without versions says why."""
    rows: dict[str, dict[str, Any]] = {}
    for entry in data.index():
        row = rows.setdefault(entry.name, {"name": entry.name, "versions": [], "reason": ""})
        if entry.version is None:
            row["reason"] = entry.reason
            continue
        try:
            metadata = metadata_json(data.describe(entry.name, entry.version))
        except LayerserveError:  # unloaded between the index and now
            continue
        row["active_version"], row["pinned_version"] = metadata["active_version"], metadata["pinned_version"]
        row["versions"].append({k: v for k, v in metadata.items() if k not in ("versions", "name")})
    return list(rows.values())


def _histogram() -> dict[str, Any]:
    return {"buckets": defaultdict(float), "sum": 0.0, "count": 0.0}


def _model_series() -> dict[str, Any]:
    return {
        "requests": 0.0, "client_errors": 0.0, "server_errors": 0.0, "queued": 0.0,
        **{key: 0.0 for key in _COUNTERS.values()},
        **{key: _histogram() for key in _HISTOGRAMS.values()},
    }  # fmt: skip


def _process_id(labels: dict[str, str]) -> str:
    """A process's name: `<node>/<replica>` on Ray Serve, `pid N` with workers, else this process's pid."""
    if "replica" in labels:
        return f"{labels.get('node', '')[:8]}/{labels['replica']}"
    return f"pid {labels.get('pid', os.getpid())}"


def _add_model_sample(series: dict[str, Any], family: str, name: str, labels: dict[str, str], value: float) -> None:
    """Add one sample of a model's series (requests by status class, counters, queue, histograms)."""
    if name == "layerserve_requests_total":
        series["requests"] += value
        status = labels.get("status", "")
        if status.startswith("4"):
            series["client_errors"] += value
        elif status.startswith("5"):
            series["server_errors"] += value
    elif name in _COUNTERS:
        series[_COUNTERS[name]] += value
    elif name == "layerserve_queued_requests":
        series["queued"] += value
    elif family in _HISTOGRAMS:
        histogram = series[_HISTOGRAMS[family]]
        if name.endswith("_bucket") and labels["le"] != "+Inf":
            histogram["buckets"][float(labels["le"])] += value
        elif name.endswith("_sum"):
            histogram["sum"] += value
        elif name.endswith("_count"):
            histogram["count"] += value


def summarize(text: str) -> dict[str, Any]:
    """The per-model counters and histograms (summed over versions and routes), the processes' CPU seconds and
    memory, GPU memory, and the memory budget with what the loaded versions take of it (summed over workers), from a
    Prometheus text exposition."""
    models: dict[str, dict[str, Any]] = defaultdict(_model_series)
    processes: dict[str, dict[str, float]] = defaultdict(dict)
    gpus: dict[str, dict[str, float]] = defaultdict(dict)
    memory = {key: 0.0 for key in _BUDGET_GAUGES.values()}
    gpu_gauges = {"layerserve_gpu_memory_used_bytes": "used_bytes", "layerserve_gpu_memory_total_bytes": "total_bytes"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if labels.get("model"):
                _add_model_sample(models[labels["model"]], family.name, name, labels, value)
            elif name in _BUDGET_GAUGES:
                memory[_BUDGET_GAUGES[name]] += value
            elif name in _PROCESS_GAUGES:
                processes[_process_id(labels)][_PROCESS_GAUGES[name]] = value
            elif name in gpu_gauges:
                gpus[labels["device"]][gpu_gauges[name]] = value
    for series in models.values():
        for key in _HISTOGRAMS.values():
            series[key]["buckets"] = sorted(series[key]["buckets"].items())
    return {
        "models": dict(models),
        "processes": [{"id": key, **values} for key, values in sorted(processes.items())],
        "gpus": [{"device": key, **values} for key, values in sorted(gpus.items())],
        "memory": memory,
    }


async def overview(request: Request) -> Response:
    """GET /v2/overview: see the module."""
    found = services(request)
    series = summarize((await found.exposition()).decode())
    return JSONResponse(
        {
            "server": {"name": "layerserve", "version": __version__, "ready": found.is_ready(),
                       "workers": found.settings.workers, "time": time.time()},
            "models": model_rows(found.data),
            "series": series["models"],
            "processes": series["processes"],
            "gpus": series["gpus"],
            "memory": series["memory"],
        }
    )  # fmt: skip


routes = [Route("/v2/overview", overview, methods=["GET"])]
