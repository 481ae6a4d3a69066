"""A real OTLP trace receiver for the tests, built on the official `opentelemetry-proto` messages (the OpenTelemetry
Collector is a Go binary no registry here ships): OTLP/HTTP (`POST /v1/traces`, protobuf bodies) on a thread, or
OTLP/gRPC (`opentelemetry.proto.collector.trace.v1.TraceService/Export`) on grpcio's server."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanMessage

from tests.live_server import free_port, wait_until


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the collector got it: ids in hex (`parent_id` "" for a root), its kind's name, attributes,
    links as (trace id, span id) and the resource's `service.name`."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: str
    attributes: dict[str, Any]
    links: list[tuple[str, str]]
    service: str
    start_ns: int
    end_ns: int
    is_error: bool


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind in ("string_value", "bool_value", "int_value", "double_value") else None


def decode_spans(body: bytes) -> list[ReceivedSpan]:
    """The spans of an ExportTraceServiceRequest."""
    request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        span.name,
                        span.trace_id.hex(),
                        span.span_id.hex(),
                        span.parent_span_id.hex(),
                        SpanMessage.SpanKind.Name(span.kind),
                        {a.key: _value(a.value) for a in span.attributes},
                        [(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                        str(resource.get("service.name")),
                        span.start_time_unix_nano,
                        span.end_time_unix_nano,
                        span.status.code == span.status.STATUS_CODE_ERROR,
                    )
                )
    return spans


@dataclass
class OtlpReceiver:
    """Collected spans, and the address exporters send them to."""

    endpoint: str
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)  # each request's path and content type
    refuses: bool = False  # answer every export 400 (a collector that refuses them), keeping nothing
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: Any = None

    def keep(self, body: bytes, what: str) -> None:
        """Decode and keep one export request's spans."""
        spans = decode_spans(body)
        with self._lock:
            self.requests.append(what)
            self.spans.extend(spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        """The spans received so far of one trace."""
        with self._lock:
            return [span for span in self.spans if span.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 60) -> list[ReceivedSpan]:
        """The spans of a trace once spans of each of these names came."""
        wait_until(lambda: names <= {s.name for s in self.trace(trace_id)}, f"spans {names} of {trace_id}", timeout_s)
        return self.trace(trace_id)

    def stop(self) -> None:
        """Stop listening."""
        self._stop()


class _Handler(BaseHTTPRequestHandler):
    receiver: OtlpReceiver
    protocol_version = "HTTP/1.1"  # keep-alive, as a collector does: the exporter's connection is reused

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        if self.path != "/v1/traces" or self.receiver.refuses:
            self.send_error(404 if self.path != "/v1/traces" else 400)
            return
        self.receiver.keep(body, f"{self.path} {self.headers['content-type']}")
        answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


def start_http_receiver() -> OtlpReceiver:
    """An OTLP/HTTP receiver on 127.0.0.1 (its `endpoint` is the collector's base URL)."""
    handler = type("Handler", (_Handler,), {})  # a class of its own: it knows its own receiver
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    receiver = OtlpReceiver(f"http://127.0.0.1:{server.server_address[1]}")
    handler.receiver = receiver
    threading.Thread(target=server.serve_forever, name="otlp-http", daemon=True).start()

    def stop() -> None:
        server.shutdown()
        server.server_close()

    receiver._stop = stop
    return receiver


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]  # generated code, untyped
    def __init__(self, receiver: OtlpReceiver) -> None:
        self._receiver = receiver

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the RPC's name
        self._receiver.keep(request.SerializeToString(), "grpc Export")
        return trace_service_pb2.ExportTraceServiceResponse()


def start_grpc_receiver() -> OtlpReceiver:
    """An OTLP/gRPC receiver on 127.0.0.1 (plain text; its `endpoint` is http://127.0.0.1:PORT)."""
    port = free_port()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    receiver = OtlpReceiver(f"http://127.0.0.1:{port}")
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(receiver), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    receiver._stop = lambda: server.stop(None)
    return receiver
