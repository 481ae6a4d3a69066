"""The model lane: a model's infer, classify and features paths parsed as the router's routes would match them, and
answered from the door's own connection (DirectLane) or through the app (ModelLane) as the route answers them;
what the lane does not take reaches the router."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import httpx
import keras
import numpy as np
import orjson
import pytest
from starlette.requests import Request
from starlette.responses import Response

from layerserve.transports.http import lane
from layerserve.transports.http.cycle import RequestCycle
from layerserve.transports.http.lane import DirectLane, LaneTarget, model_route
from layerserve.transports.http.protocol import HttpProtocol
from tests.live_server import LiveServer, metric_sample


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/v2/models/mlp/infer", ("infer", {"model": "mlp"})),
        ("/v2/models/mlp/versions/2/infer", ("infer", {"model": "mlp", "version": "2"})),
        ("/v2/models/a b/versions/x/infer", ("infer", {"model": "a b", "version": "x"})),  # the route checks it
        ("/v2/models/mlp/classify", ("classify", {"model": "mlp"})),
        ("/v2/models/mlp/versions/3/features", ("features", {"model": "mlp", "version": "3"})),
        ("/v2/models//infer", None),
        ("/v2/models/mlp/versions//infer", None),
        ("/v2/models/mlp/labels/stable/infer", None),
        ("/v2/models/mlp/infer/", None),
        ("/v2/models/mlp/features/batch", None),
        ("/v2/models/mlp/ready", None),
        ("/v2/models/infer", None),
        ("/v1/models/mlp:predict", None),
    ],
)
def test_lane_paths(path: str, expected: tuple[str, dict[str, str]] | None) -> None:
    assert model_route(path) == expected


def test_the_lane_answers_as_the_route_and_leaves_the_rest_to_the_router(server: LiveServer) -> None:
    bad_version = httpx.post(f"{server.url}/v2/models/mlp/versions/x/infer", content=b"{}")
    assert bad_version.status_code == 400 and "version must be a positive integer" in bad_version.json()["error"]
    unknown = httpx.post(f"{server.url}/v2/models/nope/infer", content=b"{}")
    assert unknown.status_code == 404 and "unknown model 'nope'" in unknown.json()["error"]
    wrong_method = httpx.get(f"{server.url}/v2/models/mlp/infer")
    assert wrong_method.status_code == 405 and "allowed: POST" in wrong_method.json()["error"]
    no_route = httpx.post(f"{server.url}/v2/models/mlp/versions/1/infer/more", content=b"{}")
    assert no_route.status_code == 404 and "no route" in no_route.json()["error"]


def test_classify_and_features_take_the_lane_with_the_route_s_answers(server: LiveServer) -> None:
    unknown = httpx.post(f"{server.url}/v2/models/nope/classify", json={"texts": ["x"]})
    assert unknown.status_code == 404 and "unknown model 'nope'" in unknown.json()["error"]
    tensors_only = httpx.post(f"{server.url}/v2/models/mlp/versions/1/features?layer=d1", json={"texts": ["x"]})
    assert tensors_only.status_code == 415 and "/infer" in tensors_only.json()["error"]
    wrong_method = httpx.get(f"{server.url}/v2/models/mlp/classify")
    assert wrong_method.status_code == 405 and "allowed: POST" in wrong_method.json()["error"]
    metrics = httpx.get(f"{server.url}/metrics").text  # counted under the route's own name, as the router would
    assert 'route="image.features",status="415"' in metrics.replace('model="mlp",', "")


def _infer_json(rows: int) -> bytes:
    x = np.random.default_rng(rows).normal(size=(rows, 10)).astype(np.float32)
    return orjson.dumps({"inputs": [{"name": "x", "shape": [rows, 10], "datatype": "FP32", "data": x.reshape(-1)}]},
                        option=orjson.OPT_SERIALIZE_NUMPY)  # fmt: skip


def _request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _read_answers(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """`count` answers (status, body) read from a connection, each framed by its Content-Length."""
    buffer, answers = b"", []
    while len(answers) < count:
        while b"\r\n\r\n" not in buffer:
            chunk = sock.recv(65536)
            assert chunk, f"the server closed the connection after {len(answers)} answers"
            buffer += chunk
        head, _, buffer = buffer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = next(int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:"))
        while len(buffer) < length:
            buffer += sock.recv(65536)
        answers.append((int(lines[0].split()[1]), buffer[:length]))
        buffer = buffer[length:]
    return answers


def test_pipelined_lane_and_router_requests_are_answered_in_order_on_one_connection(server: LiveServer) -> None:
    host, port = server.host_port.split(":")
    body = _infer_json(3)
    expected = httpx.post(f"{server.url}/v2/models/mlp/infer", content=body).json()
    expected_1 = httpx.post(f"{server.url}/v2/models/mlp/versions/1/infer", content=body).json()
    requests = [
        _request("POST", "/v2/models/mlp/infer", body),
        _request("GET", "/v2/models/mlp"),  # the router's
        _request("POST", "/v2/models/nope/infer", body),  # the lane's error
        _request("POST", "/v2/models/mlp/versions/1/infer", body),
    ]
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"".join(requests))  # all four in one write: the connection queues the later ones
        answers = _read_answers(sock, 4)
        sock.sendall(requests[0])  # the connection stays usable
        answers += _read_answers(sock, 1)
    assert [status for status, _ in answers] == [200, 200, 404, 200, 200]
    for index, wanted in ((0, expected), (3, expected_1), (4, expected)):
        assert orjson.loads(answers[index][1]) == wanted
    assert orjson.loads(answers[1][1])["name"] == "mlp"
    assert "unknown model 'nope'" in orjson.loads(answers[2][1])["error"]


def test_an_answer_the_client_accepts_compressed_goes_through_the_app_and_equals_the_lane_s(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    served_below_asgi = []
    serve = DirectLane.serve

    async def counting_serve(self: DirectLane, cycle: RequestCycle, target: LaneTarget) -> None:
        served_below_asgi.append(cycle.scope["path"])
        await serve(self, cycle, target)

    monkeypatch.setattr(DirectLane, "serve", counting_serve)
    body = _infer_json(200)  # an answer over compress_min_bytes
    route = {"model": "mlp", "route": "v2.infer", "status": "200"}
    before = metric_sample(server.url, "layerserve_requests_total", **route)
    plain = httpx.post(f"{server.url}/v2/models/mlp/infer", content=body, headers={"Accept-Encoding": "identity"})
    compressed = httpx.post(f"{server.url}/v2/models/mlp/infer", content=body, headers={"Accept-Encoding": "gzip"})
    assert plain.status_code == compressed.status_code == 200
    assert "content-encoding" not in plain.headers and compressed.headers["content-encoding"] == "gzip"
    assert compressed.json() == plain.json()  # httpx decompresses
    assert served_below_asgi == ["/v2/models/mlp/infer"]  # the plain one; the app compressed the other
    assert metric_sample(server.url, "layerserve_requests_total", **route) == before + 2


def test_an_unexpected_error_in_a_lane_route_is_a_500_with_an_id_and_the_connection_stays_usable(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(request: Request) -> Response:
        raise RuntimeError("a bug")

    monkeypatch.setitem(lane._ENDPOINTS, "infer", (broken, "v2.infer"))
    with httpx.Client(base_url=server.url) as client:
        failed = client.post("/v2/models/mlp/infer", content=_infer_json(1))
        assert failed.status_code == 500 and failed.json()["error"].startswith("internal error ")
        monkeypatch.undo()
        assert client.post("/v2/models/mlp/infer", content=_infer_json(1)).status_code == 200


def test_a_body_read_in_one_piece_reaches_the_route_as_that_piece(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    pieces: list[bytes] = []  # what the protocol read, kept alive so that identities stay unique
    bodies: list[bytes] = []  # what the route received
    on_body, receive = HttpProtocol.on_body, RequestCycle.receive

    def recording_on_body(self: HttpProtocol, body: bytes) -> None:
        pieces.append(body)
        on_body(self, body)

    async def recording_receive(self: RequestCycle) -> Any:
        message = await receive(self)
        bodies.append(message["body"])
        return message

    monkeypatch.setattr(HttpProtocol, "on_body", recording_on_body)
    monkeypatch.setattr(RequestCycle, "receive", recording_receive)
    body = _infer_json(3)
    host, port = server.host_port.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(_request("POST", "/v2/models/mlp/versions/2/infer", body))
        ((status, answer),) = _read_answers(sock, 1)
    assert status == 200, answer
    assert len(pieces) == 1 and pieces[0] == body
    assert len(bodies) == 1 and bodies[0] is pieces[0]  # not copied on its way (uvicorn copied it twice)


def test_a_request_answered_before_its_whole_body_came_leaves_the_connection_usable(server: LiveServer) -> None:
    body = b"x" * (600 << 10)  # read whole on the lane; the route refuses the unknown model before reading it
    host, port = server.host_port.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        request = _request("POST", "/v2/models/nope/classify", body, {"Content-Type": "image/png"})
        sock.sendall(request[: len(request) - len(body) // 2])
        ((status, answer),) = _read_answers(sock, 1)
        assert status == 404 and b"unknown model 'nope'" in answer
        sock.sendall(
            request[len(request) - len(body) // 2 :] + _request("POST", "/v2/models/mlp/infer", _infer_json(2))
        )
        ((status, answer),) = _read_answers(sock, 1)
    assert status == 200 and orjson.loads(answer)["outputs"][0]["shape"][0] == 2  # the next request: answered


def test_a_large_body_of_announced_length_reaches_the_route_whole_and_is_answered_as_keras(
    server: LiveServer, repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    messages: list[tuple[int, bool]] = []  # (body bytes, more_body) of each message a lane route received
    receive = RequestCycle.receive

    async def recording_receive(self: RequestCycle) -> Any:
        message = await receive(self)
        messages.append((len(message.get("body", b"")), message.get("more_body", False)))
        return message

    monkeypatch.setattr(RequestCycle, "receive", recording_receive)
    x = np.random.default_rng(7).normal(size=(20_000, 10)).astype(np.float32)
    body = orjson.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1)}]},
                        option=orjson.OPT_SERIALIZE_NUMPY)  # fmt: skip
    assert len(body) > 1 << 20  # 16 times what a connection reads before it pauses for the app
    host, port = server.host_port.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        request = _request("POST", "/v2/models/mlp/versions/2/infer", body)
        for start in range(0, len(request), 64 << 10):  # in pieces the server reads one by one
            sock.sendall(request[start : start + (64 << 10)])
            time.sleep(0.002)
        ((status, answer),) = _read_answers(sock, 1)
    assert status == 200, answer
    assert messages == [(len(body), False)]  # one message: the route woke once, for the whole body
    (output,) = orjson.loads(answer)["outputs"]
    expected = keras.models.load_model(repository / "mlp" / "2" / "model.keras")(x).numpy()
    np.testing.assert_allclose(np.asarray(output["data"]).reshape(output["shape"]), expected, atol=1e-5)

    def chunks() -> Any:  # no announced length: read in messages as it arrives
        for start in range(0, len(body), 64 << 10):
            yield body[start : start + (64 << 10)]

    messages.clear()
    chunked = httpx.post(f"{server.url}/v2/models/mlp/versions/2/infer", content=chunks(), timeout=30)
    assert chunked.status_code == 200 and chunked.json()["outputs"] == orjson.loads(answer)["outputs"]
    assert len(messages) > 1 and sum(size for size, _ in messages) == len(body)
