"""Traces (OpenTelemetry): every request on every door gets a server span that continues its caller's W3C
`traceparent`, with child spans for its decode, cache lookup, queue wait, the engine's compute (one span per batch,
linked to every request in it) and encode; a training job's epochs are spans of the job's own process.

Off (no `otlp_endpoint`) there is no tracer: the request policy starts no span, `CURRENT` stays None, and a span site
costs one ContextVar read and a shared no-op context manager (no allocation). The policy sets `CURRENT` to the
request's trace while its handler runs, when the request is sampled; everything below a door reads it from there.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Tracer

    from layerserve.settings import Settings
    from layerserve.span_export import ExportQueue

SERVICE_NAME = "layerserve"
_PROPAGATOR = TraceContextTextMapPropagator()

CURRENT: ContextVar[RequestTrace | None] = ContextVar("layerserve_trace", default=None)


class _NoSpan:
    """The span site's context manager when the request is not traced: does nothing, gives None."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        return None


NO_SPAN = _NoSpan()


def span(name: str, attributes: Mapping[str, Any] | None = None) -> AbstractContextManager[Span | None]:
    """A child span of the request being served, as a context manager that ends it (and records an error that
    leaves it); NO_SPAN when the request is not traced."""
    current = CURRENT.get()
    return NO_SPAN if current is None else current.child(name, attributes=attributes)


def epoch_ns(perf_counter: float) -> int:
    """A `time.perf_counter()` reading as nanoseconds since the epoch (a span's clock)."""
    return time.time_ns() - int((time.perf_counter() - perf_counter) * 1e9)


class RequestTrace:
    """One request's trace: its server span, the context its child spans start in, and where they go."""

    __slots__ = ("context", "server", "tracing")

    def __init__(self, server: Span, tracing: Tracing) -> None:
        self.server, self.tracing = server, tracing
        self.context = trace.set_span_in_context(server)

    @property
    def is_recording(self) -> bool:
        """Whether the request is sampled (its spans are kept and exported)."""
        return self.server.is_recording()

    @property
    def trace_id(self) -> str:
        """The trace's id, 32 hex digits (also in the access log line)."""
        return trace.format_trace_id(self.server.get_span_context().trace_id)

    def child(self, name: str, start_ns: int | None = None, attributes: Mapping[str, Any] | None = None) -> Span:
        """A new span under the server span."""
        return self.tracing.tracer.start_span(name, self.context, attributes=attributes, start_time=start_ns)

    def traceparent(self) -> str:
        """The W3C `traceparent` of the server span, for a process that continues the trace (a training job)."""
        context = self.server.get_span_context()
        return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def trace_batch(traced: list[tuple[RequestTrace, float]], started: float, rows: int, labels: tuple[str, str]) -> Span:
    """The traced requests of a batch leaving the queue at `started` (perf_counter): a `queue wait` span for each
    (since its `enqueued`), and the batch's `engine compute` span (ended by the caller): a child of the first one,
    linked to every one's server span, with the batch's size."""
    started_ns = epoch_ns(started)
    for request, enqueued in traced:
        request.child("queue wait", epoch_ns(enqueued)).end(started_ns)
    first = traced[0][0]
    attributes: dict[str, Any] = {
        "layerserve.model": labels[0], "layerserve.version": labels[1], "layerserve.batch.size": rows,
        "layerserve.batch.requests": len(traced),
    }  # fmt: skip
    links = [Link(request.server.get_span_context()) for request, _ in traced]
    return first.tracing.tracer.start_span("engine compute", first.context, attributes=attributes, links=links,
                                           start_time=started_ns)  # fmt: skip


class Tracing:
    """A server process's tracer: parent-based sampling (a caller's sampled `traceparent` is followed, a request
    without one is sampled at `trace_sampling_ratio`) and an ExportQueue to the collector at `otlp_endpoint`."""

    def __init__(self, endpoint: str, protocol: str, ratio: float, root_sampled: bool = True) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased

        from layerserve import __version__
        from layerserve.span_export import ExportQueue, otlp_exporter

        self.endpoint, self.protocol = endpoint, protocol
        root = TraceIdRatioBased(ratio) if root_sampled else ALWAYS_OFF
        resource = Resource.create({"service.name": SERVICE_NAME, "service.version": __version__,
                                    "process.pid": os.getpid()})  # fmt: skip
        self._provider = TracerProvider(ParentBased(root), resource, shutdown_on_exit=False)
        self.queue: ExportQueue = ExportQueue(otlp_exporter(endpoint, protocol))
        self._provider.add_span_processor(self.queue)
        self.tracer: Tracer = self._provider.get_tracer("layerserve", __version__)

    @classmethod
    def of(cls, settings: Settings) -> Tracing | None:
        """The settings' tracer; None without `otlp_endpoint` (traces are off)."""
        if not settings.otlp_endpoint:
            return None
        return cls(settings.otlp_endpoint, settings.otlp_protocol, settings.trace_sampling_ratio)

    def begin(self, name: str, traceparent: bytes | str | None, attributes: dict[str, Any]) -> RequestTrace:
        """A request's server span, continuing `traceparent` when it is a valid one."""
        parent: Context | None = None
        if traceparent:
            value = traceparent.decode("latin-1") if isinstance(traceparent, bytes) else traceparent
            parent = _PROPAGATOR.extract({"traceparent": value})
        return RequestTrace(self.tracer.start_span(name, parent, SpanKind.SERVER, attributes), self)

    def job_trace(self, request: RequestTrace) -> dict[str, str]:
        """What a training job's process needs to continue `request`'s trace (see `JobTracer`)."""
        return {"traceparent": request.traceparent(), "endpoint": self.endpoint, "protocol": self.protocol}

    def close(self) -> None:
        """Send the spans still queued (a few seconds at most), then stop exporting."""
        self._provider.shutdown()


def end_request(request: RequestTrace, name: str, attributes: dict[str, Any], is_error: bool) -> None:
    """End a request's server span with its final name, its outcome's attributes and, for a server error, an
    error status."""
    server = request.server
    if server.is_recording():
        server.update_name(name)
        server.set_attributes(attributes)
        if is_error:
            server.set_status(Status(StatusCode.ERROR))
    server.end()


class JobTracer:
    """A training job's process's own tracer: continues the trace of the request that submitted the job (given as
    `Tracing.job_trace` made it) with a `training job` span and an `epoch` span per epoch under it."""

    def __init__(self, spec: Mapping[str, str], attributes: dict[str, Any]) -> None:
        self._tracing = Tracing(spec["endpoint"], spec["protocol"], 0.0, root_sampled=False)
        parent = _PROPAGATOR.extract({"traceparent": spec["traceparent"]})
        self._job = self._tracing.tracer.start_span("training job", parent, attributes=attributes)
        self._context = trace.set_span_in_context(self._job)
        self._epoch: Span | None = None

    def progress(self, progress: Mapping[str, Any]) -> None:
        """A progress report of the recipe: step 0 begins an epoch's span; the epoch's metrics end it."""
        if progress.get("step") == 0 and self._epoch is None:
            number = int(progress["epoch"])
            attributes = {"layerserve.epoch": number, "layerserve.epochs": int(progress["epochs"])}
            self._epoch = self._tracing.tracer.start_span("epoch", self._context, attributes=attributes)
        elif "loss" in progress and self._epoch is not None:
            numbers = {k: v for k, v in progress.items() if isinstance(v, float)}
            self._epoch.set_attributes({f"layerserve.{key}": value for key, value in numbers.items()})
            self._epoch.end()
            self._epoch = None

    def close(self, error: str = "") -> None:
        """End the job's span (an error status with `error`) and send every span before the process exits."""
        if self._epoch is not None:
            self._epoch.end()
        if error:
            self._job.set_status(Status(StatusCode.ERROR, error))
        self._job.end()
        self._tracing.close()
