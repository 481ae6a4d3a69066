"""build_app: a model repository as a Ray Serve application, for `layerserve ray serve` and for users who
compose their own Ray Serve application."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from layerserve.settings import Settings
from layerserve.transports.ray.board import BOARD_NAME, Board

log = logging.getLogger(__name__)

DEPLOYMENT_NAME = "layerserve"


@dataclass(frozen=True)
class RayOptions:
    """How many replicas, what each one reserves of its node (Ray resources) and how many may share a node
    (0: no limit); the CPUs each training job's Ray task reserves, on whichever node has them."""

    replicas: int = 1
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    job_cpus: float = 1.0
    max_ongoing_requests: int = 256
    max_replicas_per_node: int = 0
    resources: tuple[tuple[str, float], ...] = ()


def build_app(settings: Settings, options: RayOptions | None = None) -> Any:
    """The Ray Serve application (`serve.run(build_app(settings))`): `options.replicas` replicas, each serving
    every model of `settings.model_repository` with the whole HTTP API and, through Ray Serve's gRPC proxy,
    GRPCInferenceService (see build_replica, grpc_ingress.py).

    The repository must be a path every node sees (shared storage); each replica loads every model itself.
    """
    from ray import serve

    from layerserve.transports.grpc.servicer import InferenceServicer
    from layerserve.transports.ray.grpc_ingress import GrpcMethods
    from layerserve.transports.ray.replica import build_replica

    chosen = options or RayOptions()
    if chosen.replicas > 1 and not settings.redis_url:
        log.warning(
            "%d replicas and no redis_url: each replica has a feature cache and store of its own (a feature stored "
            "through one is not found through another); set redis_url to share them", chosen.replicas,
        )  # fmt: skip
    settings_json = settings.model_dump_json()

    class LayerserveReplica(GrpcMethods):
        """One replica (see build_replica), with a handle of the deployment's board; HTTP through its app, gRPC
        through its methods (Ray Serve's gRPC proxy)."""

        def __init__(self, board: Any) -> None:
            self._board = board
            self._servicer: InferenceServicer | None = None

        def __serve_build_asgi_app__(self) -> Any:  # runs in each replica, when it starts
            replica = build_replica(settings_json, self._board, job_cpus=chosen.job_cpus)
            self._servicer, self._grpc_identity = replica.grpc, replica.identity
            return replica.app

        def _grpc_servicer(self) -> InferenceServicer:
            assert self._servicer is not None, "the replica has not started"
            return self._servicer

    actor_options: dict[str, Any] = {"num_cpus": chosen.replica_cpus, "num_gpus": chosen.replica_gpus}
    if chosen.resources:
        actor_options["resources"] = dict(chosen.resources)
    placement: dict[str, Any] = (
        {"max_replicas_per_node": chosen.max_replicas_per_node} if chosen.max_replicas_per_node else {}
    )
    deployment = serve.deployment(
        name=DEPLOYMENT_NAME,
        **placement,
        num_replicas=chosen.replicas,
        ray_actor_options=actor_options,
        max_ongoing_requests=chosen.max_ongoing_requests,
        logging_config={"enable_access_log": False},  # layerserve's own access log (access_log) has the details
    )(serve.ingress()(LayerserveReplica))
    board = serve.deployment(
        name=BOARD_NAME, num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000,
        logging_config={"enable_access_log": False},
    )(Board)  # fmt: skip
    return deployment.bind(board.bind())
