"""A client that disconnects while its HTTP request waits in a queue gets that request dropped, never computed."""

from __future__ import annotations

import socket
import threading
from typing import Any

import httpx
import numpy as np
import orjson

from tests.conftest import API_TOKEN, SLOW_ROWS
from tests.live_server import LiveServer, metric_sample, wait_until

HEADERS = {"Authorization": f"Bearer {API_TOKEN}"}


def _infer_body(rows: int) -> tuple[bytes, dict[str, str]]:
    x = np.random.default_rng(rows).normal(size=(rows, 16)).astype(np.float32)
    tensor = {"name": "x", "shape": [rows, 16], "datatype": "FP32", "parameters": {"binary_data_size": x.nbytes}}
    header = orjson.dumps({"inputs": [tensor], "outputs": [{"name": "d5", "parameters": {"classification": 1}}]})
    headers = {
        **HEADERS,
        "Inference-Header-Content-Length": str(len(header)),
        "Content-Type": "application/octet-stream",
    }
    return header + x.tobytes(), headers


def _statistics(url: str) -> tuple[int, int]:
    stats = httpx.get(f"{url}/v2/models/slow/versions/1/stats", headers=HEADERS).json()["model_stats"][0]
    return stats["execution_count"], stats["inference_count"]


def test_a_disconnected_client_s_queued_request_is_never_computed(guarded_server: LiveServer) -> None:
    url = guarded_server.url

    def batches() -> float:
        return metric_sample(url, "layerserve_batch_size_count", HEADERS, model="slow")

    def computed() -> float:
        return metric_sample(url, "layerserve_compute_seconds_count", HEADERS, model="slow")

    def queued() -> Any:
        return httpx.get(f"{url}/v2/models/slow", headers=HEADERS).json()["batching"]["queued"]

    def closed() -> float:
        return metric_sample(url, "layerserve_requests_total", HEADERS, route="v2.infer", status="499", model="slow")

    wait_until(lambda: computed() == batches(), "the slow model is idle (calls of earlier tests are done)")
    cancelled, closed_before, (executions, rows) = (
        metric_sample(url, "layerserve_requests_cancelled_total", HEADERS, model="slow"), closed(), _statistics(url)
    )  # fmt: skip
    answers: list[httpx.Response] = []
    body, headers = _infer_body(SLOW_ROWS)
    slow = threading.Thread(
        target=lambda: answers.append(
            httpx.post(f"{url}/v2/models/slow/infer", content=body, headers=headers, timeout=120)
        )
    )
    started = batches()
    slow.start()
    wait_until(lambda: batches() > started, "the slow request is computed")
    body, headers = _infer_body(1)
    lines = [
        "POST /v2/models/slow/infer HTTP/1.1",
        f"Host: {guarded_server.host_port}",
        f"Content-Length: {len(body)}",
    ]
    request = ("\r\n".join([*lines, *(f"{k}: {v}" for k, v in headers.items())]) + "\r\n\r\n").encode() + body
    host, port = guarded_server.host_port.split(":")
    with socket.create_connection((host, int(port))) as client:
        client.sendall(request)
        wait_until(lambda: queued() == 1, "the second request waits in the queue")
    wait_until(lambda: closed() > closed_before, "the server saw the client leave")  # recorded as 499
    slow.join(timeout=120)
    assert answers[0].status_code == 200, answers[0].text
    assert _statistics(url) == (executions + 1, rows + SLOW_ROWS)  # the dropped request never ran
    assert metric_sample(url, "layerserve_requests_cancelled_total", HEADERS, model="slow") == cancelled + 1
    assert queued() == 0


def test_requests_still_answered_normally(guarded_server: LiveServer) -> None:
    body, headers = _infer_body(2)
    answer = httpx.post(f"{guarded_server.url}/v2/models/slow/infer", content=body, headers=headers, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["shape"] == [2, 1]
