"""Hostile input: every case gets a clear 4xx (never a 500), and the server stays live afterwards."""

from __future__ import annotations

import json
import logging
import re
import socket
import struct
from typing import Any

import httpx
import pytest

from tests.live_server import LiveServer

X = {"name": "x", "shape": [1, 10], "datatype": "FP32", "data": [0.5] * 10}


def _binary(header: dict[str, object], data: bytes) -> tuple[bytes, dict[str, str]]:
    raw = json.dumps(header).encode()
    return raw + data, {"Inference-Header-Content-Length": str(len(raw)), "Content-Type": "application/octet-stream"}


JSON_CASES = [
    ("shape product beyond 2^63", {"inputs": [{**X, "shape": [2**32, 2**32, 4]}]}, "shape"),
    ("dimension beyond int64", {"inputs": [{**X, "shape": [2**70, 10]}]}, "shape"),
    ("negative dimension", {"inputs": [{**X, "shape": [-1, 10]}]}, "shape"),
    ("non-integer dimension", {"inputs": [{**X, "shape": [1.5, 10]}]}, "shape"),
    ("string dimension", {"inputs": [{**X, "shape": ["1", 10]}]}, "shape"),
    ("boolean dimension", {"inputs": [{**X, "shape": [True, 10]}]}, "shape"),
    ("data shorter than the shape", {"inputs": [{**X, "data": [0.5] * 9}]}, "elements"),
    ("data longer than the shape", {"inputs": [{**X, "data": [0.5] * 11}]}, "elements"),
    ("wrong datatype for the data", {"inputs": [{**X, "datatype": "INT32"}]}, "datatype"),
    ("unknown datatype", {"inputs": [{**X, "datatype": "FP128"}]}, "datatype"),
    ("strings for floats", {"inputs": [{**X, "data": ["a"] * 10}]}, "FP32"),
    ("nested data of two shapes", {"inputs": [{**X, "data": [[0.5] * 5, [0.5] * 4]}]}, "x"),
    ("duplicate input names", {"inputs": [X, X]}, "twice"),
    ("duplicate output names", {"inputs": [X], "outputs": [{"name": "probs"}, {"name": "probs"}]}, "unique"),
    ("inputs not a list", {"inputs": {"x": 1}}, "inputs"),
    ("an input without a name", {"inputs": [{"shape": [1, 10], "datatype": "FP32", "data": [0] * 10}]}, "name"),
    ("parameters not an object", {"inputs": [{**X, "parameters": [1]}]}, "parameters"),
]


@pytest.mark.parametrize(("case", "body", "mentions"), JSON_CASES, ids=[c[0] for c in JSON_CASES])
def test_bad_json_requests(server: LiveServer, case: str, body: dict[str, object], mentions: str) -> None:
    response = httpx.post(f"{server.url}/v2/models/mlp/infer", json=body)
    assert response.status_code == 400, (case, response.text)
    assert mentions.lower() in response.json()["error"].lower(), (case, response.json())
    assert httpx.get(f"{server.url}/v2/health/live").status_code == 200


def test_json_nested_deeper_than_100(server: LiveServer) -> None:
    deep = "[" * 200 + "0" + "]" * 200
    raw = '{"inputs": [{"name": "x", "shape": [1, 10], "datatype": "FP32", "data": ' + deep + "}]}"
    response = httpx.post(f"{server.url}/v2/models/mlp/infer", content=raw.encode())
    assert response.status_code == 400 and "deep" in response.json()["error"]
    assert httpx.get(f"{server.url}/v2/health/live").status_code == 200


BINARY_CASES = [
    ("header length larger than the body", "99999", b"{}", "larger than the body"),
    ("negative header length", "-5", b"{}", "Inference-Header-Content-Length"),
    ("non-numeric header length", "abc", b"{}", "Inference-Header-Content-Length"),
]


@pytest.mark.parametrize(("case", "length", "body", "mentions"), BINARY_CASES, ids=[c[0] for c in BINARY_CASES])
def test_bad_binary_headers(server: LiveServer, case: str, length: str, body: bytes, mentions: str) -> None:
    headers = {"Inference-Header-Content-Length": length}
    response = httpx.post(f"{server.url}/v2/models/mlp/infer", content=body, headers=headers)
    assert response.status_code == 400, (case, response.text)
    assert mentions in response.json()["error"], (case, response.json())
    assert httpx.get(f"{server.url}/v2/health/live").status_code == 200


def test_binary_sizes_that_disagree(server: LiveServer) -> None:
    url = f"{server.url}/v2/models/mlp/infer"
    cases = [
        ({"inputs": [{**X, "data": None, "parameters": {"binary_data_size": 36}}]}, b"\0" * 36, "does not match"),
        ({"inputs": [{**X, "data": None, "parameters": {"binary_data_size": 40}}]}, b"\0" * 20, "runs past"),
        ({"inputs": [{**X, "data": None, "parameters": {"binary_data_size": -4}}]}, b"\0" * 40, "binary_data_size"),
        ({"inputs": [{**X, "data": None, "parameters": {"binary_data_size": "40"}}]}, b"\0" * 40, "binary_data_size"),
    ]
    for header, data, mentions in cases:
        header["inputs"][0].pop("data")  # type: ignore[index, union-attr]
        body, headers = _binary(header, data)
        response = httpx.post(url, content=body, headers=headers)
        assert response.status_code == 400 and mentions in response.json()["error"], response.text
    assert httpx.get(f"{server.url}/v2/health/live").status_code == 200


def test_bytes_length_prefix_past_the_buffer(server: LiveServer) -> None:
    header = {"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "parameters": {"binary_data_size": 12}}]}
    data = struct.pack("<I", 3) + b"abc" + struct.pack("<I", 1000) + b"x"
    body, headers = _binary(header, data)
    response = httpx.post(f"{server.url}/v2/models/mlp/infer", content=body, headers=headers)
    assert 400 <= response.status_code < 500, response.text
    assert httpx.get(f"{server.url}/v2/health/live").status_code == 200


@pytest.mark.parametrize("version", ["9", "0", "-1", "x", "1.5", "99999999999999999999999"])
def test_unknown_and_malformed_versions(server: LiveServer, version: str) -> None:
    response = httpx.post(f"{server.url}/v2/models/mlp/versions/{version}/infer", json={"inputs": [X]})
    assert response.status_code in (400, 404), response.text
    assert "version" in response.json()["error"]


@pytest.mark.parametrize("name", ["..", "a%2Fb", "a%00b", "%2e%2e", ".hidden", "a\\b"])
@pytest.mark.parametrize(
    "route", ["/v2/repository/models/{m}/load", "/v2/repository/models/{m}/unload", "/v2/models/{m}/versions/1/apply",
              "/v2/models/{m}/labels/stable/apply", "/v2/models/{m}/train"],
)  # fmt: skip
def test_hostile_model_names_in_management_routes(server: LiveServer, name: str, route: str) -> None:
    response = httpx.post(
        f"{server.url}{route.format(m=name)}", json={"dataset": {"texts": ["a", "b"], "labels": ["x", "y"]}}
    )
    assert 400 <= response.status_code < 500, (name, route, response.status_code, response.text)
    assert "error" in response.json()
    assert httpx.get(f"{server.url}/v2/health/live").status_code == 200


def test_a_request_head_over_max_header_bytes_is_431_and_the_server_stays_up(server: LiveServer) -> None:
    body = {"inputs": [X]}
    padded = {f"x-pad-{i}": "v" * 100 for i in range(700)}  # about 76 KB of headers, over the 64 KiB default
    with httpx.Client() as client:
        refused = client.post(f"{server.url}/v2/models/mlp/infer", json=body, headers=padded)
        assert refused.status_code == 431 and refused.headers["connection"] == "close"
        assert "max_header_bytes" in refused.json()["error"]
        # The same headers, fewer of them: served, and the next request on a new connection too.
        fewer = {name: value for name, value in list(padded.items())[:500]}  # about 54 KB
        assert client.post(f"{server.url}/v2/models/mlp/infer", json=body, headers=fewer).status_code == 200
        assert client.get(f"{server.url}/v2/health/live").status_code == 200


def test_a_request_asking_for_an_upgrade_is_served_over_http_with_its_body(server: LiveServer) -> None:
    # What `curl --http2 -d ...` sends on http://; the route got an empty body ("not valid JSON: zero-length").
    upgrade = {"upgrade": "h2c", "connection": "Upgrade, HTTP2-Settings", "http2-settings": "AAMAAABkAAQCAAAAAAIAAAAA"}
    body = {"inputs": [X]}
    with httpx.Client() as client:
        expected = client.post(f"{server.url}/v2/models/mlp/infer", json=body).json()
        for _ in range(2):  # the connection stays usable
            answered = client.post(f"{server.url}/v2/models/mlp/infer", json=body, headers=upgrade)
            assert answered.status_code == 200 and answered.json() == expected
        websocket = {"upgrade": "websocket", "connection": "Upgrade", "sec-websocket-version": "13",
                     "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ=="}  # fmt: skip
        live = client.get(f"{server.url}/v2/health/live", headers=websocket)  # was 403, with no body
        assert (live.status_code, live.json()) == (200, {"live": True})


@pytest.mark.parametrize(
    ("case", "head", "mentions"),
    [
        (
            "Content-Length and Transfer-Encoding",
            b"content-length: 4\r\ntransfer-encoding: chunked\r\n",
            "Transfer-Encoding",
        ),
        ("two Content-Lengths", b"content-length: 2\r\ncontent-length: 3\r\n", "Duplicate Content-Length"),
        ("a negative Content-Length", b"content-length: -1\r\n", "Content-Length"),
        ("a folded header", b"x-a: a\r\n b\r\n", "whitespace"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_malformed_http_is_a_json_400_naming_what_is_wrong(
    server: LiveServer, case: str, head: bytes, mentions: str
) -> None:
    host, port = server.host_port.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nhost: x\r\n" + head + b"\r\n{}\r\n")
        answer = b""
        while not answer.endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 400 "), (case, answer)
    assert mentions in json.loads(body)["error"], (case, body)
    assert httpx.get(f"{server.url}/v2/health/live").status_code == 200


def test_an_internal_error_is_one_500_logged_once_and_the_connection_stays_usable(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from layerserve.protocols import v2

    encode = v2.encode_infer_response

    def fail_on_request_id(*args: Any, **kwargs: Any) -> tuple[bytes, int | None]:
        if args[0].id == "inject-fault":
            raise RuntimeError("an injected fault with engine internals")
        return encode(*args, **kwargs)

    monkeypatch.setattr(v2, "encode_infer_response", fail_on_request_id)
    url = f"{server.url}/v2/models/mlp/infer"
    ports = set()
    # The transports' loggers only: the repository's poll may log about the misconfigured model meanwhile.
    with caplog.at_level(logging.ERROR, "layerserve.transports"), httpx.Client() as client:
        good = client.post(url, json={"inputs": [X]})
        ports.add(good.extensions["network_stream"].get_extra_info("client_addr"))
        failed = client.post(url, json={"id": "inject-fault", "inputs": [X]})
        after = client.post(url, json={"inputs": [X]})
        ports.add(after.extensions["network_stream"].get_extra_info("client_addr"))
    assert good.status_code == 200 and after.status_code == 200, (good.text, after.text)
    assert failed.status_code == 500 and failed.headers.get("connection") != "close"
    (message,) = failed.json().values()
    assert re.fullmatch(r"internal error [0-9a-f]{12}", message), message
    assert len(ports) == 1  # the same kept-alive connection answered before and after the 500
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("layerserve.transports")]
    assert len(errors) == 1 and message.split()[-1] in errors[0].getMessage(), [r.getMessage() for r in errors]
    assert errors[0].exc_info is not None and "injected fault" in str(errors[0].exc_info[1])
