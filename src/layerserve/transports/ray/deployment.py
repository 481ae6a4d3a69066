"""build_app: a model repository as a Ray Serve application, for `layerserve ray serve` and for users who
compose their own Ray Serve application."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from layerserve.settings import Settings
from layerserve.transports.ray.board import BOARD_NAME, Board
from layerserve.transports.ray.options import DEPLOYMENT_NAME, RayOptions

if TYPE_CHECKING:
    from layerserve.dataplane import DataPlane

log = logging.getLogger(__name__)

__all__ = ["DEPLOYMENT_NAME", "RayOptions", "build_app"]


def _served(settings: Settings, models: str) -> str:
    """The settings' JSON for replicas that serve `models` (patterns, see the setting)."""
    return settings.model_copy(update={"models": models}).model_dump_json()


def _routing(model_affinity: bool) -> dict[str, Any]:
    """The deployments' request router: ModelAffinityRouter (model_router.py), or Ray Serve's own."""
    if not model_affinity:
        return {}
    from layerserve.transports.ray.affinity import ROUTING_STATS_PERIOD_S
    from layerserve.transports.ray.model_router import ModelAffinityRouter

    config = {"request_router_class": ModelAffinityRouter, "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S}
    return {"request_router_config": config}


def build_app(settings: Settings, options: RayOptions | None = None) -> Any:
    """The Ray Serve application (`serve.run(build_app(settings))`): the ingress deployment's replicas serve
    every model of `settings.model_repository` that is in no group, with the whole HTTP API and, through Ray
    Serve's gRPC proxy, GRPCInferenceService (see build_replica, grpc_ingress.py), and on `direct_port` too
    when set (served by each replica itself); each group's deployment serves its models, the ingress handing it
    their requests (group_router.py); a board keeps them in step. With `options.model_affinity`, the requests for a
    model go to a replica that holds it (affinity.py, model_router.py).

    The repository must be a path every node sees (shared storage); each replica loads its models itself.
    """
    from ray import serve

    from layerserve.transports.grpc.servicer import InferenceServicer
    from layerserve.transports.ray.affinity import routing_stats
    from layerserve.transports.ray.group_replica import GroupReplica
    from layerserve.transports.ray.group_router import GroupRouter
    from layerserve.transports.ray.grpc_ingress import GrpcMethods
    from layerserve.transports.ray.replica import build_replica

    chosen = options or RayOptions()
    counts = [chosen, *chosen.groups.values()]
    if any(c.replicas > 1 or (c.autoscaling and c.autoscaling.max > 1) for c in counts) and not settings.redis_url:
        log.warning(
            "several replicas and no redis_url: each replica has a feature cache and store of its own (a feature "
            "stored through one is not found through another); set redis_url to share them"
        )
    names = (DEPLOYMENT_NAME, *chosen.groups)
    excluded = [f"!{pattern}" for group in chosen.groups.values() for pattern in group.models]
    ingress_json = _served(settings, ",".join(filter(None, [settings.models, *excluded])))
    logs = {"enable_access_log": False}  # layerserve's own access log (access_log) has the details
    handed = [pattern for group in chosen.groups.values() for pattern in group.models]

    class LayerserveReplica(GrpcMethods):
        """One ingress replica (see build_replica), with handles of the board and of every group; HTTP through
        its app, gRPC through its methods (Ray Serve's gRPC proxy)."""

        def __init__(self, board: Any, groups: dict[str, Any]) -> None:
            self._board = board
            self._grpc_groups = (chosen, groups)
            self._servicer: InferenceServicer | None = None
            self._data: DataPlane | None = None

        def __serve_build_asgi_app__(self) -> Any:  # runs in each replica, when it starts
            handles = self._grpc_groups[1]
            route = (lambda app: GroupRouter(app, chosen, handles)) if chosen.groups else None
            server, self._grpc_identity = build_replica(
                ingress_json, self._board, groups=names, job_cpus=chosen.job_cpus, wrap_app=route,
                direct_port=chosen.direct_port or 0,
            )  # fmt: skip
            self._servicer, self._data = server.servicer, server.data
            return server.app

        async def record_routing_stats(self) -> dict[str, Any]:  # Ray Serve's controller asks for them
            """The models this replica holds, and those it hands to groups (see affinity.py)."""
            return {} if self._data is None else routing_stats(self._data.index(), settings.loads_on_demand, handed)

        def _grpc_servicer(self) -> InferenceServicer:
            assert self._servicer is not None, "the replica has not started"
            return self._servicer

    board = serve.deployment(
        name=BOARD_NAME, num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000,
        logging_config=logs,
    )(Board).bind()  # fmt: skip
    routing = _routing(chosen.model_affinity)
    groups = {
        name: serve.deployment(
            name=f"{DEPLOYMENT_NAME}-{name}", logging_config=logs, **routing, **group.deployment_options()
        )(GroupReplica).bind(board, _served(settings, ",".join(group.models)), name, names, chosen.job_cpus)
        for name, group in chosen.groups.items()
    }
    ingress = serve.deployment(name=DEPLOYMENT_NAME, logging_config=logs, **routing, **chosen.deployment_options())(
        serve.ingress()(LayerserveReplica)
    )
    return ingress.bind(board, groups)
