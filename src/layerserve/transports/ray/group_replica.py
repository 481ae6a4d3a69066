"""GroupReplica: a replica of one group (its models only), answering the HTTP requests and gRPC calls the
ingress replicas hand it (see group_router.py); it posts to the board like any replica."""

from __future__ import annotations

from typing import Any

from layerserve.transports.ray.affinity import routing_stats
from layerserve.transports.ray.grpc_ingress import run_captured
from layerserve.transports.ray.in_process import Lifespan, PlainRequest, PlainResponse, call_app
from layerserve.transports.ray.replica import build_replica


class GroupReplica:
    """Loads its group's models before Ray routes to it (its constructor runs the app's startup)."""

    async def __init__(  # type: ignore[misc]  # Ray Serve awaits an async constructor
        self, board: Any, settings_json: str, group: str, groups: tuple[str, ...], job_cpus: float
    ) -> None:
        self._server, self._identity = build_replica(
            settings_json, board, group=group, groups=groups, job_cpus=job_cpus
        )
        self._lifespan = Lifespan(self._server.app)
        await self._lifespan.start()

    async def handle_http(self, request: PlainRequest) -> PlainResponse:
        """Answer one HTTP request the ingress received."""
        return await call_app(self._server.app, request)

    async def handle_grpc(self, name: str, request: Any, metadata: Any) -> Any:
        """Run one RPC the ingress received: (answer or None, status or None, details, this replica)."""
        return await run_captured(self._server.servicer, name, request, metadata, self._identity)

    async def record_routing_stats(self) -> dict[str, Any]:
        """The models this replica holds (Ray Serve's controller asks for them; see affinity.py)."""
        return routing_stats(self._server.data.index(), self._server.settings.loads_on_demand)

    async def __del__(self) -> None:  # Ray Serve awaits it when it stops the replica
        await self._lifespan.stop()
