"""A server under attack: `layerserve serve` in a process of its own (so that its memory is its own), over plain TCP
or TLS, with a suite's own flags (its module's `SERVER_FLAGS`: shorter timeouts, say), and what the hostile-client
tests measure: the server's resident memory, and a normal client's latency over HTTP and gRPC before, during and
after an attack."""

from __future__ import annotations

import contextlib
import socket
import ssl
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

import grpc
import httpx
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.live_server import free_port, is_running, server_log, start_server_process, wait_process_ready
from tests.tls_files import Authority

Door = Literal["http", "grpc"]
Outcome = TypeVar("Outcome")
MB = 1024 * 1024
INFER_BODY = {"inputs": [{"name": "x", "shape": [1, 10], "datatype": "FP32", "data": [0.5] * 10}]}


def _grpc_request() -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="mlp")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 10])
    tensor.contents.fp32_contents.extend([0.5] * 10)
    return request


@dataclass
class Latencies:
    """A normal client's round trips (seconds) over each door."""

    http: list[float] = field(default_factory=list)
    grpc: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def medians(self) -> tuple[float, float]:
        """The median round trip over HTTP and over gRPC."""
        return statistics.median(self.http), statistics.median(self.grpc)


class HostileServer:
    """See the module: a started server over `repository`, its HTTP and gRPC ports, its TLS authority (None:
    plaintext), and the normal client's connections."""

    def __init__(
        self,
        repository: Path,
        cache: Path,
        authority: Authority | None,
        flags: Sequence[str] = (),
    ) -> None:
        self.repository = repository
        self.authority = authority
        self.http_port, self.grpc_port = free_port(), free_port()
        self.log = server_log(repository)
        self.process = start_server_process(
            repository, cache, self.http_port, "--grpc-port", str(self.grpc_port), "--reload-interval-s", "0",
            "--log-level", "info", *flags,
        )  # fmt: skip
        scheme = "https" if authority else "http"
        self.url = f"{scheme}://127.0.0.1:{self.http_port}"
        self._verify: ssl.SSLContext | bool = authority.client_context() if authority else False
        wait_process_ready(self.url, self.process, self.log, verify=self._verify or True)
        self._http = httpx.Client(base_url=self.url, verify=self._verify, timeout=30)
        self._channel = self._grpc_channel()
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    def _grpc_channel(self) -> grpc.Channel:
        target = f"127.0.0.1:{self.grpc_port}"
        if self.authority is None:
            return grpc.insecure_channel(target)
        credentials = grpc.ssl_channel_credentials(self.authority.cert_file.read_bytes())
        return grpc.secure_channel(target, credentials, options=[("grpc.ssl_target_name_override", "localhost")])

    @property
    def tls(self) -> bool:
        """Whether both doors speak TLS."""
        return self.authority is not None

    def connect(self, door: Door, timeout_s: float = 10) -> socket.socket:
        """A raw connection to a door, TLS-wrapped (ALPN h2 for gRPC, http/1.1 for HTTP) when the server speaks TLS:
        what an attacker writes its own bytes on."""
        port = self.grpc_port if door == "grpc" else self.http_port
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        if self.authority is None:
            return sock
        context = self.authority.client_context()
        context.set_alpn_protocols(["h2"] if door == "grpc" else ["http/1.1"])
        return context.wrap_socket(sock, server_hostname="localhost")

    def rss_bytes(self) -> int:
        """The server process's resident memory (its engine processes, if any, are not counted)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def settle_rss(self, limit_bytes: int, timeout_s: float = 30) -> int:
        """Wait (up to `timeout_s`) for the server's resident memory to come down to `limit_bytes`; the last reading."""
        deadline = time.monotonic() + timeout_s
        while (rss := self.rss_bytes()) > limit_bytes and time.monotonic() < deadline:
            time.sleep(0.2)
        return rss

    def http_round_trip(self) -> float:
        """One V2 infer of `mlp` over HTTP on the normal client's kept-alive connection (seconds)."""
        start = time.perf_counter()
        response = self._http.post("/v2/models/mlp/infer", json=INFER_BODY)
        elapsed = time.perf_counter() - start
        assert response.status_code == 200, response.text
        return elapsed

    def grpc_round_trip(self) -> float:
        """One ModelInfer of `mlp` over gRPC on the normal client's channel (seconds)."""
        start = time.perf_counter()
        self._stub.ModelInfer(_grpc_request(), timeout=30)
        return time.perf_counter() - start

    def usual(self, count: int = 30, pause_s: float = 0.02) -> tuple[float, float]:
        """The normal client's median round trips, HTTP and gRPC, with nothing else going on, paced as
        `normal_client` paces them (a connection idle for a while answers slower than one kept busy)."""
        seen = Latencies()
        for _ in range(count):
            seen.http.append(self.http_round_trip())
            seen.grpc.append(self.grpc_round_trip())
            time.sleep(pause_s)
        return seen.medians()

    @contextlib.contextmanager
    def normal_client(self, pause_s: float = 0.02) -> Iterator[Latencies]:
        """A thread making the normal client's requests (HTTP and gRPC, in turns) while the block runs."""
        seen, stop = Latencies(), threading.Event()

        def run() -> None:
            while not stop.is_set():
                try:
                    seen.http.append(self.http_round_trip())
                    seen.grpc.append(self.grpc_round_trip())
                except Exception as error:  # recorded: the test asserts there were none
                    seen.failures.append(repr(error))
                stop.wait(pause_s)

        thread = threading.Thread(target=run, name="normal-client", daemon=True)
        thread.start()
        try:
            yield seen
        finally:
            stop.set()
            thread.join(timeout=60)

    def alive(self) -> bool:
        """Whether the process runs and both doors answer."""
        if not is_running(self.process.pid):
            return False
        try:
            self.http_round_trip()
            self.grpc_round_trip()
        except Exception:
            return False
        return True

    def stop(self) -> None:
        """SIGTERM, then wait."""
        self._http.close()
        self._channel.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# A round trip of the normal client is ~0.5 ms on loopback: twice that is within a shared 2-core machine's
# scheduling noise, so the bound is twice the usual median or the usual median plus this, whichever is larger.
NOISE_FLOOR_S = 0.010


def assert_normal_client_served(seen: Latencies, usual: tuple[float, float]) -> None:
    """The normal client's requests during (or after) an attack all succeeded, and their median round trips over each
    door stayed under twice the usual ones (see NOISE_FLOOR_S)."""
    assert not seen.failures, seen.failures[:3]
    assert seen.http and seen.grpc, "the normal client made no request"
    for door, during, before in zip(("HTTP", "gRPC"), seen.medians(), usual, strict=True):
        bound = max(2 * before, before + NOISE_FLOOR_S)
        assert during < bound, f"{door}: median round trip {during * 1e3:.1f} ms, usually {before * 1e3:.1f} ms"


def repeat_attack(
    seen: Latencies, attack: Callable[[], Outcome], min_round_trips: int = 20, max_attacks: int = 50
) -> list[Outcome]:
    """Run `attack` again and again (at most `max_attacks` times) until the normal client measuring into `seen` has
    made `min_round_trips` over each door meanwhile: a short attack still gets a median to compare. Its outcomes."""
    outcomes = [attack()]
    while min(len(seen.http), len(seen.grpc)) < min_round_trips and len(outcomes) < max_attacks:
        outcomes.append(attack())
    return outcomes
