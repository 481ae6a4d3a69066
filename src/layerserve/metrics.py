"""Every Prometheus metric layerserve exports (module-level metric objects, per STYLE.md rule 5)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

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

_CACHE_LABELS = ("model", "backend")
CACHE_HITS = Counter("layerserve_cache_hits", "Output rows served from the feature cache.", _CACHE_LABELS)
CACHE_MISSES = Counter("layerserve_cache_misses", "Output rows computed because the cache had none.", _CACHE_LABELS)
CACHE_ERRORS = Counter(
    "layerserve_cache_errors", "Feature cache failures (backend errors, malformed values).", _CACHE_LABELS
)
CACHE_BYTES = Counter("layerserve_cache_stored_bytes", "Bytes written to the feature cache.", _CACHE_LABELS)
