"""What one Ray Serve replica runs: create_app and the gRPC servicer over its own Runtime, every answer naming
the replica."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from layerserve.logs import configure_logging
from layerserve.runtime import Runtime
from layerserve.settings import Settings
from layerserve.training.launchers import RayLauncher
from layerserve.transports.grpc.calls import CallGuard
from layerserve.transports.grpc.servicer import InferenceServicer, ServingState
from layerserve.transports.http.app import create_app
from layerserve.transports.ray.deployment import DEPLOYMENT_NAME
from layerserve.transports.ray.peers import RayPeers

REPLICA_HEADER = "layerserve-replica"
TELL_TIMEOUT_S = 120.0  # a load or apply asked of one replica waits this long for the others to make it


def replica_identity() -> str:
    """`<node id>/<replica id>` of the replica this code runs in (Ray's node id, Serve's replica id)."""
    import ray
    from ray import serve

    return f"{ray.get_runtime_context().get_node_id()}/{serve.get_replica_context().replica_id.unique_id}"


class ReplicaHeaderMiddleware:
    """Adds `layerserve-replica: <node id>/<replica id>` to every HTTP answer (lifespan passes through), and to
    the answers of the app's direct lane, whose `state` it shows the server (a replica's direct door, see
    direct_door.py)."""

    def __init__(self, app: ASGIApp, identity: str) -> None:
        self._app = app
        self._header = (REPLICA_HEADER.encode(), identity.encode())
        self.state = getattr(app, "state", None)
        lane = getattr(self.state, "direct_lane", None)
        if lane is not None:
            lane.add_answer_header(REPLICA_HEADER, identity)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self._header]}
            await send(message)

        await self._app(scope, receive, send_with_header)


@dataclass(frozen=True)
class Replica:
    """What one replica serves: the ASGI app (HTTP), the servicer its gRPC methods run, and who it is."""

    app: ASGIApp
    grpc: InferenceServicer
    identity: str


def build_replica(settings_json: str, board: Any = None, identity: str | None = None, group: str = DEPLOYMENT_NAME,
                  groups: tuple[str, ...] = (DEPLOYMENT_NAME,), job_cpus: float = 1.0) -> Replica:  # fmt: skip
    """One replica: its runtime loads every model before the replica takes traffic (Ray Serve runs the app's
    lifespan when the replica starts); one worker, no gRPC door of its own (Ray's gRPC proxy calls the
    servicer). With the deployment's `board` (a handle), its loads, unloads and applies reach every replica,
    and /metrics and readiness cover them all (see peers.py). Its training jobs run as Ray tasks reserving
    `job_cpus` (see training/launchers.py)."""
    settings = Settings.model_validate_json(settings_json).model_copy(update={"workers": 1, "grpc_port": 0})
    configure_logging(settings.log_level, settings.log_format, settings.log_file)
    identity = identity or replica_identity()
    peers = None if board is None else RayPeers(board, identity, group, groups, TELL_TIMEOUT_S)
    runtime = Runtime(settings, settle_first=True, peers=peers, launcher=RayLauncher(job_cpus))
    state = ServingState(runtime.data, runtime.control, lambda: runtime.is_ready, settings.max_body_bytes)
    servicer = InferenceServicer(state, CallGuard(settings.admin_token, settings.api_token, settings.access_log))
    return Replica(ReplicaHeaderMiddleware(create_app(runtime), identity), servicer, identity)
