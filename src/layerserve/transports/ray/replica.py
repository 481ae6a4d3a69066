"""What one Ray Serve replica runs: a Server of its own (its app for HTTP, its servicer for the gRPC methods), every
answer naming the replica."""

from __future__ import annotations

from typing import Any

from layerserve.logs import configure_logging
from layerserve.server import AppWrapper, Server
from layerserve.settings import Settings
from layerserve.training.launchers import RayLauncher
from layerserve.transports.ray.options import DEPLOYMENT_NAME
from layerserve.transports.ray.peers import RayPeers

REPLICA_HEADER = "layerserve-replica"
TELL_TIMEOUT_S = 120.0  # a load or apply asked of one replica waits this long for the others to make it


def replica_identity() -> str:
    """`<node id>/<replica id>` of the replica this code runs in (Ray's node id, Serve's replica id)."""
    import ray
    from ray import serve

    return f"{ray.get_runtime_context().get_node_id()}/{serve.get_replica_context().replica_id.unique_id}"


def build_replica(settings_json: str, board: Any = None, identity: str | None = None, group: str = DEPLOYMENT_NAME,
                  groups: tuple[str, ...] = (DEPLOYMENT_NAME,), job_cpus: float = 1.0,
                  wrap_app: AppWrapper | None = None, direct_port: int = 0) -> tuple[Server, str]:  # fmt: skip
    """One replica's server: it loads every model before the replica takes traffic (Ray Serve runs the app's
    lifespan when the replica starts, and `settle_first`); one worker, no gRPC door of its own (Ray's gRPC proxy
    calls the servicer); every answer says `layerserve-replica: <identity>`. With the deployment's `board` (a
    handle), its loads, unloads and applies reach every replica, and /metrics and readiness cover them all (see
    peers.py). Its training jobs run as Ray tasks reserving `job_cpus` (see training/launchers.py). `wrap_app`
    routes a group's requests to it (group_router.py); `direct_port`, when given, is served by the replica itself
    too. Returns the server and the replica's identity."""
    settings = Settings.model_validate_json(settings_json).model_copy(update={"workers": 1, "grpc_port": 0})
    configure_logging(settings.log_level, settings.log_format, settings.log_file)
    identity = identity or replica_identity()
    peers = None if board is None else RayPeers(board, identity, group, groups, TELL_TIMEOUT_S)
    server = Server(
        settings, peers=peers, launcher=RayLauncher(job_cpus), settle_first=True,
        answer_headers=((REPLICA_HEADER.encode(), identity.encode()),), wrap_app=wrap_app, direct_port=direct_port,
    )  # fmt: skip
    return server, identity
