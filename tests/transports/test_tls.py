"""TLS and mutual TLS on both doors, with real clients against certificates the tests make: curl, httpx,
tritonclient (http and grpc), a grpcio secure channel and the health services; refusals at the handshake; plaintext
and TLS crossed; renewed certificates; files refused at start."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from layerserve.cli import main
from layerserve.errors import ConfigError
from layerserve.settings import Settings
from layerserve.transports.tls import build_context, door_tls
from tests.live_server import (
    LiveServer,
    free_port,
    server_log,
    start_server,
    start_server_process,
    wait_process_ready,
    wait_until,
)
from tests.models import build_mlp, load_reference, save_model
from tests.tls_files import Authority, Issued, make_authority

X = np.linspace(-1, 1, 20, dtype=np.float32).reshape(2, 10)
BODY = {"inputs": [{"name": "x", "shape": [2, 10], "datatype": "FP32", "data": X.ravel().tolist()}]}


@pytest.fixture(scope="module")
def tls_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One small model, `mlp`."""
    repository = tmp_path_factory.mktemp("tls-repository")
    save_model(build_mlp(1), repository / "mlp" / "1", "model.keras")
    return repository


@pytest.fixture(scope="module")
def authority(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    """The test CA."""
    return make_authority(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def tls_folder(tmp_path_factory: pytest.TempPathFactory, authority: Authority) -> Path:
    """The server's certificate and key (renewed by a test: a folder of this module's own)."""
    folder = tmp_path_factory.mktemp("server-tls")
    authority.issue(folder, "server")
    return folder


@pytest.fixture(scope="module")
def tls_server(
    tls_repository: Path, tls_folder: Path, authority: Authority, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """A server speaking TLS on both doors (no client certificates asked)."""
    settings = Settings(
        model_repository=tls_repository, engine_cache_dir=tmp_path_factory.mktemp("tls-cache"), reload_interval_s=0,
        tls_cert_file=tls_folder / "server.crt", tls_key_file=tls_folder / "server.key",
    )  # fmt: skip
    live = start_server(settings, grpc=True, verify=authority.client_context())
    yield live
    live.stop()


def _reference(repository: Path) -> np.ndarray:
    return np.asarray(load_reference(repository, "mlp", 1)(X))


def _triton_grpc_input() -> tg.InferInput:
    tensor = tg.InferInput("x", [2, 10], "FP32")
    tensor.set_data_from_numpy(X)
    return tensor


def _peer_serial(port: int, context: ssl.SSLContext) -> int:
    """The serial number of the certificate a new connection to `port` is shown."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_curl_with_the_ca_gets_the_layer_output_keras_computes(
    tls_server: LiveServer, authority: Authority, tls_repository: Path
) -> None:
    url = f"{tls_server.url}/v2/models/mlp/infer"
    command = ["curl", "-sS", "--cacert", str(authority.cert_file), "-H", "content-type: application/json"]
    done = subprocess.run([*command, "--data-binary", httpx.Request("POST", url, json=BODY).read(), url],
                          capture_output=True, timeout=60, check=True)  # fmt: skip
    output = httpx.Response(200, content=done.stdout).json()["outputs"][0]
    np.testing.assert_allclose(np.reshape(output["data"], output["shape"]), _reference(tls_repository), atol=1e-5)
    refused = subprocess.run(["curl", "-sS", f"{tls_server.url}/v2/health/live"], capture_output=True, timeout=60,
                             check=False)  # fmt: skip
    assert refused.returncode == 60, refused.stderr  # curl: the peer's certificate cannot be verified


def test_httpx_and_the_kserve_health_checks_over_tls(tls_server: LiveServer, authority: Authority) -> None:
    with httpx.Client(base_url=tls_server.url, verify=authority.client_context()) as client:
        assert client.get("/v2/health/live").status_code == 200
        assert client.get("/v2/health/ready").status_code == 200
        assert client.get("/v2/models/mlp/ready").status_code == 200
        assert client.get("/v2").json()["name"] == "layerserve"


def test_tritonclient_http_with_an_ssl_context(
    tls_server: LiveServer, authority: Authority, tls_repository: Path
) -> None:
    client = th.InferenceServerClient(tls_server.host_port, ssl=True, ssl_context_factory=authority.client_context)
    try:
        assert client.is_server_ready()
        tensor = th.InferInput("x", [2, 10], "FP32")
        tensor.set_data_from_numpy(X, binary_data=True)
        probs = client.infer("mlp", [tensor]).as_numpy("probs")
        np.testing.assert_allclose(probs, _reference(tls_repository), atol=1e-5)
    finally:
        client.close()


def test_tritonclient_grpc_and_a_grpcio_secure_channel(
    tls_server: LiveServer, authority: Authority, tls_repository: Path
) -> None:
    target = f"localhost:{tls_server.grpc_port}"
    with tg.InferenceServerClient(target, ssl=True, root_certificates=str(authority.cert_file)) as client:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("mlp")
        probs = client.infer("mlp", [_triton_grpc_input()]).as_numpy("probs")
        np.testing.assert_allclose(probs, _reference(tls_repository), atol=1e-5)
    credentials = grpc.ssl_channel_credentials(authority.cert_file.read_bytes())
    with grpc.secure_channel(target, credentials) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_to_a_tls_port_fails_at_once(tls_server: LiveServer) -> None:
    plain = tls_server.url.replace("https://", "http://")
    with pytest.raises(httpx.TransportError) as raised:
        httpx.get(f"{plain}/v2/health/live", timeout=20)
    assert not isinstance(raised.value, httpx.TimeoutException), raised.value
    plain_channel = grpc.insecure_channel(f"127.0.0.1:{tls_server.grpc_port}")
    with plain_channel as channel, pytest.raises(grpc.RpcError) as failed:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=20)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
    assert httpx.get(f"{tls_server.url}/v2/health/live", verify=False).status_code == 200


def test_a_tls_client_to_a_plaintext_port_fails_at_once(server: LiveServer, authority: Authority) -> None:
    tls_url = server.url.replace("http://", "https://")
    with pytest.raises(httpx.ConnectError, match="SSL"):
        httpx.get(f"{tls_url}/v2/health/live", verify=authority.client_context(), timeout=20)
    credentials = grpc.ssl_channel_credentials(authority.cert_file.read_bytes())
    with grpc.secure_channel(server.grpc_target, credentials) as channel, pytest.raises(grpc.RpcError) as failed:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=20)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
    assert httpx.get(f"{server.url}/v2/health/live").status_code == 200


def test_a_renewed_certificate_serves_new_connections_and_open_ones_keep_theirs(
    tls_server: LiveServer, tls_folder: Path, authority: Authority, tmp_path: Path
) -> None:
    port, context = int(tls_server.url.rsplit(":", 1)[1]), authority.client_context()
    before = _peer_serial(port, context)
    with httpx.Client(base_url=tls_server.url, verify=context) as kept:
        assert kept.get("/v2/health/live").status_code == 200
        renewed = authority.issue(tmp_path, "server")  # a new key too, as a renewal by an ACME client makes
        shutil.copy(renewed.key, tls_folder / "server.key.new")
        shutil.copy(renewed.cert, tls_folder / "server.crt.new")
        (tls_folder / "server.crt.new").replace(tls_folder / "server.crt")  # a moment with a mismatched pair
        (tls_folder / "server.key.new").replace(tls_folder / "server.key")
        serial = x509.load_pem_x509_certificate(renewed.cert.read_bytes()).serial_number
        wait_until(lambda: _peer_serial(port, context) == serial, "new connections see the renewed certificate", 30)
        assert kept.get("/v2/health/live").status_code == 200  # the connection open before keeps going
    assert before != serial
    grpc_serial = _peer_serial(tls_server.grpc_port, _h2_context(authority))
    wait_until(lambda: _peer_serial(tls_server.grpc_port, _h2_context(authority)) == serial, "gRPC renewed", 30)
    assert grpc_serial in (before, serial)


def _h2_context(authority: Authority, client: Issued | None = None) -> ssl.SSLContext:
    context = authority.client_context(client)
    context.set_alpn_protocols(["h2"])
    return context


@pytest.fixture(scope="module")
def mutual_server(
    tls_repository: Path, authority: Authority, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, int, Issued]]:
    """`layerserve serve --workers 2` with mutual TLS on both doors: its URL, gRPC port and a client's certificate."""
    folder = tmp_path_factory.mktemp("mutual")
    server, client = authority.issue(folder, "server"), authority.issue(folder, "client", client=True)
    repository = folder / "repository"
    shutil.copytree(tls_repository, repository)
    port, grpc_port = free_port(), free_port()
    process = start_server_process(
        repository, folder / "cache", port, "--workers", "2", "--grpc-port", str(grpc_port), "--tls-cert-file",
        str(server.cert), "--tls-key-file", str(server.key), "--tls-client-ca-file", str(authority.cert_file),
    )  # fmt: skip
    url = f"https://127.0.0.1:{port}"
    try:
        wait_process_ready(url, process, server_log(repository), verify=authority.client_context(client))
        yield url, grpc_port, client
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_mutual_tls_serves_clients_with_a_certificate_of_its_ca(
    mutual_server: tuple[str, int, Issued], authority: Authority, tls_repository: Path
) -> None:
    url, grpc_port, client = mutual_server
    with httpx.Client(base_url=url, verify=authority.client_context(client)) as http:
        for _ in range(6):  # new connections: both workers
            output = http.post("/v2/models/mlp/infer", json=BODY, headers={"connection": "close"}).json()["outputs"]
            np.testing.assert_allclose(np.reshape(output[0]["data"], (2, 3)), _reference(tls_repository), atol=1e-5)
    grpc_client = tg.InferenceServerClient(
        f"localhost:{grpc_port}", ssl=True, root_certificates=str(authority.cert_file), private_key=str(client.key),
        certificate_chain=str(client.cert),
    )  # fmt: skip
    with grpc_client:
        probs = grpc_client.infer("mlp", [_triton_grpc_input()]).as_numpy("probs")
        np.testing.assert_allclose(probs, _reference(tls_repository), atol=1e-5)


@pytest.mark.parametrize("who", ["no certificate", "a certificate of another CA"])
def test_mutual_tls_refuses_at_the_handshake_and_stays_up(
    mutual_server: tuple[str, int, Issued], authority: Authority, tmp_path: Path, who: str
) -> None:
    url, grpc_port, client = mutual_server
    stranger = make_authority(tmp_path, "other-ca").issue(tmp_path, "stranger", client=True)
    presented = None if who == "no certificate" else stranger
    with pytest.raises(httpx.TransportError) as raised:
        httpx.get(f"{url}/v2/health/live", verify=authority.client_context(presented), timeout=20)
    assert not isinstance(raised.value, httpx.TimeoutException), raised.value
    with pytest.raises((ssl.SSLError, ConnectionResetError, ConnectionAbortedError)):
        _peer_serial_and_read(grpc_port, _h2_context(authority, presented))
    keys: dict[str, Any] = {} if presented is None else {
        "private_key": str(presented.key), "certificate_chain": str(presented.cert)
    }  # fmt: skip
    refused = tg.InferenceServerClient(
        f"localhost:{grpc_port}", ssl=True, root_certificates=str(authority.cert_file), **keys
    )
    with refused, pytest.raises(InferenceServerException, match="UNAVAILABLE"):
        refused.is_server_live(client_timeout=20)
    with httpx.Client(verify=authority.client_context(client)) as good:
        assert good.get(f"{url}/v2/health/live").status_code == 200


def _peer_serial_and_read(port: int, context: ssl.SSLContext) -> None:
    """Handshake, then read: a refusal of the client's certificate under TLS 1.3 shows at the first read."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        if not tls.recv(100):
            raise ConnectionResetError("closed")


def _serve_exit(capsys: pytest.CaptureFixture[str], repository: Path, *flags: str) -> str:
    status = main(["serve", str(repository), "--port", str(free_port()), "--grpc-port", "0", *flags])
    assert status == 2
    return capsys.readouterr().err


def test_serve_refuses_tls_files_that_cannot_serve_naming_them(
    capsys: pytest.CaptureFixture[str], tls_repository: Path, authority: Authority, tmp_path: Path
) -> None:
    server, other = authority.issue(tmp_path, "server"), authority.issue(tmp_path, "other")
    missing = tmp_path / "missing.crt"
    error = _serve_exit(capsys, tls_repository, "--tls-cert-file", str(missing), "--tls-key-file", str(server.key))
    assert str(missing) in error and "no such file" in error
    error = _serve_exit(capsys, tls_repository, "--tls-cert-file", str(server.cert), "--tls-key-file", str(other.key))
    assert str(other.key) in error and "does not match" in error
    error = _serve_exit(capsys, tls_repository, "--tls-client-ca-file", str(authority.cert_file))
    assert str(authority.cert_file) in error and "tls_cert_file" in error
    error = _serve_exit(capsys, tls_repository, "--tls-cert-file", str(server.key), "--tls-key-file", str(server.key))
    assert str(server.key) in error and "not a PEM certificate" in error
    locked = authority.issue(tmp_path, "locked", password=b"secret")
    error = _serve_exit(capsys, tls_repository, "--tls-cert-file", str(locked.cert), "--tls-key-file", str(locked.key))
    assert str(locked.key) in error and "password" in error
    error = _serve_exit(capsys, tls_repository, "--tls-cert-file", str(server.cert), "--tls-key-file", str(server.key),
                        "--tls-client-ca-file", str(tmp_path))  # fmt: skip
    assert str(tmp_path) in error and "not a file" in error


def test_a_file_the_server_cannot_read_is_refused_naming_it(
    authority: Authority, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    issued = authority.issue(tmp_path, "server")
    files = door_tls(Settings(tls_cert_file=issued.cert, tls_key_file=issued.key), "http")
    assert files is not None
    # The suite runs as root, which reads any file: the permission check is what a user without the right meets.
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != issued.key)
    with pytest.raises(ConfigError, match=f"TLS key file {issued.key}: not readable by this process"):
        build_context(files)


def test_an_encrypted_key_serves_with_its_password(authority: Authority, tmp_path: Path) -> None:
    locked = authority.issue(tmp_path, "locked", password=b"secret")
    settings = Settings(tls_cert_file=locked.cert, tls_key_file=locked.key, tls_key_password="secret")
    files = door_tls(settings, "grpc")
    assert files is not None and files.alpn == ("h2",)
    assert build_context(files).minimum_version == ssl.TLSVersion.TLSv1_2


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_load_generator_speaks_tls_to_both_doors(
    tls_server: LiveServer, authority: Authority, monkeypatch: pytest.MonkeyPatch, protocol: str
) -> None:
    from layerserve.bench.generator import BenchOptions, run_bench

    monkeypatch.setenv("SSL_CERT_FILE", str(authority.cert_file))  # as `layerserve bench --tls-ca-file` sets it
    options = BenchOptions(tls_server.url, "mlp", "tensor", [2], 0.5, protocol=protocol, grpc_port=tls_server.grpc_port)
    step = run_bench(options)["steps"][0]
    assert step["requests"] > 0 and not step["errors"], step  # errors: counts by status
