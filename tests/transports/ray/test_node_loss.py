"""`layerserve ray serve REPO --address ADDR --replicas 2 --http-port P` as a user runs it, on a cluster started with
`ray start` (a head with no CPU and two nodes of one CPU, on this machine, none with a variable of ours): a node
holding a replica removed under 4 closed-loop keep-alive clients fails no request, and a node added afterwards takes
the lost replica back."""

from __future__ import annotations

import http.client
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from layerserve.settings import Settings
from layerserve.transports.ray.replica import REPLICA_HEADER
from tests.live_server import free_port
from tests.transports.ray.local_cluster import LocalCluster

pytestmark = pytest.mark.slow

_REPLICA = b"ray::ServeReplica:layerserve:layerserve"  # an ingress replica's process title
_BODY = orjson.dumps({"inputs": [{"name": "x", "shape": [1, 10], "datatype": "FP32", "data": [0.5] * 10}]})
_BEFORE, _AFTER = 200, 1_000  # requests answered before the fault, and after it


def _infer(connection: http.client.HTTPConnection) -> tuple[int, str]:
    """One V2 infer on a kept-alive connection: its status and the replica that answered."""
    connection.request("POST", "/v2/models/mlp/infer", _BODY, {"content-type": "application/json"})
    answer = connection.getresponse()
    answer.read()
    return answer.status, answer.getheader(REPLICA_HEADER, "")


def _under_load(port: int, fault: Callable[[], None]) -> Counter[str]:
    """The outcome of every request of 4 closed-loop keep-alive clients (a status, or the client's error): `fault`
    once _BEFORE requests have been answered, the clients stopped once _AFTER more have (or after 120 s)."""
    outcomes: Counter[str] = Counter()
    lock, faulted, stop = threading.Lock(), threading.Event(), threading.Event()

    def client() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while not stop.is_set():
            try:
                outcome = str(_infer(connection)[0])
            except (OSError, http.client.HTTPException) as error:  # what a user's client sees
                outcome = type(error).__name__
                connection.close()  # the next request opens a new connection
            with lock:
                outcomes[outcome] += 1
                if outcomes.total() >= _BEFORE and not faulted.is_set():
                    faulted.set()
                    fault_at[0] = outcomes.total()
                if faulted.is_set() and outcomes.total() >= fault_at[0] + _AFTER:
                    stop.set()
        connection.close()

    fault_at = [0]
    threads = [threading.Thread(target=client) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        assert faulted.wait(120), outcomes
        fault()
        stop.wait(120)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    return outcomes


def _wait_replicas(port: int, want: int, timeout_s: float) -> set[str]:
    """The replicas that answer, requests sent (each on a connection of its own) until `want` have, or until
    `timeout_s` has passed."""
    answered: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(answered) < want and time.monotonic() < deadline:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        status, replica = _infer(connection)
        connection.close()
        assert status == 200, status
        answered.add(replica)
        time.sleep(0.05)
    return answered


def test_a_node_removed_under_load_fails_no_request_through_the_command(
    repository: Path, settings: Settings, tmp_path: Path
) -> None:
    small = tmp_path / "repo"
    small.mkdir()
    (small / "mlp").symlink_to(repository / "mlp")
    cluster = LocalCluster()
    try:
        for cpus in (0, 1, 1):  # the head, and two nodes
            cluster.add_node(cpus)
        port = free_port()
        command = [
            sys.executable, "-m", "layerserve", "ray", "serve", str(small), "--address", cluster.address,
            "--replicas", "2", "--http-port", str(port), "--grpc-port", str(free_port()),
            "--engine-cache-dir", str(settings.engine_cache_dir), "--reload-interval-s", "0",
        ]  # fmt: skip
        deployed = subprocess.run(
            command, check=False, env=cluster.environment, capture_output=True, text=True, timeout=240
        )
        assert deployed.returncode == 0, deployed.stderr[-3000:]
        first = _wait_replicas(port, 2, 60)
        assert len(first) == 2, first
        assert cluster.running(b"ray::ProxyActor") == cluster.nodes[:1]  # one proxy, on the head
        outcomes = _under_load(port, lambda: cluster.remove(cluster.running(_REPLICA)[0]))
        assert set(outcomes) == {"200"}, outcomes
        # The lost replica waits for a node with a free CPU, and starts on the one added.
        cluster.add_node(1)
        again = _wait_replicas(port, 2, 120)
        assert len(again) == 2 and again - first, (first, again)
    finally:
        cluster.shutdown()  # and check that nothing of it is left
