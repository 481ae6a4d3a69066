"""Metrics of versions that come and go: a version's own series leave /metrics with the last registry holding it."""

from __future__ import annotations

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
