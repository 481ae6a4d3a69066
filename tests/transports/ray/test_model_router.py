"""ModelAffinityRouter on a real Ray cluster started here (a head with no CPUs, two nodes of one CPU; two ingress
replicas and a group of two): the requests for one model that no replica holds all reach the same replica (its
owner), through the proxy and through a group's handle alike, and models spread over both replicas; a model both
replicas hold is spread over both as before."""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from layerserve.settings import Settings
from layerserve.transports.ray.deployment import RayOptions, build_app
from layerserve.transports.ray.launch import wait_ready
from layerserve.transports.ray.replica import REPLICA_HEADER
from layerserve.transports.ray.retry import PROXY_CALLBACK, PROXY_CALLBACK_VARIABLE
from tests.live_server import free_port
from tests.transports.ray.processes import ray_processes

pytestmark = pytest.mark.slow

_PREFER_LOCAL = "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING"
Deploy = Callable[[Settings, RayOptions], str]


@pytest.fixture(scope="module")
def many_models(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Twelve small models `m00`..`m11` and two of a group, `g0` and `g1` (all mlp's version 1: one export)."""
    folder = tmp_path_factory.mktemp("many-models")
    for name in [*(f"m{i:02d}" for i in range(12)), "g0", "g1"]:
        (folder / name / "1").mkdir(parents=True)
        (folder / name / "1" / "model.keras").symlink_to(repository / "mlp" / "1" / "model.keras")
    return folder


@pytest.fixture(scope="module")
def deploy() -> Iterator[Deploy]:
    """Serves an application (replacing the one before) on a cluster of two one-CPU nodes; returns its URL."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    before = ray_processes()
    os.environ[PROXY_CALLBACK_VARIABLE] = PROXY_CALLBACK  # the proxy names each request's model
    os.environ[_PREFER_LOCAL] = "0"  # one proxy here, spreading over both nodes (see test_deployment.py)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, logging_level="warning")
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"

    def run(settings: Settings, options: RayOptions) -> str:
        serve.run(build_app(settings, options), name="layerserve", route_prefix="/", blocking=False)
        wait_ready(url, 300)
        return url

    try:
        yield run
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        del os.environ[PROXY_CALLBACK_VARIABLE], os.environ[_PREFER_LOCAL]
        deadline = time.monotonic() + 30
        while ray_processes() - before and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not ray_processes() - before, "Ray processes outlived the cluster's shutdown"


def _options(model_affinity: bool = True) -> RayOptions:
    group = {"models": ["g*"], "replicas": 2, "replica_cpus": 0.25, "max_replicas_per_node": 1}
    return RayOptions(
        replicas=2, replica_cpus=0.5, max_replicas_per_node=1, model_affinity=model_affinity, groups={"g": group}
    )


def _answered_by(client: httpx.Client, model: str, times: int, status: int = 200) -> set[str]:
    """The replicas that answered `times` metadata requests for `model`, each with `status`."""
    replicas = set()
    for _ in range(times):
        answer = client.get(f"/v2/models/{model}")
        assert answer.status_code == status, answer.text
        replicas.add(answer.headers[REPLICA_HEADER])
    return replicas


def test_a_model_no_replica_holds_goes_to_one_replica_and_models_spread(
    deploy: Deploy, many_models: Path, settings: Settings
) -> None:
    url = deploy(settings.model_copy(update={"model_repository": many_models}), _options())
    owners: dict[str, set[str]] = defaultdict(set)
    with httpx.Client(base_url=url, timeout=60) as client:
        for i in range(16):  # unknown models: no replica holds them, each goes to its owner
            owners["ingress"] |= (ingress := _answered_by(client, f"nobody-{i}", 6, status=404))
            assert len(ingress) == 1, ingress
            owners["group"] |= (group := _answered_by(client, f"g-nobody-{i}", 6, status=404))
            assert len(group) == 1, group
        assert len(owners["ingress"]) == 2 and len(owners["group"]) == 2, owners  # and they spread
        assert len(_answered_by(client, "m00", 30)) == 2  # both hold it: spread as before
        assert len(_answered_by(client, "g0", 30)) == 2
