"""The direct port without a cluster: two replicas' servers started as Ray Serve starts them (their app's lifespan,
run by uvicorn as Ray does) share one direct port; their answers (the lane's and the app's) equal Keras and name the
replica; a bad request is a 400 there too; a replica's shutdown closes its door and leaves the other's; a port held
by another program fails the replica's start, saying so."""

from __future__ import annotations

import errno
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import uvicorn
from uvicorn.lifespan.on import LifespanOn

from layerserve.server import Server
from layerserve.settings import Settings
from layerserve.transports.http.lane import DirectLane
from layerserve.transports.ray.replica import REPLICA_HEADER, build_replica
from tests.live_server import free_port
from tests.models import load_reference

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def mlp_settings(repository: Path, settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    small = tmp_path_factory.mktemp("door-repo")
    (small / "mlp").symlink_to(repository / "mlp")
    return settings.model_copy(update={"model_repository": small, "reload_interval_s": 0, "host": "127.0.0.1"})


@asynccontextmanager
async def replica_with_door(settings: Settings, identity: str, port: int) -> AsyncIterator[Server]:
    """A replica's server with its direct port, its app's lifespan run as Ray Serve runs it; shut down on leaving."""
    server, _ = build_replica(settings.model_dump_json(), identity=identity, direct_port=port)
    lifespan = LifespanOn(uvicorn.Config(server.app, lifespan="on", log_config=None))
    await lifespan.startup()
    try:
        assert not lifespan.startup_failed, "the replica's startup failed"  # Ray Serve fails such a replica
        yield server
    finally:
        await lifespan.shutdown()


def _infer_body(x: np.ndarray) -> dict[str, object]:
    return {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}


async def test_replicas_share_the_direct_port_and_answer_as_keras(
    mlp_settings: Settings, repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lane_answers: list[str] = []  # the paths the lane answered, below the app
    serve = DirectLane.serve

    async def counting(self: DirectLane, cycle: Any, target: Any) -> None:
        lane_answers.append(cycle.scope["path"])
        await serve(self, cycle, target)

    monkeypatch.setattr(DirectLane, "serve", counting)
    mlp = load_reference(repository, "mlp", 2)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    rng = np.random.default_rng(3)
    async with (
        replica_with_door(mlp_settings, "node-a/one", port) as one,
        replica_with_door(mlp_settings, "node-a/two", port) as two,
    ):
        seen = set()
        for _ in range(24):  # a new connection each time: the kernel picks a replica per connection
            # identity: an answer the app would compress goes through it, not the lane
            async with httpx.AsyncClient(base_url=url, timeout=30, headers={"accept-encoding": "identity"}) as client:
                x = rng.normal(size=(2, 10)).astype(np.float32)
                answer = await client.post("/v2/models/mlp/infer", json=_infer_body(x))  # the direct lane
                assert answer.status_code == 200, answer.text
                probs = np.array(answer.json()["outputs"][0]["data"], np.float32).reshape(2, 3)
                np.testing.assert_allclose(probs, np.asarray(mlp(x)), atol=1e-5)
                assert answer.headers.get_list(REPLICA_HEADER) == [answer.headers[REPLICA_HEADER]]  # once
                seen.add(answer.headers[REPLICA_HEADER])
                metadata = await client.get("/v2/models/mlp")  # through the app
                assert metadata.json()["inputs"][0]["name"] == "x" and REPLICA_HEADER in metadata.headers
                bad = await client.post("/v2/models/mlp/infer", json=_infer_body(x[:, :4]))
                assert bad.status_code == 400 and "shape" in bad.json()["error"], bad.text
                assert bad.headers[REPLICA_HEADER] in ("node-a/one", "node-a/two")
        assert seen == {"node-a/one", "node-a/two"}
        assert lane_answers.count("/v2/models/mlp/infer") == 48  # every infer on the replicas' lanes
        assert one.http.state.total_requests and two.http.state.total_requests
        async with replica_with_door(mlp_settings, "node-a/three", port):
            pass  # started and stopped beside the others: their door stays open
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            assert (await client.get("/v2/health/ready")).status_code == 200
    with pytest.raises(httpx.ConnectError), httpx.Client(base_url=url, timeout=5) as client:
        client.get("/v2/health/live")  # both replicas stopped: the door is closed


async def test_a_port_held_by_another_program_fails_the_replicas_start(
    mlp_settings: Settings, capfd: pytest.CaptureFixture[str]
) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))  # no SO_REUSEPORT: the door cannot share it
    held.listen()
    port = held.getsockname()[1]
    try:
        with pytest.raises(AssertionError, match="startup failed"):
            async with replica_with_door(mlp_settings, "node-a/one", port):
                pass
        assert f"the direct port: [Errno {errno.EADDRINUSE}]" in capfd.readouterr().err  # uvicorn's error log
    finally:
        held.close()
