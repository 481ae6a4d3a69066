"""build_app on a real Ray cluster of several nodes started here (a head with no CPUs, two nodes of one CPU):
every replica answers as Keras does, replicas land on distinct nodes and say so, a replica killed under load
fails no request and comes back, a feature cached through one replica is a hit through the other (one Redis),
a new version folder is served by every replica with no failed request, a node removed under load fails no
request and its replica comes back on another node, a training job submitted through the cluster ends with its
version served by every replica, both replicas answer on their shared direct port (and the one that replaces a
killed replica opens it again), shutdown leaves no Ray process behind."""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from corpora import rotten_tomatoes
from layerserve.settings import Settings
from layerserve.transports.ray.deployment import DEPLOYMENT_NAME, RayOptions, build_app
from layerserve.transports.ray.grpc_ingress import SERVICER_FUNCTION
from layerserve.transports.ray.launch import wait_ready
from layerserve.transports.ray.replica import REPLICA_HEADER
from layerserve.transports.ray.retry import PROXY_CALLBACK, PROXY_CALLBACK_VARIABLE
from tests.live_server import free_port
from tests.models import load_reference
from tests.redis_server import RedisServer
from tests.training.test_jobs import wait_for
from tests.training.test_tokenizer import POSITIVE
from tests.transports.ray.processes import ray_processes

pytestmark = pytest.mark.slow

_PREFER_LOCAL = "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING"
CLUSTERS: dict[str, Any] = {}  # the fixture's cluster by URL, for the test that removes a node
GRPC_PORTS: dict[str, int] = {}  # the port of Ray Serve's gRPC proxy by URL
DOORS: dict[str, str] = {}  # the URL of the replicas' direct port by URL
REDIS: dict[str, RedisServer] = {}  # the cluster's Redis by URL, for the test that stops it


@pytest.fixture(scope="module")
def ray_repository(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`multi`, and `mlp` and `cached` (mlp's versions 1 and 2, the latter caching features) in folders of their
    own, to which the tests add versions."""
    small = tmp_path_factory.mktemp("ray-repo")
    (small / "multi").symlink_to(repository / "multi")
    for model in ("mlp", "cached"):  # folders of their own: the tests add versions; `cached` caches features
        for number in ("1", "2"):
            (small / model / number).mkdir(parents=True)
            (small / model / number / "model.keras").symlink_to(repository / "mlp" / number / "model.keras")
    (small / "cached" / "config.yaml").write_text("cache: true\n")
    return small


@pytest.fixture(scope="module")
def cluster_url(ray_repository: Path, settings: Settings) -> Iterator[str]:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    before, small = ray_processes(), ray_repository
    redis = RedisServer()
    redis.start()
    os.environ[PROXY_CALLBACK_VARIABLE] = PROXY_CALLBACK  # every node (and so its proxy) starts with it
    # On one machine one node's proxy holds the port; a real cluster has a load balancer over every node's
    # proxy, each preferring its own node's replicas. Here the one proxy spreads over both nodes instead.
    os.environ[_PREFER_LOCAL] = "0"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for name in ("node_a", "node_b", "node_c"):  # two replicas, one per node; the third takes a lost one
        cluster.add_node(num_cpus=1, resources={name: 1})
    ray.init(address=cluster.address, logging_level="warning")
    port, grpc_port = free_port(), free_port()
    # One proxy, on the head (never removed): on one machine the nodes' proxies would share the port.
    serve.start(
        proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port},
        grpc_options={"port": grpc_port, "grpc_servicer_functions": [SERVICER_FUNCTION]},
    )  # fmt: skip
    served = settings.model_copy(update={"model_repository": small, "reload_interval_s": 1, "redis_url": redis.url})
    # A training job reserves half a CPU: it fits beside a replica, on any node.
    # `multi` is a group of its own: one replica, which the ingress replicas hand its requests.
    group = {"models": ["multi"], "replicas": 1, "replica_cpus": 0.25}
    # Both replicas also serve on one direct port: on one machine, the two "nodes" share it (SO_REUSEPORT).
    door = free_port()
    options = RayOptions(
        replicas=2, replica_cpus=0.5, max_replicas_per_node=1, job_cpus=0.5, groups={"multi": group}, direct_port=door
    )
    serve.run(build_app(served, options), name="layerserve", route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, 300)
        CLUSTERS[url] = cluster
        GRPC_PORTS[url] = grpc_port
        DOORS[url] = f"http://127.0.0.1:{door}"
        REDIS[url] = redis
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        redis.kill()
        del os.environ[PROXY_CALLBACK_VARIABLE], os.environ[_PREFER_LOCAL]
        deadline = time.monotonic() + 30
        while ray_processes() - before and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not ray_processes() - before, "Ray processes outlived the cluster's shutdown"


def test_every_replica_answers_as_keras_and_names_itself(cluster_url: str, repository: Path) -> None:
    mlp, multi = load_reference(repository, "mlp", 2), load_reference(repository, "multi", 1)
    rng = np.random.default_rng(8)
    replicas, nodes = set(), set()
    with httpx.Client(base_url=cluster_url, timeout=60) as client:
        for _ in range(40):
            x = rng.normal(size=(3, 10)).astype(np.float32)
            body = {"inputs": [{"name": "x", "shape": [3, 10], "datatype": "FP32", "data": x.ravel().tolist()}]}
            answer = client.post("/v2/models/mlp/infer", json=body)
            assert answer.status_code == 200, answer.text
            probs = np.array(answer.json()["outputs"][0]["data"], np.float32).reshape(3, 3)
            np.testing.assert_allclose(probs, np.asarray(mlp(x)), atol=1e-5)
            node, replica = answer.headers[REPLICA_HEADER].split("/")
            nodes.add(node)
            replicas.add(replica)
        features = rng.normal(size=(2, 4)).astype(np.float32)
        tokens = rng.integers(0, 10, (2, 3)).astype(np.int32)
        layer = client.post(
            "/v2/models/multi/infer",
            json={
                "inputs": [
                    {"name": "features", "shape": [2, 4], "datatype": "FP32", "data": features.ravel().tolist()},
                    {"name": "tokens", "shape": [2, 3], "datatype": "INT32", "data": tokens.ravel().tolist()},
                ],
                "outputs": [{"name": "joined"}],
            },
        )
        assert layer.status_code == 200, layer.text
        import keras

        joined = keras.Model(multi.inputs, multi.get_layer("joined").output)([features, tokens])
        got = np.array(layer.json()["outputs"][0]["data"], np.float32).reshape(2, -1)
        np.testing.assert_allclose(got, np.asarray(joined), atol=1e-5)
        assert client.get("/v2/models/mlp").json()["state"] == "READY"
        refused = client.post("/v2/models/mlp/infer", json={"inputs": [{"name": "x"}]})
        assert refused.status_code == 400 and "error" in refused.json()
    assert len(replicas) == 2 and len(nodes) == 2, (replicas, nodes)


def test_the_direct_port_reaches_every_replica_as_keras(cluster_url: str, repository: Path) -> None:
    mlp = load_reference(repository, "mlp", 2)
    x = np.random.default_rng(9).normal(size=(2, 10)).astype(np.float32)
    body = {"inputs": [{"name": "x", "shape": [2, 10], "datatype": "FP32", "data": x.ravel().tolist()}]}
    nodes = set()
    for _ in range(40):  # a new connection each time
        answer = httpx.post(f"{DOORS[cluster_url]}/v2/models/mlp/infer", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        probs = np.array(answer.json()["outputs"][0]["data"], np.float32).reshape(2, 3)
        np.testing.assert_allclose(probs, np.asarray(mlp(x)), atol=1e-5)
        nodes.add(answer.headers[REPLICA_HEADER].split("/")[0])
    assert len(nodes) == 2, nodes
    grouped = httpx.get(f"{DOORS[cluster_url]}/v2/models/multi", timeout=60)  # handed to the group's replica
    assert grouped.status_code == 200 and grouped.json()["state"] == "READY", grouped.text


def _replicas() -> list[tuple[int, str]]:
    """(pid, node id) of every live replica."""
    from ray.util.state import list_actors

    actors = list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
    name = f"ServeReplica:layerserve:{DEPLOYMENT_NAME}"
    return [(a.pid, a.node_id) for a in actors if a.class_name == name]


def _under_load(urls: list[str], fault: Callable[[], None]) -> list[tuple[list[int], list[tuple[float, str]]]]:
    """Statuses and client errors (seconds after the fault, error) of 4 closed-loop clients per URL over 8 s,
    `fault` done 2 s in."""
    x = np.ones((1, 10), np.float32)
    body = {"inputs": [{"name": "x", "shape": [1, 10], "datatype": "FP32", "data": x.ravel().tolist()}]}
    results: list[tuple[list[int], list[tuple[float, str]]]] = [([], []) for _ in urls]
    stop = threading.Event()
    faulted_at = [math.inf]

    def load(url: str, statuses: list[int], errors: list[tuple[float, str]]) -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            while not stop.is_set():
                try:
                    statuses.append(client.post("/v2/models/mlp/infer", json=body).status_code)
                except httpx.HTTPError as error:
                    errors.append((time.monotonic() - faulted_at[0], repr(error)))

    with ThreadPoolExecutor(4 * len(urls)) as pool:
        clients = [pool.submit(load, url, *result) for url, result in zip(urls, results, strict=True) for _ in range(4)]
        time.sleep(2)
        faulted_at[0] = time.monotonic()
        fault()
        time.sleep(6)
        stop.set()
        for client in clients:
            client.result()
    return results


def _door_reaches(door: str, want: int) -> set[str]:
    """The replicas that answer on the direct port, each request on a new connection (the kernel spreads
    connections over the replicas bound to the port), until `want` have answered."""
    seen: set[str] = set()
    deadline = time.monotonic() + 60
    while len(seen) < want and time.monotonic() < deadline:
        answer = httpx.get(f"{door}/v2/models/mlp", timeout=30)
        assert answer.status_code == 200, answer.text
        seen.add(answer.headers[REPLICA_HEADER])
    return seen


def _wait_back(url: str, gone: Callable[[list[tuple[int, str]]], bool]) -> list[tuple[int, str]]:
    """Wait until two replicas live again, none of them what `gone` names, the application is RUNNING and ready, and
    requests through the proxy reach both."""
    from ray import serve

    deadline = time.monotonic() + 120  # Ray starts a new replica, which loads the models again
    while time.monotonic() < deadline and (len(_replicas()) < 2 or gone(_replicas())):
        time.sleep(1)
    while time.monotonic() < deadline and serve.status().applications["layerserve"].status != "RUNNING":
        time.sleep(1)
    replicas = _replicas()
    assert len(replicas) == 2 and not gone(replicas), replicas
    # Readiness is every group's, as the board sees it: a group replica (or the board) that was on the lost node
    # starts again elsewhere and posts within a second of starting.
    while time.monotonic() < deadline and httpx.get(f"{url}/v2/health/ready", timeout=30).status_code != 200:
        time.sleep(0.5)
    assert httpx.get(f"{url}/v2/health/ready", timeout=30).status_code == 200
    # And the proxy routes to both again: its table of replicas follows the controller's a moment later.
    x = {"name": "x", "shape": [1, 10], "datatype": "FP32", "data": [0.5] * 10}
    answered: set[str] = set()
    with httpx.Client(base_url=url, timeout=30) as client:
        while len(answered) < 2 and time.monotonic() < deadline:
            answer = client.post("/v2/models/mlp/infer", json={"inputs": [x]})
            assert answer.status_code == 200, answer.text
            answered.add(answer.headers[REPLICA_HEADER])
            time.sleep(0.02)
    assert len(answered) == 2, answered
    return replicas


_VICTIM_EXIT_S = 2.0  # a killed replica's exit on a busy 2-core machine, its listening socket closed at its end


def test_a_replica_killed_under_load_fails_no_request(cluster_url: str) -> None:
    """Through Ray's proxy, none; on the direct port, only connections to the victim, lost while it dies: the
    requests in flight on them, and a new connection the kernel hands to its listening socket until its exit closes
    it (its memory is freed first); after that, every request reaches the replica left."""
    ((victim, _), *_) = _replicas()
    proxied, direct = _under_load([cluster_url, DOORS[cluster_url]], lambda: os.kill(victim, signal.SIGKILL))
    for statuses, _ in (proxied, direct):
        failed = [status for status in statuses if status != 200]
        assert len(statuses) > 50 and not failed, (len(statuses), failed[:5])
    assert not proxied[1], proxied[1][:5]
    # Reset or closed before an answer, or reset while httpx was still connecting: the kernel had completed the
    # handshake of a connection queued on the victim's listening socket, and its death reset it.
    lost = ("ReadError", "WriteError", "RemoteProtocolError", "ConnectError('[Errno 104] Connection reset by peer')")
    late = [
        (after, error) for after, error in direct[1] if not (0 <= after <= _VICTIM_EXIT_S and error.startswith(lost))
    ]
    assert not late, (late[:5], len(direct[1]))
    replicas = _wait_back(cluster_url, lambda replicas: victim in {pid for pid, _ in replicas})
    assert len(_door_reaches(DOORS[cluster_url], 2)) == 2, replicas  # the new replica opened the door again


def test_a_node_removed_under_load_fails_no_request(cluster_url: str) -> None:
    cluster = CLUSTERS[cluster_url]
    ((_, node_id), *_) = _replicas()
    (node,) = [n for n in cluster.list_all_nodes() if n.node_id == node_id]
    ((statuses, errors),) = _under_load([cluster_url], lambda: cluster.remove_node(node, allow_graceful=False))
    failed = [status for status in statuses if status != 200]
    assert len(statuses) > 50 and not failed and not errors, (len(statuses), failed[:5], errors[:5])
    replicas = _wait_back(cluster_url, lambda replicas: node_id in {node for _, node in replicas})
    assert len({node for _, node in replicas}) == 2  # back on the two nodes left


def _by_replica(client: httpx.Client, method: str, path: str, want: int = 2, **kwargs: Any) -> dict[str, Any]:
    """The answers of `want` distinct replicas to the same request (sent until each has answered)."""
    answers: dict[str, Any] = {}
    for _ in range(200):
        answer = client.request(method, path, **kwargs)
        assert answer.status_code == 200, answer.text
        answers.setdefault(answer.headers[REPLICA_HEADER], answer.json())
        if len(answers) == want:
            return answers
    raise AssertionError(f"only {len(answers)} replicas answered {path}")


def test_a_feature_cached_through_one_replica_is_a_hit_through_the_other(cluster_url: str) -> None:
    x = np.full((1, 10), 0.25, np.float32)
    body = {"inputs": [{"name": "x", "shape": [1, 10], "datatype": "FP32", "data": x.ravel().tolist()}]}
    with httpx.Client(base_url=cluster_url, timeout=60) as client:
        first = client.post("/v2/models/cached/infer", json=body)
        assert first.status_code == 200
        computed_by = first.headers[REPLICA_HEADER]
        answers = _by_replica(client, "POST", "/v2/models/cached/infer", json=body)
        assert len({orjson.dumps(a["outputs"]) for a in answers.values()}) == 1
        stats = _by_replica(client, "GET", "/v2/models/cached/versions/2/stats")
    other = next(replica for replica in stats if replica != computed_by)
    counts = stats[other]["model_stats"][0]["inference_stats"]
    assert counts["cache_hit"]["count"] >= 1 and counts["cache_miss"]["count"] == 0, counts


def test_a_new_version_is_served_by_every_replica_with_no_failed_request(
    cluster_url: str, ray_repository: Path, repository: Path
) -> None:
    version_1 = load_reference(repository, "mlp", 1)
    x = np.full((1, 10), 0.5, np.float32)
    body = {"inputs": [{"name": "x", "shape": [1, 10], "datatype": "FP32", "data": x.ravel().tolist()}]}
    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=cluster_url, timeout=60) as client:
            while not stop.is_set():
                statuses.append(client.post("/v2/models/mlp/infer", json=body).status_code)

    staged = ray_repository / "mlp" / ".staging"
    staged.mkdir()
    (staged / "model.keras").symlink_to(repository / "mlp" / "1" / "model.keras")
    with ThreadPoolExecutor(2) as pool, httpx.Client(base_url=cluster_url, timeout=60) as client:
        clients = [pool.submit(load) for _ in range(2)]
        time.sleep(1)
        staged.rename(ray_repository / "mlp" / "3")  # appears whole: version 3 is the latest
        deadline, versions = time.monotonic() + 60, {}
        while time.monotonic() < deadline:
            versions = {
                r: a["model_version"] for r, a in _by_replica(client, "POST", "/v2/models/mlp/infer", json=body).items()
            }
            if set(versions.values()) == {"3"}:
                break
            time.sleep(0.5)
        answer = client.post("/v2/models/mlp/infer", json=body).json()
        stop.set()
        for future in clients:
            future.result()
    assert set(versions.values()) == {"3"}, versions
    np.testing.assert_allclose(
        np.array(answer["outputs"][0]["data"], np.float32), np.asarray(version_1(x))[0], atol=1e-5
    )
    assert len(statuses) > 20 and set(statuses) == {200}, (len(statuses), sorted(set(statuses)))


def test_a_training_job_through_the_cluster_is_served_by_every_replica(cluster_url: str) -> None:
    texts, labels = rotten_tomatoes(300)
    body = {"dataset": {"texts": texts, "labels": labels}, "params": {"epochs": 2, "seed": 1}, "apply": True}
    with httpx.Client(base_url=cluster_url, timeout=60) as client:
        started = client.post("/v2/models/en_reviews/train", json=body)
        assert started.status_code == 202, started.text
        job_id = started.json()["job_id"]
        job = wait_for(cluster_url, job_id, {"succeeded", "failed", "cancelled"})
        assert job["state"] == "succeeded" and job["model_version"] == "1", job["error"]
        deadline, versions = time.monotonic() + 60, dict[str, str]()
        while time.monotonic() < deadline:  # the replica that did not train loads the version on its next poll
            answer = client.post("/v2/models/en_reviews/classify", json={"texts": [POSITIVE]})
            if answer.status_code in (404, 503):  # that replica has not found (404) or loaded (503) it yet
                assert "en_reviews" in answer.json()["error"], answer.text
            else:
                assert answer.status_code == 200, answer.text
                versions[answer.headers[REPLICA_HEADER]] = answer.json()["model_version"]
            if len(versions) == 2 and set(versions.values()) == {"1"}:
                break
            time.sleep(0.05)
        assert len(versions) == 2 and set(versions.values()) == {"1"}, versions
        listed = _by_replica(client, "GET", f"/v2/jobs/{job_id}")  # one job store (Redis), seen by every replica
        assert {answer["state"] for answer in listed.values()} == {"succeeded"}
    from ray.util.state import list_tasks

    trained = list_tasks(filters=[("func_or_class_name", "=", "_run_on_node")], limit=100)
    assert [task.state for task in trained] == ["FINISHED"], trained  # the job ran as a Ray task


def test_a_training_job_is_cancelled_through_any_replica(cluster_url: str) -> None:
    texts, labels = rotten_tomatoes(300)
    body = {"dataset": {"texts": texts, "labels": labels}, "params": {"epochs": 200, "patience": 200, "seed": 1}}
    with httpx.Client(base_url=cluster_url, timeout=60) as client:
        started = client.post("/v2/models/en_long/train", json=body)
        assert started.status_code == 202, started.text
        job_id, owner = started.json()["job_id"], started.headers[REPLICA_HEADER]
        deadline = time.monotonic() + 120
        while client.get(f"/v2/jobs/{job_id}").json()["progress"].get("epoch", 0) < 1:  # training, in its task
            assert time.monotonic() < deadline, client.get(f"/v2/jobs/{job_id}").json()
            time.sleep(0.2)
        for _ in range(200):  # sent until a replica that does not own the job takes it
            cancelled = client.post(f"/v2/jobs/{job_id}/cancel")
            assert cancelled.status_code == 200, cancelled.text
            if cancelled.headers[REPLICA_HEADER] != owner:
                break
        job = wait_for(cluster_url, job_id, {"succeeded", "failed", "cancelled"}, timeout_s=60)
        assert job["state"] == "cancelled", job
        assert client.get("/v2/models/en_long").status_code == 404  # no version was written


def _request_counts(url: str) -> dict[tuple[tuple[str, str], ...], float]:
    """layerserve_requests_total in the ingress's /metrics (every replica's, summed), by labels."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "layerserve_requests_total"
    }


def _requests_of(counts: dict[tuple[tuple[str, str], ...], float], model: str) -> float:
    """The requests of `model` in `counts` (every version, route and status)."""
    return sum(value for labels, value in counts.items() if dict(labels)["model"] == model)


def test_metrics_sum_every_replica_and_label_its_gauges(cluster_url: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    before, deadline = _request_counts(cluster_url), time.monotonic() + 30
    while time.monotonic() < deadline:  # every replica's last requests have reached the board (posts every second)
        time.sleep(1.5)
        settled = _request_counts(cluster_url)
        if _requests_of(settled, "mlp") == _requests_of(before, "mlp"):
            break
        before = settled
    x = np.ones((1, 10), np.float32)
    body = {"inputs": [{"name": "x", "shape": [1, 10], "datatype": "FP32", "data": x.ravel().tolist()}]}
    answered_by: Counter[str] = Counter()
    with httpx.Client(base_url=cluster_url, timeout=60) as client:
        for _ in range(30):
            answer = client.post("/v2/models/mlp/infer", json=body)
            assert answer.status_code == 200, answer.text
            answered_by[answer.headers[REPLICA_HEADER]] += 1
    assert len(answered_by) == 2
    deadline = time.monotonic() + 30  # the other replica's counts reach the board within a second (or a few, loaded)
    after = _request_counts(cluster_url)
    while _requests_of(after, "mlp") - _requests_of(before, "mlp") < 30 and time.monotonic() < deadline:
        time.sleep(0.5)
        after = _request_counts(cluster_url)
    changed = {labels: after.get(labels, 0) - before.get(labels, 0) for labels in {*before, *after}}
    changed = {labels: change for labels, change in changed.items() if change}  # which series moved, if it fails
    assert _requests_of(after, "mlp") - _requests_of(before, "mlp") == 30, (changed, answered_by)
    text = httpx.get(f"{cluster_url}/metrics", timeout=30).text
    memory = [
        sample.labels
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "process_resident_memory_bytes"
    ]
    labelled = {f"{labels['node']}/{labels['replica']}" for labels in memory}
    assert set(answered_by) <= labelled, (answered_by, labelled)


def test_apply_unload_and_load_answer_once_every_replica_made_them(cluster_url: str) -> None:
    x = np.full((1, 10), 0.5, np.float32)
    body = {"inputs": [{"name": "x", "shape": [1, 10], "datatype": "FP32", "data": x.ravel().tolist()}]}
    with httpx.Client(base_url=cluster_url, timeout=120) as client:
        applied = client.post("/v2/models/mlp/versions/1/apply")
        assert applied.status_code == 200, applied.text
        served = _by_replica(client, "POST", "/v2/models/mlp/infer", json=body)  # at once: no poll waited for
        assert {answer["model_version"] for answer in served.values()} == {"1"}, served
        unpinned = client.post("/v2/models/mlp/apply", json={"version": "latest"})
        assert unpinned.status_code == 200, unpinned.text
        served = _by_replica(client, "POST", "/v2/models/mlp/infer", json=body)
        assert len({answer["model_version"] for answer in served.values()}) == 1
        assert "1" not in {answer["model_version"] for answer in served.values()}, served

        unloaded = client.post("/v2/repository/models/cached/unload")
        assert unloaded.status_code == 200, unloaded.text
        refused: dict[str, int] = {}
        for _ in range(200):
            answer = client.post("/v2/models/cached/infer", json=body)
            refused[answer.headers[REPLICA_HEADER]] = answer.status_code
            if len(refused) == 2:
                break
        assert len(refused) == 2 and set(refused.values()) <= {404, 503}, refused
        loaded = client.post("/v2/repository/models/cached/load")
        assert loaded.status_code == 200, loaded.text
        assert len(_by_replica(client, "POST", "/v2/models/cached/infer", json=body)) == 2


def test_grpc_through_ray_serves_every_replica_as_keras(cluster_url: str, repository: Path) -> None:
    import grpc
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc
    from tritonclient.utils import InferenceServerException

    # `cached` serves mlp's version 2 (the tests before moved mlp's own versions on)
    mlp, address = load_reference(repository, "mlp", 2), f"127.0.0.1:{GRPC_PORTS[cluster_url]}"
    client = grpcclient.InferenceServerClient(address)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("cached", "2")
    assert [t.name for t in client.get_model_metadata("cached", "2").inputs] == ["x"]
    x = np.random.default_rng(3).normal(size=(4, 10)).astype(np.float32)
    tensor = grpcclient.InferInput("x", [4, 10], "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer("cached", [tensor], model_version="2")
    output = result.get_response().outputs[0].name
    np.testing.assert_allclose(result.as_numpy(output), np.asarray(mlp(x)), atol=1e-5)
    with pytest.raises(InferenceServerException) as unknown:
        client.infer("no_such_model", [tensor])
    assert unknown.value.status() == "StatusCode.NOT_FOUND" and "no_such_model" in unknown.value.message()
    wrong = grpcclient.InferInput("x", [4, 10], "INT32")
    wrong.set_data_from_numpy(x.astype(np.int32))
    with pytest.raises(InferenceServerException) as refused:
        client.infer("cached", [wrong], model_version="2")
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT" and "FP32" in refused.value.message()
    assert client.is_server_live()  # the same connection serves on

    replicas: set[str] = set()
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name="cached", model_version="2")
        request.inputs.add(name="x", datatype="FP32", shape=[4, 10])
        request.raw_input_contents.append(x.tobytes())
        for _ in range(40):
            _, call = stub.ModelInfer.with_call(request)
            replicas.update(value for key, value in call.trailing_metadata() if key == REPLICA_HEADER)
            if len(replicas) == 2:
                break
    assert len(replicas) == 2, replicas

    stream = grpcclient.InferenceServerClient(address)
    answers: list[Any] = []
    stream.start_stream(callback=lambda result, error: answers.append(error or result))
    for _ in range(3):
        stream.async_stream_infer("cached", [tensor], model_version="2")
    stream.stop_stream()
    assert len(answers) == 3 and all(not isinstance(a, Exception) for a in answers), answers
    np.testing.assert_allclose(answers[0].as_numpy(output), np.asarray(mlp(x)), atol=1e-5)


def test_a_group_serves_its_models_behind_the_ingress(cluster_url: str) -> None:
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc

    features, tokens = np.ones((2, 4), np.float32), np.ones((2, 3), np.int32)
    inputs = [
        {"name": "features", "shape": [2, 4], "datatype": "FP32", "data": features.ravel().tolist()},
        {"name": "tokens", "shape": [2, 3], "datatype": "INT32", "data": tokens.ravel().tolist()},
    ]
    with httpx.Client(base_url=cluster_url, timeout=60) as client:
        mlp = _by_replica(client, "GET", "/v2/models/mlp/ready")  # the two ingress replicas
        group = {
            client.post("/v2/models/multi/infer", json={"inputs": inputs}).headers[REPLICA_HEADER] for _ in range(10)
        }
        assert len(group) == 1 and not group & set(mlp), (group, set(mlp))  # multi's one replica, of its own
        assert client.get("/v2/models/multi").json()["state"] == "READY"
        assert client.get("/v1/models/multi").status_code == 200  # TF Serving's paths go to the group too
        refused = client.post("/v2/models/multi/infer", json={"inputs": inputs[:1]})
        assert refused.status_code == 400 and "tokens" in refused.json()["error"]
        index = client.post("/v2/repository/index", json={}).json()  # every group's models in one list
        assert {"cached", "mlp", "multi"} <= {row["name"] for row in index}, index
        stats = client.get("/v2/models/stats").json()["model_stats"]
        assert {"mlp", "multi"} <= {row["name"] for row in stats}
        assert client.get("/v2/health/ready").status_code == 200  # every group has a ready replica
        labelled = client.get("/metrics").text
        overview = client.get("/v2/overview").json()  # the console's document: every group's models, every replica
    assert {"cached", "mlp", "multi"} <= {row["name"] for row in overview["models"]}, overview["models"]
    assert len([p for p in overview["processes"] if "/" in p["id"]]) >= 3, overview["processes"]
    (replica,) = group
    assert f'replica="{replica.split("/")[1]}"' in labelled  # the group's replica posts its metrics too

    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORTS[cluster_url]}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name="multi")
        request.inputs.add(name="features", datatype="FP32", shape=[2, 4]).contents.fp32_contents.extend(
            features.ravel()
        )
        request.inputs.add(name="tokens", datatype="INT32", shape=[2, 3]).contents.int_contents.extend(tokens.ravel())
        answer, call = stub.ModelInfer.with_call(request)
        assert answer.model_name == "multi" and dict(call.trailing_metadata())[REPLICA_HEADER] == replica
        index = stub.RepositoryIndex(pb.RepositoryIndexRequest())
        assert {"mlp", "multi"} <= {row.name for row in index.models}
        with pytest.raises(grpc.RpcError) as refused_call:
            stub.ModelInfer(pb.ModelInferRequest(model_name="multi"))
        assert refused_call.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_redis_gone_is_cache_misses_and_job_routes_503(cluster_url: str, repository: Path) -> None:
    mlp, redis = load_reference(repository, "mlp", 2), REDIS[cluster_url]
    x = np.full((1, 10), 0.75, np.float32)
    body = {"inputs": [{"name": "x", "shape": [1, 10], "datatype": "FP32", "data": x.ravel().tolist()}]}
    redis.kill()
    try:
        with httpx.Client(base_url=cluster_url, timeout=60) as client:
            answers = _by_replica(client, "POST", "/v2/models/cached/infer", json=body)  # computed: misses
            for answer in answers.values():
                np.testing.assert_allclose(answer["outputs"][0]["data"], np.asarray(mlp(x))[0], atol=1e-5)
            jobs = client.get("/v2/jobs")
            assert jobs.status_code == 503 and "Redis" in jobs.json()["error"], jobs.text
    finally:
        redis.start()  # on its port again: the replicas' clients reconnect
    with httpx.Client(base_url=cluster_url, timeout=60) as client:
        deadline = time.monotonic() + 30
        while client.get("/v2/jobs").status_code != 200:
            assert time.monotonic() < deadline, "the job records did not come back with Redis"
            time.sleep(0.5)
