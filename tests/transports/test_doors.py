"""The request policy, the same cases against every door, each outcome in that door's terms: a missing token, a
wrong one, a body over the limit, a deadline passed in the queue, a client gone before its request was computed,
and a fault injected in the data plane.

The doors: the HTTP fast path (a model's request on the door's own connection), HTTP through the ASGI app (the same
request, with an answer the app compresses), the gRPC door; and a Ray Serve replica's three, hosted in this process
as a replica hosts them: its direct port (the replica's own HTTP door), its app served by uvicorn with its lifespan
(Ray's HTTP ingress), and its gRPC methods over Ray's context (Ray's gRPC ingress). The cluster itself:
tests/transports/ray/test_deployment.py.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import numpy as np
import orjson
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from layerserve.dataplane import VersionView
from layerserve.server import Server
from layerserve.transports.policy import GRPC_CODES
from layerserve.transports.ray.grpc_ingress import CapturedCall, GrpcMethods, RpcAbortedError
from tests.conftest import ADMIN_TOKEN, API_TOKEN, SLOW_ROWS
from tests.live_server import LiveServer, Replica, metric_sample, start_replica, wait_until

pytestmark = pytest.mark.slow

STATUS_OF_CODE = {name: status for status, name in GRPC_CODES.items() if status not in (415, 422)}
FAULT_ID = "inject-fault"
ADMIN = f"Bearer {ADMIN_TOKEN}"


@dataclass
class Outcome:
    """How a request ended, as an HTTP status (a gRPC code mapped to the status it stands for) and a message."""

    status: int
    message: str


def _rows(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, 16)).astype(np.float32)


def _v2_body(x: np.ndarray, request_id: str | None, timeout_ms: int | None) -> tuple[bytes, dict[str, str]]:
    """A V2 binary request (its header's length in its own header) of the slow model's input."""
    tensor = {"name": "x", "shape": list(x.shape), "datatype": "FP32", "parameters": {"binary_data_size": x.nbytes}}
    header: dict[str, Any] = {
        "inputs": [tensor], "outputs": [{"name": "d5", "parameters": {"classification": 1}}],  # a small answer
    }  # fmt: skip
    if request_id:
        header["id"] = request_id
    if timeout_ms:
        header["parameters"] = {"timeout_ms": timeout_ms}
    encoded = orjson.dumps(header)
    return encoded + x.tobytes(), {"inference-header-content-length": str(len(encoded))}


def _grpc_request(x: np.ndarray, request_id: str | None, timeout_ms: int | None) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="slow", id=request_id or "")
    request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    request.outputs.add(name="d5").parameters["classification"].int64_param = 1  # a small answer, even for many rows
    if timeout_ms:
        request.parameters["timeout_ms"].int64_param = timeout_ms
    return request


@dataclass
class HttpDoor:
    """An HTTP door at `url` (`compressed`: the client accepts gzip, so the answer goes through the ASGI app)."""

    name: str
    url: str
    metrics_url: str
    compressed: bool = False
    route: str = "v2.infer"
    closed_status: str = "499"

    def _headers(self, token: str | None) -> dict[str, str]:
        headers = {"accept-encoding": "gzip" if self.compressed else "identity"}
        headers["content-type"] = "application/octet-stream"
        if token is not None:
            headers["authorization"] = token
        return headers

    def infer(
        self, x: np.ndarray, token: str | None, request_id: str | None = None, timeout_ms: int | None = None
    ) -> Outcome:
        """One V2 infer of the slow model; its outcome."""
        content, length = _v2_body(x, request_id, timeout_ms)
        answer = httpx.post(f"{self.url}/v2/models/slow/infer", content=content,
                            headers={**self._headers(token), **length}, timeout=120)  # fmt: skip
        return Outcome(answer.status_code, answer.json().get("error", "") if answer.status_code != 200 else "")

    def leave_once_queued(self, x: np.ndarray, token: str, queued: Callable[[], bool]) -> None:
        """Send a request, wait until it is queued, leave (close the connection)."""
        body, length = _v2_body(x, None, None)
        headers = {**self._headers(token), **length}
        head = ["POST /v2/models/slow/infer HTTP/1.1", f"Host: {self.url.removeprefix('http://')}",
                f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]  # fmt: skip
        host, port = self.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as client:
            client.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
            wait_until(queued, f"{self.name}: the request waits in the queue")


@dataclass
class GrpcDoor:
    """The gRPC door at `target`."""

    name: str
    target: str
    metrics_url: str
    route: str = "grpc.ModelInfer"
    closed_status: str = "CANCELLED"

    def infer(
        self, x: np.ndarray, token: str | None, request_id: str | None = None, timeout_ms: int | None = None
    ) -> Outcome:
        """One ModelInfer of the slow model; its outcome."""
        metadata = () if token is None else (("authorization", token),)
        with grpc.insecure_channel(self.target, [("grpc.max_send_message_length", 8 << 20)]) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            try:
                stub.ModelInfer(_grpc_request(x, request_id, timeout_ms), metadata=metadata, timeout=120)
            except grpc.RpcError as error:
                return Outcome(STATUS_OF_CODE[error.code().name], error.details() or "")
        return Outcome(200, "")

    def leave_once_queued(self, x: np.ndarray, token: str, queued: Callable[[], bool]) -> None:
        """Start a call, wait until it is queued, cancel it."""
        with grpc.insecure_channel(self.target) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            call = stub.ModelInfer.future(_grpc_request(x, None, None), metadata=(("authorization", token),))
            wait_until(queued, f"{self.name}: the call waits in the queue")
            call.cancel()


class Ingress(GrpcMethods):
    """A replica's ingress methods, as Ray Serve's deployment mixes them in."""

    def __init__(self, server: Server, identity: str) -> None:
        self._servicer, self._grpc_identity = server.servicer, identity

    def _grpc_servicer(self) -> Any:
        return self._servicer


@dataclass
class RayGrpcIngress:
    """A replica's gRPC methods on the replica's event loop, as Ray Serve's gRPC proxy calls them."""

    name: str
    ingress: Ingress
    loop: asyncio.AbstractEventLoop
    metrics_url: str
    route: str = "grpc.ModelInfer"
    closed_status: str = "CANCELLED"
    running: list[Future[Any]] = field(default_factory=list)

    def _call(self, request: Any, token: str | None) -> tuple[Future[Any], CapturedCall]:
        # What Ray's gRPC proxy gives an ingress method (RayServegRPCContext): the metadata in, the status out, as
        # the ingress's own stand-in for it gives them.
        context = CapturedCall(() if token is None else (("authorization", token),))
        return asyncio.run_coroutine_threadsafe(self.ingress.ModelInfer(request, context), self.loop), context

    def infer(
        self, x: np.ndarray, token: str | None, request_id: str | None = None, timeout_ms: int | None = None
    ) -> Outcome:
        """One ModelInfer of the slow model; its outcome."""
        call, context = self._call(_grpc_request(x, request_id, timeout_ms), token)
        try:
            call.result(timeout=120)
        except RpcAbortedError:
            assert context.code is not None
            return Outcome(STATUS_OF_CODE[context.code.name], context.details)
        return Outcome(200, "")

    def leave_once_queued(self, x: np.ndarray, token: str, queued: Callable[[], bool]) -> None:
        """Start a call, wait until it is queued, cancel it (as Ray does when its client cancels)."""
        call, _ = self._call(_grpc_request(x, None, None), token)
        wait_until(queued, f"{self.name}: the call waits in the queue")
        call.cancel()


@pytest.fixture(scope="module")
def replica(guarded_server: LiveServer) -> Iterator[Replica]:
    hosted = start_replica(guarded_server.server.settings)
    yield hosted
    hosted.stop()


DOORS = ["http", "http-asgi", "grpc", "ray-direct-port", "ray-http-ingress", "ray-grpc-ingress"]


@pytest.fixture(params=DOORS)
def door(request: pytest.FixtureRequest, guarded_server: LiveServer) -> Any:
    name = request.param
    if name == "http":
        return HttpDoor(name, guarded_server.url, guarded_server.url)
    if name == "http-asgi":
        return HttpDoor(name, guarded_server.url, guarded_server.url, compressed=True)
    if name == "grpc":
        return GrpcDoor(name, guarded_server.grpc_target, guarded_server.url)
    ray: Replica = request.getfixturevalue("replica")
    if name == "ray-direct-port":
        return HttpDoor(name, ray.direct_url, ray.url)
    if name == "ray-http-ingress":
        return HttpDoor(name, ray.url, ray.url)
    return RayGrpcIngress(name, Ingress(ray.server, "node/replica"), ray.loop, ray.url)


API = f"Bearer {API_TOKEN}"


def test_a_missing_token_is_refused(door: Any) -> None:
    outcome = door.infer(_rows(1), None)
    assert outcome.status == 401 and "needs an API token" in outcome.message


def test_a_wrong_token_is_refused(door: Any) -> None:
    outcome = door.infer(_rows(1), "Bearer not-a-token")
    assert outcome.status == 403 and "not an API token" in outcome.message


def test_a_body_over_the_limit_is_refused_and_the_door_goes_on(door: Any) -> None:
    outcome = door.infer(_rows(20_000), API)  # 1.28 MB of floats: over the guarded server's 1 MB
    assert outcome.status == 413, outcome
    assert door.infer(_rows(2), API).status == 200


def _metric(door: Any, name: str, **labels: str) -> float:
    return metric_sample(door.metrics_url, name, {"Authorization": API}, **labels)


def _stats(door: Any) -> tuple[int, int]:
    stats = httpx.get(f"{door.metrics_url}/v2/models/slow/versions/1/stats", headers={"Authorization": API})
    found = stats.json()["model_stats"][0]
    return found["execution_count"], found["inference_count"]


def _queued(door: Any) -> int:
    answer = httpx.get(f"{door.metrics_url}/v2/models/slow", headers={"Authorization": API}).json()
    return int(answer["batching"]["queued"])


def test_a_deadline_passed_in_the_queue_and_a_client_gone_are_never_computed(door: Any) -> None:
    def idle() -> bool:
        return _metric(door, "layerserve_compute_seconds_count", model="slow") == _metric(
            door, "layerserve_batch_size_count", model="slow"
        )

    wait_until(idle, "the slow model is idle")
    executions, rows = _stats(door)
    cancelled = _metric(door, "layerserve_requests_cancelled_total", model="slow")
    closed = _metric(door, "layerserve_requests_total", route=door.route, status=door.closed_status, model="slow")
    batches = _metric(door, "layerserve_batch_size_count", model="slow")
    answers: list[Outcome] = []
    busy = threading.Thread(target=lambda: answers.append(door.infer(_rows(3 * SLOW_ROWS), API)))
    busy.start()  # keeps the slow model's one lane busy for seconds (longer than the two requests below take)
    wait_until(lambda: _metric(door, "layerserve_batch_size_count", model="slow") > batches, "the slow one computes")
    late = door.infer(_rows(1), API, timeout_ms=100)
    assert late.status == 504, late
    waiting = _queued(door)  # (the late one may still count until the batcher takes its place)
    door.leave_once_queued(_rows(1), API, lambda: _queued(door) > waiting)
    wait_until(
        lambda: (
            _metric(door, "layerserve_requests_total", route=door.route, status=door.closed_status, model="slow")
            > closed
        ),
        f"{door.name}: the request of the client gone is recorded as {door.closed_status}",
    )
    busy.join(120)
    assert answers and answers[0].status == 200, answers
    assert _stats(door) == (executions + 1, rows + 3 * SLOW_ROWS)  # neither the late nor the left request ran
    assert _metric(door, "layerserve_requests_cancelled_total", model="slow") >= cancelled + 1


def test_an_injected_fault_is_one_logged_500_and_the_door_goes_on(
    door: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    infer = VersionView.infer

    async def faulty(self: VersionView, request: Any) -> Any:
        if request.id == FAULT_ID:
            raise RuntimeError("an injected fault with engine internals")
        return await infer(self, request)

    monkeypatch.setattr(VersionView, "infer", faulty)
    with caplog.at_level(logging.ERROR, "layerserve.transports"):
        outcome = door.infer(_rows(1), API, request_id=FAULT_ID)
    assert outcome.status == 500 and outcome.message.startswith("internal error "), outcome
    assert "engine internals" not in outcome.message
    error_id = outcome.message.removeprefix("internal error ")
    logged = [r for r in caplog.records if r.name.startswith("layerserve.transports") and error_id in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert door.infer(_rows(1), API).status == 200  # the next request is answered


def test_admin_routes_need_the_admin_token_on_every_http_door(guarded_server: LiveServer, replica: Replica) -> None:
    for url in (guarded_server.url, replica.url, replica.direct_url):
        refused = httpx.post(f"{url}/v2/repository/index", headers={"Authorization": API})
        assert refused.status_code == 403 and "not an admin token" in refused.json()["error"]
        assert httpx.post(f"{url}/v2/repository/index", headers={"Authorization": ADMIN}).status_code == 200
