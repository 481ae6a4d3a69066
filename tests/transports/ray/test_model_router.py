"""ModelAffinityRouter on a real Ray cluster started here (a head with no CPUs, two nodes of one CPU; two ingress
replicas, and a group of two), under a memory budget: the requests for one model that no replica holds all reach the
same replica (its owner), through the HTTP proxy (and the gRPC proxy, named in the metadata) and through a group's
handle alike, and models spread over both replicas; a model both replicas hold is spread over both as before. Under a
memory budget per replica, requests spread over many models load fewer models per request than Ray Serve's own
routing, with no failed request, even with a replica killed."""

from __future__ import annotations

import functools
import os
import random
import signal
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import keras
import pytest

from layerserve.settings import Settings
from layerserve.transports.ray.deployment import DEPLOYMENT_NAME, RayOptions, build_app
from layerserve.transports.ray.grpc_ingress import SERVICER_FUNCTION
from layerserve.transports.ray.launch import wait_ready
from layerserve.transports.ray.replica import REPLICA_HEADER
from layerserve.transports.ray.retry import PROXY_CALLBACK, PROXY_CALLBACK_VARIABLE
from tests.live_server import free_port
from tests.models import save_model
from tests.transports.ray.processes import ray_processes

pytestmark = pytest.mark.slow

_PREFER_LOCAL = "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING"
_WIDE = 24  # models under a budget
GRPC: dict[str, str] = {}  # the gRPC proxy's address by URL
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
def wide_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 models `w00`..`w23` of a 2 MB file each (one model: one ONNX export), about 2.1 MB each once loaded."""
    folder = tmp_path_factory.mktemp("wide-models")
    keras.utils.set_random_seed(5)
    x = keras.Input((10,), name="x")
    hidden = keras.layers.Dense(700, activation="relu")(keras.layers.Dense(700, activation="relu")(x))
    save_model(keras.Model(x, keras.layers.Dense(3, name="probs")(hidden)), folder / "source" / "1", "model.keras")
    for i in range(_WIDE):
        (folder / "models" / f"w{i:02d}" / "1").mkdir(parents=True)
        (folder / "models" / f"w{i:02d}" / "1" / "model.keras").symlink_to(folder / "source" / "1" / "model.keras")
    return folder / "models"


@pytest.fixture(scope="module")
def deploy() -> Iterator[Deploy]:
    """Serves an application (replacing the one before) on a cluster of two one-CPU nodes; returns its URL (its
    gRPC proxy's address: GRPC[url])."""
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
    url = f"http://127.0.0.1:{port}"
    GRPC[url] = f"127.0.0.1:{free_port()}"
    grpc = {"port": int(GRPC[url].rsplit(":", 1)[1]), "grpc_servicer_functions": [SERVICER_FUNCTION]}

    def run(settings: Settings, options: RayOptions) -> str:
        # Serve starts afresh each time: a proxy keeps the request router it made for a deployment.
        serve.shutdown()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port}, grpc_options=grpc)
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


def _options(model_affinity: bool = True, with_group: bool = True) -> RayOptions:
    group = {"models": ["g*"], "replicas": 2, "replica_cpus": 0.25, "max_replicas_per_node": 1}
    return RayOptions(
        replicas=2, replica_cpus=0.5, max_replicas_per_node=1, model_affinity=model_affinity,
        groups={"g": group} if with_group else {},
    )  # fmt: skip


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
    # A budget (models load on demand) roomy enough for all; m00 and g0 load at start on every replica and stay.
    on_demand = {"model_repository": many_models, "model_memory_budget": 500_000_000, "keep_loaded": "m00,g0"}
    url = deploy(settings.model_copy(update=on_demand), _options())
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
    # gRPC through Ray's proxy: a call that names its model in the metadata `multiplexed_model_id` (Ray's proxy
    # takes no middleware to read it from the message)
    rpc_owners = {_rpc_answered_by(GRPC[url], f"{prefix}nobody-{i}") for prefix in ("", "g-") for i in range(16)}
    assert len(rpc_owners) == 4, rpc_owners  # each name one replica; both of the ingress and both of the group


def _rpc_answered_by(address: str, model: str) -> str:
    """The one replica that answered 4 ModelReady calls for `model` naming it in their metadata."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc

    replicas = set()
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(4):
            answer, call = stub.ModelReady.with_call(
                pb.ModelReadyRequest(name=model), metadata=[("multiplexed_model_id", model)]
            )
            assert not answer.ready
            replicas.update(value for key, value in call.trailing_metadata() if key == REPLICA_HEADER)
    assert len(replicas) == 1, (model, replicas)
    return replicas.pop()


# Per replica, room for about half the 24 wide models: their figures are 2-5 MB each on a replica (the heap's growth
# while one loads, among requests), and a replica's memory grows by 20-45 MB past its base as it serves, which the
# budget's watch counts as the models'. Ray's own routing sends every model to both replicas, which then load about
# every other request's model; affinity sends 12 or so to each (as rendezvous hashing splits them), which hold most.
_BUDGET = 50_000_000


def _replica_pids() -> list[int]:
    """The pids of the ingress deployment's live replicas."""
    from ray.util.state import list_actors

    actors = list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
    return [a.pid for a in actors if a.class_name == f"ServeReplica:layerserve:{DEPLOYMENT_NAME}"]


def _loads(client: httpx.Client) -> float:
    """Versions loaded by every replica so far: /metrics sums them, from what each replica posts every second, so
    read until two readings a post apart agree."""
    readings = [-1.0]
    while len(readings) < 3 or readings[-1] != readings[-2]:
        time.sleep(1.5)
        text = client.get("/metrics").text
        prefix = "layerserve_model_loads_total{"
        readings.append(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)))
    return readings[-1]


def _spread_load(
    url: str, requests: int, seed: int, fault: Callable[[], None] | None = None
) -> tuple[Counter[int], dict[str, Counter[str]]]:
    """`requests` inferences of the wide models, each a model at random, from 4 closed-loop clients (`fault` done
    once a quarter of them are sent): the statuses (0: a client error) and, by model, the replicas that answered."""
    rng = random.Random(seed)
    models = [f"w{rng.randrange(_WIDE):02d}" for _ in range(requests)]
    body = {"inputs": [{"name": "x", "shape": [1, 10], "datatype": "FP32", "data": [0.5] * 10}]}
    statuses: Counter[int] = Counter()
    answered: dict[str, Counter[str]] = defaultdict(Counter)
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            while True:
                with lock:
                    if not models:
                        return
                    model = models.pop()
                    if fault is not None and len(models) == requests * 3 // 4:
                        fault()
                try:
                    answer = http.post(f"/v2/models/{model}/infer", json=body)
                except httpx.HTTPError:
                    statuses[0] += 1
                    continue
                with lock:
                    statuses[answer.status_code] += 1
                    answered[model][answer.headers.get(REPLICA_HEADER, "")] += 1

    threads = [threading.Thread(target=client) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statuses, answered


def test_under_a_budget_affinity_loads_fewer_models_per_request(
    deploy: Deploy, wide_models: Path, settings: Settings
) -> None:
    budgeted = settings.model_copy(update={"model_repository": wide_models, "model_memory_budget": _BUDGET})
    per_request: dict[bool, float] = {}
    for affinity in (False, True):
        url = deploy(budgeted, _options(model_affinity=affinity, with_group=False))
        with httpx.Client(base_url=url, timeout=60) as client:
            warm, _ = _spread_load(url, 150, seed=1)  # every model loaded somewhere, the budgets full
            before = _loads(client)
            statuses, answered = _spread_load(url, 360, seed=2)
            per_request[affinity] = (_loads(client) - before) / 360
        assert set(warm) == set(statuses) == {200}, (affinity, warm, statuses)  # no failed request
        if affinity:  # each model's requests went to one replica, and the models to both
            assert all(max(by.values()) >= 0.9 * sum(by.values()) for by in answered.values()), answered
            assert len({by.most_common(1)[0][0] for by in answered.values()}) == 2, answered
            # A replica killed under load: its models go to the other (which loads them), no request fails.
            kill = functools.partial(os.kill, _replica_pids()[0], signal.SIGKILL)
            lost, _ = _spread_load(url, 360, seed=3, fault=kill)
            assert set(lost) == {200}, lost
    print(f"loads per request: Ray's own routing {per_request[False]:.3f}, model affinity {per_request[True]:.3f}")
    assert per_request[True] < per_request[False], per_request
