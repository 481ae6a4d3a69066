"""Model affinity on Ray Serve: a request for a model goes to a replica that holds it, so that replicas with a
memory budget do not each load every model.

Public pieces of Ray Serve carry it. Ray's HTTP proxy hands the header `serve_multiplexed_model_id` to the
deployment's request router as the request's multiplexed model id: NameModel, one of the proxy's middlewares
(retry.proxy_middlewares), sets it to the model the path names. Each replica reports the models it holds (or is
loading) in its routing stats (`record_routing_stats`, which Ray Serve's controller asks every replica for and
hands every router). The deployment's router (model_router.py) tries, in turn, the replicas that hold the model
(the less busy of two), the model's owner (rendezvous hashing of the model over the replicas: every router agrees
on it, and new models spread over the replicas; only where replicas load models on demand, under a memory budget),
then any replica as Ray Serve's own router would. A model every replica holds, or none (without a budget), is
spread as before. Nothing is loaded by Ray: loading and eviction stay the runtime's.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from starlette.types import ASGIApp, Receive, Scope, Send

from layerserve.messages import RepositoryEntry
from layerserve.transports.ray.group_router import model_of_path

MODEL_HEADER = b"serve_multiplexed_model_id"  # Ray Serve's proxy routes by it (handle option multiplexed_model_id)
HELD = "held"  # routing stats: the models a replica holds or is loading
HANDED = "handed"  # routing stats: the patterns of the models an ingress replica hands to a group
ON_DEMAND = "on_demand"  # routing stats: whether the replica loads models on their first request (a memory budget)
ROUTING_STATS_PERIOD_S = 1.0  # how often Ray Serve's controller asks each replica for its routing stats
# How long a request waits for a replica that holds its model (or its owner) before any replica will do: Ray's router
# skips a replica that does not answer its queue-length probe in 0.1 s (a busy replica on a loaded machine), and a
# model sent elsewhere once is then held twice. Ray Serve's own multiplexing waits as long for its model's replicas.
# Counted from the request's arrival at the router: one that waited that long for a routing task goes anywhere.
PATIENCE_S = 1.0
_HOLDING = ("READY", "LOADING")

Replica = TypeVar("Replica")


class NameModel:
    """Wraps Ray Serve's HTTP proxy: a request whose path names a model (V2, repository, TF Serving) carries its
    name in MODEL_HEADER, which the proxy hands to the deployment's router."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (model := model_of_path(scope["path"])):
            scope = {**scope, "headers": [*scope["headers"], (MODEL_HEADER, model.encode())]}
        await self._app(scope, receive, send)


def routing_stats(index: Iterable[RepositoryEntry], on_demand: bool, handed: Sequence[str] = ()) -> dict[str, Any]:
    """A replica's routing stats: the models of its index that it holds or is loading, whether it loads models on
    demand, and the patterns of the models it hands to groups (an ingress replica's)."""
    held = sorted({row.name for row in index if row.state in _HOLDING})
    return {HELD: held, ON_DEMAND: on_demand, HANDED: list(handed)}


def owner(model: str, replicas: Iterable[str]) -> str:
    """The replica (of their ids) that `model` goes to when none holds it: the highest hash of model and replica
    (rendezvous hashing: the same on every router; a replica gone or added moves only its own share of models)."""
    return max(replicas, key=lambda replica: _score(model, replica))


def _score(model: str, replica: str) -> int:
    digest = hashlib.blake2b(f"{model}\n{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _two(replicas: list[Replica]) -> list[Replica]:
    """Two of them at random, in random order, as Ray Serve's power of two choices: the router takes the less busy,
    and of two equally busy the first (in a fixed order, one replica would take every request of a quiet load)."""
    return random.sample(replicas, min(2, len(replicas)))


def ranks(
    model: str, live: Mapping[str, Replica], holders: Iterable[str], spread: Iterable[str], on_demand: bool = True
) -> list[list[Replica]]:
    """The replicas to try for a request, in turn, each rank until one takes it: for `model` ('' when the request
    names none), two of the `live` replicas (by id) that hold it, then its owner if it does not and the replicas load
    models `on_demand` (else nothing would load it there); last (and alone when every replica holds it, or no model
    is named) two of `spread`, Ray Serve's choice of candidates."""
    fallback = _two([live[replica] for replica in spread if replica in live])
    if not model:
        return [fallback]
    held = [replica for replica in holders if replica in live]
    if len(held) == len(live):
        return [fallback]
    tried = [_two([live[replica] for replica in held])] if held else []
    if on_demand and (first := owner(model, live)) not in held:
        tried.append([live[first]])
    return [*tried, fallback]


def patiently(
    tried: list[list[Replica]], waited_s: float, available: Callable[[list[Replica]], list[Replica]]
) -> list[list[Replica]]:
    """`tried` (from `ranks`) without its last rank, any replica, while the request has waited under PATIENCE_S and
    one of its model's holders or its owner is `available` (not known to be full): a replica slow to answer Ray's
    probe is asked again rather than passed over. A full one is passed over at once, as before."""
    *preferred, _ = tried
    if preferred and waited_s < PATIENCE_S and any(available(rank) for rank in preferred):
        return preferred
    return tried
