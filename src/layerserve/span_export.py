"""ExportQueue: finished trace spans to the OpenTelemetry collector from a thread of their own, so that exporting
never blocks the event loop nor fails a request; and the OTLP exporter the settings ask for."""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import TYPE_CHECKING

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from layerserve.metrics import TRACE_SPANS_DROPPED

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import Span

log = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"  # where OTLP/HTTP posts spans on a collector


def otlp_exporter(endpoint: str, protocol: str) -> SpanExporter:
    """The OTLP exporter of `endpoint`: OTLP/HTTP with protobuf bodies posted to `/v1/traces` on it (unless the URL
    names that path already), or OTLP/gRPC (`protocol` "grpc"; plain text for http://, TLS for https://)."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    url = endpoint if endpoint.rstrip("/").endswith(TRACES_PATH) else endpoint.rstrip("/") + TRACES_PATH
    return HttpExporter(endpoint=url)


class ExportQueue(SpanProcessor):
    """Holds sampled finished spans (at most `max_spans`: a span that finds the queue full is dropped, counted in
    `layerserve_trace_spans_dropped_total` and logged once) and sends them in batches of `batch_spans` from a
    thread, every `delay_s` or as soon as a batch is full. A collector that is down costs that thread its retries;
    its spans are dropped and counted."""

    def __init__(
        self, exporter: SpanExporter, max_spans: int = 4096, batch_spans: int = 512, delay_s: float = 1.0
    ) -> None:
        self._exporter = exporter
        self._max_spans, self._batch_spans, self._delay_s = max_spans, batch_spans, delay_s
        self._spans: deque[ReadableSpan] = deque()
        self._wake = threading.Event()
        self._flushed = threading.Condition()
        self._sent = 0  # spans taken from the queue, exported or not
        self._is_stopping = False
        self._warned = False
        self._thread = threading.Thread(target=self._send_until_stopped, name="trace-export", daemon=True)
        self._thread.start()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        """Nothing: spans are sent once they end."""

    def on_end(self, span: ReadableSpan) -> None:
        """Queue a finished span (a sampled one), or drop it when the queue is full."""
        context = span.context
        if context is None or not context.trace_flags.sampled:
            return
        if len(self._spans) >= self._max_spans or self._is_stopping:
            TRACE_SPANS_DROPPED.labels("queue_full").inc()
            if not self._warned:
                self._warned = True
                log.warning("traces: the export queue is full (%d spans); spans are dropped", self._max_spans)
            return
        self._spans.append(span)
        if len(self._spans) >= self._batch_spans:
            self._wake.set()

    def _send_until_stopped(self) -> None:
        while not self._is_stopping:
            self._wake.wait(self._delay_s)
            self._wake.clear()
            self._send_queued()
        self._send_queued()

    def _send_queued(self) -> None:
        while self._spans:
            batch = [self._spans.popleft() for _ in range(min(self._batch_spans, len(self._spans)))]
            try:
                result = self._exporter.export(batch)
            except Exception:  # a fail-soft boundary: an exporter's bug never reaches the server
                log.exception("traces: exporting %d spans failed", len(batch))
                result = SpanExportResult.FAILURE
            if result is not SpanExportResult.SUCCESS:
                TRACE_SPANS_DROPPED.labels("export_failed").inc(len(batch))
            with self._flushed:
                self._sent += len(batch)
                self._flushed.notify_all()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Send what is queued now; whether it was sent within the timeout."""
        with self._flushed:
            target = self._sent + len(self._spans)
            self._wake.set()
            return self._flushed.wait_for(lambda: self._sent >= target, timeout_millis / 1000)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (for at most `timeout_s`), then stop the thread and the exporter."""
        self._is_stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        self._exporter.shutdown()
