"""Model affinity's parts without Ray: NameModel names a request's model for the proxy's router, a replica's
routing stats list the models it holds, every router agrees on a model's owner (and owners spread models over the
replicas, and a replica gone moves only its own), and the ranks try holders, then the owner (where replicas load on
demand), then any replica."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from layerserve.messages import RepositoryEntry
from layerserve.transports.ray import affinity
from layerserve.transports.ray.affinity import HANDED, HELD, MODEL_HEADER, NameModel, owner, ranks, routing_stats

REPLICAS = {"r1": "replica 1", "r2": "replica 2", "r3": "replica 3"}


async def _headers_seen(path: str, headers: list[tuple[bytes, bytes]], kind: str = "http") -> Any:
    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope.get("headers"))

    async def nothing() -> Any:
        return {}

    async def ignore(message: Any) -> None:
        return None

    await NameModel(app)({"type": kind, "path": path, "headers": headers}, nothing, ignore)
    return seen[0]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "model"),
    [
        ("/v2/models/mlp/infer", b"mlp"),
        ("/v2/models/mlp/versions/2/infer", b"mlp"),
        ("/v2/repository/models/m%20x/load", b"m x"),
        ("/v1/models/mlp:predict", b"mlp"),
        ("/v2/models/stats", None),
        ("/v2/health/ready", None),
        ("/metrics", None),
    ],
)
async def test_a_request_naming_a_model_carries_its_name_for_the_router(path: str, model: bytes | None) -> None:
    given = [(b"host", b"x")]
    seen = await _headers_seen(path, given)
    assert seen == given + ([(MODEL_HEADER, model)] if model else [])
    assert given == [(b"host", b"x")]  # the scope's own list is left as it was


@pytest.mark.anyio
async def test_a_lifespan_or_websocket_scope_passes_untouched() -> None:
    assert await _headers_seen("/v2/models/mlp/infer", [], kind="websocket") == []


def test_routing_stats_list_the_models_held_or_loading_once_each() -> None:
    index = [
        RepositoryEntry("a", 1, "READY", ""), RepositoryEntry("a", 2, "READY", ""),
        RepositoryEntry("b", 1, "LOADING", ""), RepositoryEntry("c", 1, "UNAVAILABLE", "not loaded"),
        RepositoryEntry("d", 1, "FAILED", "bad file"), RepositoryEntry("e", None, "UNAVAILABLE", "no versions"),
    ]  # fmt: skip
    assert routing_stats(index, True) == {HELD: ["a", "b"], affinity.ON_DEMAND: True, HANDED: []}
    assert routing_stats([], False, ["efficientnet*"]) == {
        HELD: [],
        affinity.ON_DEMAND: False,
        HANDED: ["efficientnet*"],
    }


def test_every_router_agrees_on_the_owner_and_owners_spread_models() -> None:
    models = [f"model-{i}" for i in range(600)]
    owners = {model: owner(model, list(REPLICAS)) for model in models}
    assert owners == {model: owner(model, list(reversed(REPLICAS))) for model in models}  # order does not matter
    assert all(150 <= count <= 250 for count in Counter(owners.values()).values())
    # r3 gone: its models move, the others' stay where they are
    moved = {model for model in models if owner(model, ["r1", "r2"]) != owners[model]}
    assert moved == {model for model in models if owners[model] == "r3"}


def test_a_request_naming_no_model_is_spread_as_ray_spreads_it() -> None:
    (tried,) = ranks("", REPLICAS, [], ["r1", "r2", "r3"])
    assert len(tried) == 2 and set(tried) <= set(REPLICAS.values())
    assert ranks("", REPLICAS, [], ["r2"]) == [["replica 2"]]  # e.g. the router's own node first


def test_two_candidates_come_in_either_order() -> None:
    # Ray's router takes the first of two equally busy replicas: a fixed order would send a quiet load to one.
    firsts = Counter(ranks("", REPLICAS, [], ["r1", "r2"])[0][0] for _ in range(200))
    assert set(firsts) == {"replica 1", "replica 2"}
    held = Counter(ranks("m", REPLICAS, ["r1", "r2"], ["r3"])[0][0] for _ in range(200))
    assert set(held) == {"replica 1", "replica 2"}


def test_a_model_every_replica_holds_is_spread_as_before() -> None:
    assert ranks("m", REPLICAS, ["r1", "r2", "r3"], ["r3"]) == [["replica 3"]]


def test_holders_come_first_then_the_owner_then_any_replica() -> None:
    first = owner("m", list(REPLICAS))
    other = next(r for r in REPLICAS if r != first)
    assert ranks("m", REPLICAS, [other], ["r1"]) == [[REPLICAS[other]], [REPLICAS[first]], ["replica 1"]]
    assert ranks("m", REPLICAS, [first], ["r1"]) == [[REPLICAS[first]], ["replica 1"]]  # the owner holds it
    assert ranks("m", REPLICAS, [], ["r1"]) == [[REPLICAS[first]], ["replica 1"]]  # nobody does: the owner loads it
    four = {**REPLICAS, "r4": "replica 4"}
    holders, *rest = ranks("m", four, ["r1", "r2", "r3"], ["r4"])
    assert len(holders) == 2 and set(holders) <= set(REPLICAS.values())  # the less busy of two holders
    assert rest == ([["replica 4"]] if owner("m", four) == "r4" else []) + [["replica 4"]]


def test_a_request_waits_a_while_for_its_holders_or_owner_unless_they_are_full() -> None:
    # Ray's router skips a replica slow to answer its probe: a request tries its holders and owner again for a
    # second rather than any replica, which would load the model a second time; full ones are passed over at once.
    first = owner("m", list(REPLICAS))
    other = next(r for r in REPLICAS if r != first)
    tried = ranks("m", REPLICAS, [other], ["r1"])

    def free(replicas: list[str]) -> list[str]:  # none known to be full
        return replicas

    def owner_free(replicas: list[str]) -> list[str]:
        return [replica for replica in replicas if replica == REPLICAS[first]]

    patiently = affinity.patiently
    assert patiently(tried, 0.2, free) == [[REPLICAS[other]], [REPLICAS[first]]]
    assert patiently(tried, affinity.PATIENCE_S, free) == tried  # waited long enough: any replica
    assert patiently(tried, 0.2, lambda replicas: []) == tried  # holders and owner full: any replica, at once
    assert patiently(tried, 0.2, owner_free) == [[REPLICAS[other]], [REPLICAS[first]]]
    alone = ranks("", REPLICAS, [], ["r1"])  # no model named (or every replica holds it): nothing to wait for
    assert patiently(alone, 0.2, free) == alone
    assert patiently(ranks("m", REPLICAS, [], ["r1"], on_demand=False), 0.2, free) == [["replica 1"]]


def test_without_loads_on_demand_no_owner_is_tried() -> None:
    # No budget: a model no replica holds (unloaded, failed) is spread as before; one some hold goes to them.
    assert ranks("m", REPLICAS, [], ["r1"], on_demand=False) == [["replica 1"]]
    assert ranks("m", REPLICAS, ["r2"], ["r1"], on_demand=False) == [["replica 2"], ["replica 1"]]


def test_a_holder_or_candidate_no_longer_running_is_left_out() -> None:
    live = {"r1": "replica 1", "r2": "replica 2"}
    first = owner("m", live)
    assert ranks("m", live, ["r3"], ["r3", "r1"]) == [[live[first]], ["replica 1"]]
    assert ranks("m", {}, ["r1"], []) == [[]]
