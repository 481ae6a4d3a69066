"""Traces: a real server with `otlp_endpoint` pointed at a real OTLP receiver started here (tests/otlp_receiver.py),
checked span by span: one request's tree over HTTP and over gRPC (a server span continuing the caller's
`traceparent`, its decode, queue wait, engine compute and encode children, its trace id in the access log), one batch
of several requests (one compute span linked to every request's span), the feature cache's lookup, sampling
(ratio 0: only a caller's sampled traceparent is traced), the export queue's bound, OTLP/gRPC, a training job's
epochs (spans of the job's own process), and a Ray Serve replica's three doors."""

from __future__ import annotations

import asyncio
import logging
import secrets
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from prometheus_client import REGISTRY
from tritonclient.grpc import service_pb2

from layerserve.settings import Settings
from layerserve.span_export import ExportQueue
from layerserve.tracing import Tracing
from layerserve.transports.ray.grpc_ingress import CapturedCall
from tests.live_server import LiveServer, Replica, metric_sample, start_replica, start_server, wait_until
from tests.models import build_mlp, save_model
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan, start_grpc_receiver, start_http_receiver
from tests.transports.test_doors import Ingress

pytestmark = pytest.mark.slow

BATCH = 4  # requests of the batched model's one batch (its max_batch_size, with a long max_delay_ms)
REQUEST_CHILDREN = {"decode", "queue wait", "engine compute", "encode"}


@pytest.fixture(scope="module")
def traced(
    tmp_path_factory: pytest.TempPathFactory, engine_cache: Path, receiver: OtlpReceiver
) -> Iterator[LiveServer]:
    """A server exporting traces to the receiver with sampling ratio 0 (so only a caller's sampled traceparent is
    traced), its access log on and its gRPC door open, over `mlp`, `batched` (one batch of BATCH requests) and
    `cached` (the feature cache)."""
    repo = tmp_path_factory.mktemp("traced")
    for name in ("mlp", "batched", "cached"):
        save_model(build_mlp(1), repo / name / "1", "model.keras")
    (repo / "batched" / "config.yaml").write_text(f"max_batch_size: {BATCH}\nmax_delay_ms: 60000\n")
    (repo / "cached" / "config.yaml").write_text("cache: true\n")
    settings = Settings(
        model_repository=repo, engine_cache_dir=engine_cache, reload_interval_s=0, access_log=True,
        otlp_endpoint=receiver.endpoint, trace_sampling_ratio=0.0,
    )  # fmt: skip
    live = start_server(settings, grpc=True)
    yield live
    live.stop()


def _traceparent(sampled: bool = True) -> tuple[str, str, str]:
    """A caller's traceparent, its trace id and its span id."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}", trace_id, span_id


def _v2(x: np.ndarray) -> dict[str, object]:
    return {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}


def _rows(rows: int = 1, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, 10)).astype(np.float32)


def _only(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [span for span in spans if span.name == name]
    assert len(found) == 1, f"expected one {name!r} span, got {[s.name for s in spans]}"
    return found[0]


def _check_request_tree(spans: list[ReceivedSpan], server_name: str, caller_span: str) -> ReceivedSpan:
    """The server span is the caller's span's child; decode, queue wait, engine compute and encode its children,
    each within it. Returns the server span."""
    server = _only(spans, server_name)
    assert server.parent_id == caller_span and server.kind == "SPAN_KIND_SERVER" and server.service == "layerserve"
    for name in REQUEST_CHILDREN:
        child = _only(spans, name)
        assert child.parent_id == server.span_id, name
        assert server.start_ns <= child.start_ns <= child.end_ns <= server.end_ns, name
    decode, queued, compute, encode = (_only(spans, n) for n in ("decode", "queue wait", "engine compute", "encode"))
    assert decode.end_ns <= queued.start_ns <= queued.end_ns <= compute.start_ns and compute.end_ns <= encode.start_ns
    assert compute.links == [(server.trace_id, server.span_id)] and compute.attributes["layerserve.batch.size"] == 1
    return server


def test_http_request_span_tree_and_access_log(
    traced: LiveServer, receiver: OtlpReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    traceparent, trace_id, caller = _traceparent()
    with caplog.at_level(logging.INFO, logger="layerserve.access"):
        answer = httpx.post(
            f"{traced.url}/v2/models/mlp/infer", json=_v2(_rows()), headers={"traceparent": traceparent}
        )
        assert answer.status_code == 200, answer.text
        wait_until(lambda: any(trace_id in r.getMessage() for r in caplog.records), "the access log line")
    spans = receiver.wait_for(trace_id, {"POST v2.infer", *REQUEST_CHILDREN})
    server = _check_request_tree(spans, "POST v2.infer", caller)
    assert server.attributes["http.response.status_code"] == 200 and server.attributes["layerserve.model"] == "mlp"
    assert server.attributes["url.path"] == "/v2/models/mlp/infer" and not server.is_error
    (line,) = [r for r in caplog.records if trace_id in r.getMessage()]
    assert line.getMessage().endswith(f"trace_id={trace_id}") and line.__dict__["trace_id"] == trace_id
    assert receiver.requests[0] == "/v1/traces application/x-protobuf"


def test_grpc_request_span_tree(traced: LiveServer, receiver: OtlpReceiver) -> None:
    traceparent, trace_id, caller = _traceparent()
    x = _rows(seed=1)
    client = grpcclient.InferenceServerClient(traced.grpc_target)
    inputs = [grpcclient.InferInput("x", list(x.shape), "FP32")]
    inputs[0].set_data_from_numpy(x)
    client.infer("mlp", inputs, headers={"traceparent": traceparent})
    name = "inference.GRPCInferenceService/ModelInfer"
    server = _check_request_tree(receiver.wait_for(trace_id, {name, *REQUEST_CHILDREN}), name, caller)
    assert server.attributes["rpc.system"] == "grpc" and server.attributes["rpc.method"] == "ModelInfer"
    assert server.attributes["rpc.grpc.status_code"] == 0 and server.attributes["layerserve.version"] == "1"
    client.close()


def test_a_batch_is_one_compute_span_linked_to_every_request(traced: LiveServer, receiver: OtlpReceiver) -> None:
    callers = [_traceparent() for _ in range(BATCH)]

    def infer(index: int) -> int:
        body = _v2(_rows(seed=index))
        headers = {"traceparent": callers[index][0]}
        return httpx.post(f"{traced.url}/v2/models/batched/infer", json=body, headers=headers, timeout=120).status_code

    with ThreadPoolExecutor(BATCH) as pool:
        assert list(pool.map(infer, range(BATCH))) == [200] * BATCH
    servers = []
    for _, trace_id, caller in callers:
        spans = receiver.wait_for(trace_id, {"POST v2.infer", "decode", "queue wait", "encode"})
        server = _only(spans, "POST v2.infer")
        assert server.parent_id == caller and _only(spans, "queue wait").parent_id == server.span_id
        servers.append(server)
    wait_until(lambda: any(s.name == "engine compute" for _, t, _ in callers for s in receiver.trace(t)), "compute")
    computes = [s for _, t, _ in callers for s in receiver.trace(t) if s.name == "engine compute"]
    assert len(computes) == 1, "one model call for the batch"
    (compute,) = computes
    assert sorted(compute.links) == sorted((s.trace_id, s.span_id) for s in servers)
    assert compute.parent_id in {s.span_id for s in servers}
    assert (
        compute.attributes["layerserve.batch.size"] == BATCH
        and compute.attributes["layerserve.batch.requests"] == BATCH
    )
    assert compute.attributes["layerserve.model"] == "batched"


def test_the_feature_cache_lookup_is_a_span(traced: LiveServer, receiver: OtlpReceiver) -> None:
    x = _rows(2, seed=7)
    first, trace_id, _ = _traceparent()
    assert httpx.post(f"{traced.url}/v2/models/cached/infer", json=_v2(x), headers={"traceparent": first}).is_success
    lookup = _only(receiver.wait_for(trace_id, {"cache lookup", "engine compute"}), "cache lookup")
    assert lookup.attributes["layerserve.cache.rows"] == 2 and lookup.attributes["layerserve.cache.misses"] == 2
    again, trace_id, _ = _traceparent()
    assert httpx.post(f"{traced.url}/v2/models/cached/infer", json=_v2(x), headers={"traceparent": again}).is_success
    spans = receiver.wait_for(trace_id, {"cache lookup", "encode"})
    assert _only(spans, "cache lookup").attributes["layerserve.cache.misses"] == 0
    assert not {"queue wait", "engine compute"} & {s.name for s in spans}, "every row came from the cache"


def test_ratio_zero_traces_only_what_the_caller_sampled(
    traced: LiveServer, receiver: OtlpReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    unsampled, unsampled_id, _ = _traceparent(sampled=False)
    with caplog.at_level(logging.INFO, logger="layerserve.access"):
        assert httpx.post(f"{traced.url}/v2/models/mlp/infer", json=_v2(_rows())).is_success
        assert httpx.post(
            f"{traced.url}/v2/models/mlp/infer", json=_v2(_rows()), headers={"traceparent": unsampled}
        ).is_success
        sampled, sampled_id, _ = _traceparent()
        assert httpx.get(f"{traced.url}/v2/health/ready", headers={"traceparent": sampled}).is_success
        wait_until(lambda: any(sampled_id in r.getMessage() for r in caplog.records), "the access log line")
    ids = [r.__dict__["trace_id"] for r in caplog.records if r.name == "layerserve.access"][-3:]
    assert ids[1] == unsampled_id and len(ids[0]) == 32  # an untraced request still logs its trace id
    # Spans leave in the order they end: once the sampled request's came, the others' would have too.
    ready = _only(receiver.wait_for(sampled_id, {"GET v2.ready"}), "GET v2.ready")
    assert ready.attributes["http.response.status_code"] == 200
    assert receiver.trace(ids[0]) == [] and receiver.trace(unsampled_id) == []


class _Stuck(SpanExporter):  # type: ignore[misc]  # the SDK's base class
    """An exporter that holds its first batch until released: a collector that does not answer."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait(60)
        self.exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.release.set()


def _dropped() -> float:
    return REGISTRY.get_sample_value("layerserve_trace_spans_dropped_total", {"reason": "queue_full"}) or 0.0


def test_a_full_export_queue_drops_and_counts_while_the_collector_hangs() -> None:
    stuck = _Stuck()
    queue = ExportQueue(stuck, max_spans=3, batch_spans=1, delay_s=0.01)
    tracer = TracerProvider(shutdown_on_exit=False).get_tracer("test")
    spans = [tracer.start_span(f"span {index}") for index in range(10)]
    for span in spans:
        span.end()
    before = _dropped()
    queue.on_end(spans[0])
    assert stuck.entered.wait(30), "the export thread took the first span"
    for span in spans[1:]:
        queue.on_end(span)  # returns at once: the exporter still hangs, the queue holds 3, the rest are dropped
    assert stuck.exported == 0 and _dropped() - before == 6
    stuck.release.set()
    assert queue.force_flush(10_000) and stuck.exported == 4
    queue.shutdown()


def test_spans_a_collector_refuses_are_dropped_and_counted() -> None:
    refusing = start_http_receiver()
    refusing.refuses = True
    try:
        tracing = Tracing(refusing.endpoint, "http/protobuf", 1.0)
        before = REGISTRY.get_sample_value("layerserve_trace_spans_dropped_total", {"reason": "export_failed"}) or 0
        request = tracing.begin("POST v2.infer", None, {})
        request.child("decode").end()
        request.server.end()
        assert tracing.queue.force_flush(30_000)
        after = REGISTRY.get_sample_value("layerserve_trace_spans_dropped_total", {"reason": "export_failed"})
        assert after == before + 2 and refusing.spans == []
        tracing.close()
    finally:
        refusing.stop()


def test_off_by_default_no_tracer_and_no_sdk(tmp_path: Path) -> None:
    check = (
        "import sys\n"
        "from layerserve.server import Server\n"
        "from layerserve.settings import Settings\n"
        f"server = Server(Settings(model_repository={str(tmp_path)!r}, grpc_port=0))\n"
        "assert server.tracing is None and server.policy.tracing is None\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry.sdk')], 'the SDK was imported'\n"
    )
    subprocess.run([sys.executable, "-c", check], check=True, timeout=120)


def test_otlp_grpc_export() -> None:
    grpc_receiver = start_grpc_receiver()
    try:
        tracing = Tracing(grpc_receiver.endpoint, "grpc", 1.0)
        request = tracing.begin("POST v2.infer", None, {"url.path": "/v2/models/m/infer"})
        request.child("decode").end()
        request.server.end()
        tracing.close()
        spans = grpc_receiver.wait_for(request.trace_id, {"POST v2.infer", "decode"})
        assert _only(spans, "decode").parent_id == _only(spans, "POST v2.infer").span_id
        assert grpc_receiver.requests == ["grpc Export"]
    finally:
        grpc_receiver.stop()


def test_a_collector_that_keeps_up_drops_nothing(traced: LiveServer, receiver: OtlpReceiver) -> None:
    def dropped() -> float:
        return metric_sample(traced.url, "layerserve_trace_spans_dropped_total")

    before = dropped()  # (the process's counter: the other tests' queues count in it too)
    traceparent, trace_id, _ = _traceparent()
    headers = {"traceparent": traceparent}
    assert httpx.post(f"{traced.url}/v2/models/mlp/infer", json=_v2(_rows()), headers=headers).is_success
    receiver.wait_for(trace_id, {"POST v2.infer", *REQUEST_CHILDREN})
    assert dropped() == before


def test_training_job_epochs_are_spans_of_the_job(traced: LiveServer, receiver: OtlpReceiver) -> None:
    traceparent, trace_id, _ = _traceparent()
    texts = [f"{word} film number {i}" for i in range(30) for word in ("great", "awful")]
    labels = ["pos", "neg"] * 30
    body = {"dataset": {"texts": texts, "labels": labels}, "params": {"epochs": 2, "patience": 5}}
    started = httpx.post(f"{traced.url}/v2/models/reviews/train", json=body, headers={"traceparent": traceparent})
    assert started.status_code == 202, started.text
    job_url = f"{traced.url}/v2/jobs/{started.json()['job_id']}"
    wait_until(lambda: httpx.get(job_url).json()["state"] in {"succeeded", "failed"}, "the job ends", 600)
    job = httpx.get(job_url).json()
    assert job["state"] == "succeeded", job["error"]
    spans = receiver.wait_for(trace_id, {"POST job.train", "training job", "epoch"})
    request, training = _only(spans, "POST job.train"), _only(spans, "training job")
    assert training.parent_id == request.span_id and training.attributes["layerserve.model"] == "reviews"
    epochs = sorted((s for s in spans if s.name == "epoch"), key=lambda s: s.attributes["layerserve.epoch"])
    assert [s.attributes["layerserve.epoch"] for s in epochs] == list(range(1, job["progress"]["epochs_run"] + 1))
    for epoch, recorded in zip(epochs, job["history"], strict=True):
        assert epoch.parent_id == training.span_id and training.start_ns <= epoch.start_ns <= epoch.end_ns
        assert epoch.attributes["layerserve.loss"] == pytest.approx(recorded["loss"])


@pytest.fixture(scope="module")
def traced_replica(traced: LiveServer) -> Iterator[Replica]:
    """A Ray Serve replica of the traced server's settings, hosted here as Ray hosts it (tests/live_server.py)."""
    hosted = start_replica(traced.server.settings)
    yield hosted
    hosted.stop()


@pytest.mark.parametrize("door", ["ray-direct-port", "ray-http-ingress", "ray-grpc-ingress"])
def test_a_ray_replicas_doors_continue_the_trace(door: str, traced_replica: Replica, receiver: OtlpReceiver) -> None:
    traceparent, trace_id, caller = _traceparent()
    x = _rows(seed=3)
    if door == "ray-grpc-ingress":
        request = service_pb2.ModelInferRequest(model_name="mlp")
        request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
        request.raw_input_contents.append(x.tobytes())
        context = CapturedCall((("traceparent", traceparent),))  # the metadata Ray's gRPC proxy passes on
        ingress = Ingress(traced_replica.server, "node/replica")
        asyncio.run_coroutine_threadsafe(ingress.ModelInfer(request, context), traced_replica.loop).result(60)
        name = "inference.GRPCInferenceService/ModelInfer"
    else:
        url = traced_replica.direct_url if door == "ray-direct-port" else traced_replica.url
        answer = httpx.post(f"{url}/v2/models/mlp/infer", json=_v2(x), headers={"traceparent": traceparent})
        assert answer.status_code == 200, answer.text
        name = "POST v2.infer"
    _check_request_tree(receiver.wait_for(trace_id, {name, *REQUEST_CHILDREN}), name, caller)
