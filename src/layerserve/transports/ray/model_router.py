"""ModelAffinityRouter: the request router of layerserve's deployments (Ray Serve's public RequestRouter): a
request that names a model goes to a replica that holds it (see affinity.py)."""

from __future__ import annotations

import time
from fnmatch import fnmatchcase
from typing import Any

from ray.serve.request_router import LocalityMixin, PendingRequest, RequestRouter, RunningReplica

from layerserve.transports.ray.affinity import HANDED, HELD, ON_DEMAND, patiently, ranks


class ModelAffinityRouter(LocalityMixin, RequestRouter):
    """Ranks the replicas for each request by the model it names (its multiplexed model id) and the models each
    replica holds (its routing stats); a request that names none, or a model handed to a group, is spread as Ray
    Serve's own router spreads it (replicas of the router's node first, if preferred; two at random). For the first
    PATIENCE_S after it came, a request tries only its model's holders and owner while one is not known to be full
    (Ray's router asks them again, with longer deadlines)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._holders: dict[str, list[str]] = {}
        self._handed: tuple[str, ...] = ()
        self._on_demand = False

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Take the running replicas (Ray calls it when they or their routing stats change) and index who holds
        which model."""
        super().update_replicas(replicas)
        holders: dict[str, list[str]] = {}
        handed: set[str] = set()
        on_demand = False
        for replica in replicas:
            stats = replica.routing_stats
            on_demand = on_demand or bool(stats.get(ON_DEMAND))
            for model in stats.get(HELD, ()):
                holders.setdefault(model, []).append(replica.replica_id.unique_id)
            handed.update(stats.get(HANDED, ()))
        self._holders, self._handed, self._on_demand = holders, tuple(sorted(handed)), on_demand

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """The ranks of replicas to try (see affinity.ranks)."""
        spread = [replica.unique_id for replica in self.apply_locality_routing(pending_request)]
        model = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if model and any(fnmatchcase(model, pattern) for pattern in self._handed):
            model = ""  # the ingress replicas only hand it on: any of them will do
        live = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        tried = ranks(model, live, self._holders.get(model, ()), spread, self._on_demand)
        if pending_request is None:
            return tried
        return patiently(tried, time.time() - pending_request.created_at, self.select_available_replicas)
