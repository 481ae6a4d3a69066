"""RequestRecorder: every door's request metrics and access log line, by model, version, route and status."""

from __future__ import annotations

import logging
from typing import Any

from layerserve.metrics import REQUEST_SECONDS, REQUESTS, SERVED_BY, count_in_flight

access_log = logging.getLogger("layerserve.access")


class RequestRecorder:
    """Counts and times answered requests (`layerserve_requests_total`, `layerserve_request_seconds`) and writes their
    access log line (when `log_requests`); the model and version are those the request was served by (SERVED_BY).

    Between `start` and `record` a request is in flight: counted in a plain int of its door (one event loop's), which
    `sample_process` sums into `layerserve_requests_in_flight` when the metrics are read and every second, instead
    of two locked gauge updates per request (docs/benchmarks.md, "Batching").
    """

    def __init__(self, log_requests: bool) -> None:
        self._log_requests = log_requests
        # Metric children by labels: `.labels()` costs microseconds on every request otherwise.
        self._children: dict[tuple[str, str, str, int | str], tuple[Any, Any]] = {}
        self.in_flight = 0
        count_in_flight(self)

    def start(self) -> None:
        """A request begins: in flight until its `record`, and served by no model yet."""
        self.in_flight += 1
        SERVED_BY.set(None)

    def record(
        self, method: str, path: str, route: str, status: int | str, seconds: float, trace_id: str | None = None
    ) -> None:
        """One answered request (begun with `start`): `status` is an HTTP status code or a gRPC status name;
        `trace_id` (when traces are on) ends its access log line."""
        self.in_flight -= 1
        served = SERVED_BY.get()
        model, version = (served[0], str(served[1])) if served else ("", "")
        key = (model, version, route, status)
        children = self._children.get(key)
        if children is None:
            children = REQUESTS.labels(model, version, route, str(status)), REQUEST_SECONDS.labels(model, route)
            self._children[key] = children
        children[0].inc()
        children[1].observe(seconds)
        if self._log_requests:
            extra = {"route": route, "model": model, "version": version, "status": status, "method": method,
                     "path": path, "latency_ms": round(seconds * 1000, 3)}  # fmt: skip
            line = "%s %s route=%s model=%s version=%s status=%s %.2fms"
            if trace_id is not None:
                line, extra["trace_id"] = line + " trace_id=%s", trace_id
            access_log.info(
                line, method, path, route, model or "-", version or "-", status, seconds * 1000,
                *(() if trace_id is None else (trace_id,)), extra=extra,
            )  # fmt: skip
