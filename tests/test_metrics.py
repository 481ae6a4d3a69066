"""Metrics of versions that come and go: an unloaded version's own series leave /metrics."""

from __future__ import annotations

from prometheus_client import REGISTRY, generate_latest

from layerserve import metrics


def _series_of(model: str, version: str) -> list[str]:
    text = generate_latest(REGISTRY).decode()
    return [line for line in text.splitlines() if f'model="{model}"' in line and f'version="{version}"' in line]


def test_an_unloaded_versions_own_series_go_and_its_request_counts_stay() -> None:
    labels = ("gone_model", "7")
    metrics.set_model_state(*labels[:1], 7, "READY")
    metrics.BATCH_SIZE.labels(*labels).observe(4)
    metrics.QUEUE_SECONDS.labels(*labels).observe(0.001)
    metrics.COMPUTE_SECONDS.labels(*labels).observe(0.002)
    metrics.REQUESTS_CANCELLED.labels(*labels).inc()
    metrics.MODEL_LOAD_SECONDS.labels(*labels).set(1.5)
    metrics.QUEUED.labels(*labels).set(0)
    metrics.set_version_memory("gone_model", 7, {"total_bytes": 100})
    metrics.REQUESTS.labels("gone_model", "7", "infer", "200").inc()
    before = _series_of(*labels)
    for name in ("batch_size_bucket", "queue_seconds", "compute_seconds", "requests_cancelled", "load_seconds",
                 "queued_requests", "version_memory_bytes", "model_state"):  # fmt: skip
        assert any(name in line for line in before), name
    metrics.set_model_state("gone_model", 7, None)
    after = _series_of(*labels)
    kept = ("layerserve_requests_total{", "layerserve_requests_created{")  # the request counter alone
    assert after and all(line.startswith(kept) for line in after), after
