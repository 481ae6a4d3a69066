"""RayOptions: how a repository is deployed on Ray Serve: the replicas of every model not in a group, groups of
models with replicas of their own (a model that needs more of them, or more than one node holds), autoscaling,
and the CPUs of training jobs; from `layerserve ray serve` flags (`--group 'efficientnet*:2'`) or the `ray:`
section of a config file."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from layerserve.errors import ConfigError
from layerserve.settings import describe_validation_error

DEPLOYMENT_NAME = "layerserve"  # the ingress deployment's name; a group's is `layerserve-<group>`

_GROUP_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")
_GROUP_FLAG = re.compile(r"(?P<models>[^:]+):(?P<replicas>\d+)(?::(?P<cpus>[0-9.]+))?")


class Autoscaling(BaseModel):
    """Ray Serve autoscaling of one group's replicas, between `min` and `max`, aiming at
    `target_ongoing_requests` requests in flight per replica."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min: int = Field(1, ge=0)
    max: int = Field(ge=1)
    target_ongoing_requests: float = Field(2.0, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> Autoscaling:
        if self.min > self.max:
            raise ValueError(f"autoscaling min ({self.min}) is above max ({self.max})")
        return self

    def serve_config(self) -> dict[str, Any]:
        """Ray Serve's `autoscaling_config`."""
        return {
            "min_replicas": self.min,
            "max_replicas": self.max,
            "target_ongoing_requests": self.target_ongoing_requests,
        }


class ReplicaOptions(BaseModel):
    """How many replicas, what each reserves of its node (Ray resources), how many may share a node (0: no
    limit), how many requests each takes at once, or autoscaling instead of a fixed count."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replicas: int = Field(1, ge=1)
    replica_cpus: float = Field(1.0, ge=0)
    replica_gpus: float = Field(0.0, ge=0)
    max_ongoing_requests: int = Field(256, ge=1)
    max_replicas_per_node: int = Field(0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)
    autoscaling: Autoscaling | None = None

    def deployment_options(self) -> dict[str, Any]:
        """Keyword arguments of `serve.deployment` for these replicas."""
        actor: dict[str, Any] = {"num_cpus": self.replica_cpus, "num_gpus": self.replica_gpus}
        if self.resources:
            actor["resources"] = dict(self.resources)
        options: dict[str, Any] = {"ray_actor_options": actor, "max_ongoing_requests": self.max_ongoing_requests}
        if self.max_replicas_per_node:
            options["max_replicas_per_node"] = self.max_replicas_per_node
        if self.autoscaling is not None:
            options["autoscaling_config"] = self.autoscaling.serve_config()
        else:
            options["num_replicas"] = self.replicas
        return options


class Group(ReplicaOptions):
    """Models (shell patterns of folder names) served by replicas of their own."""

    models: tuple[str, ...] = Field(min_length=1)


_REPLICA_FIELDS = set(ReplicaOptions.model_fields)


class RayOptions(ReplicaOptions):
    """The replicas of every model not in a group, the groups by name, the CPUs each training job's Ray task
    reserves (on whichever node has them), and the direct port (0: none) on which every replica of those serves
    HTTP itself, past Ray Serve's proxy (direct_door.py), and whether a request for a model goes to a replica
    that holds it (model affinity, affinity.py; false: Ray Serve's own routing), and where `layerserve ray serve`
    runs Ray Serve's proxies (the head only: a node lost takes no proxy with it; or every node, behind a load
    balancer). A group's unset replica options are the top level's."""

    job_cpus: float = Field(1.0, gt=0)
    direct_port: int = Field(0, ge=0, le=65535)
    proxy_location: Literal["HeadOnly", "EveryNode"] = "HeadOnly"
    model_affinity: bool = True
    groups: dict[str, Group] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _groups_inherit(cls, values: Any) -> Any:
        if not isinstance(values, dict) or not isinstance(values.get("groups"), dict):
            return values
        inherited = {key: value for key, value in values.items() if key in _REPLICA_FIELDS and key != "autoscaling"}
        groups = {
            name: {**inherited, **group} if isinstance(group, dict) else group
            for name, group in values["groups"].items()
        }
        return {**values, "groups": groups}

    @model_validator(mode="after")
    def _names(self) -> RayOptions:
        for name in self.groups:
            if not _GROUP_NAME.fullmatch(name) or name == "board":
                raise ValueError(f"group name {name!r}: use lower-case letters, digits, - and _ (not 'board')")
        if self.direct_port and self.autoscaling is not None:
            raise ValueError(
                "direct_port with autoscaling: Ray Serve's autoscaler counts only the requests through its proxy, "
                "not those on the direct port; give a fixed number of replicas"
            )
        return self

    def shortfall(self, nodes: list[dict[str, float]]) -> str | None:
        """What keeps the replicas from being placed on nodes with these Ray resources (CPU, GPU, custom), or
        None: more of a resource than all the nodes have together, or a replica that needs more than any one
        node has (autoscaling groups count their `min`).

        Ray Serve would wait for resources that never come, and the deployment would never be ready.
        """
        deployments = {"layerserve": self, **{f"layerserve-{name}": group for name, group in self.groups.items()}}
        needed: dict[str, list[tuple[str, int, float]]] = {}
        for name, replicas in deployments.items():
            count = replicas.autoscaling.min if replicas.autoscaling else replicas.replicas
            each = {"CPU": replicas.replica_cpus, "GPU": replicas.replica_gpus, **replicas.resources}
            for resource, amount in each.items():
                if amount > 0 and count > 0:
                    needed.setdefault(resource, []).append((name, count, amount))
        for resource, uses in needed.items():
            largest = max((node.get(resource, 0.0) for node in nodes), default=0.0)
            for name, _, amount in uses:
                if amount > largest:
                    return f"a replica of {name} needs {amount:g} {resource} and no node has more than {largest:g}"
            total, has = sum(count * amount for _, count, amount in uses), sum(n.get(resource, 0.0) for n in nodes)
            if total > has + 1e-9:
                parts = ", ".join(f"{name}: {count} x {amount:g}" for name, count, amount in uses)
                return f"the replicas need {total:g} {resource} in all ({parts}) and the cluster has {has:g}"
        return None

    def group_of(self, model: str) -> str | None:
        """The group that serves `model`, or None (the replicas of every other model)."""
        import fnmatch

        for name, group in self.groups.items():
            if any(fnmatch.fnmatchcase(model, pattern) for pattern in group.models):
                return name
        return None


def ray_options(values: dict[str, Any]) -> RayOptions:
    """RayOptions from plain values (a config file's `ray:` section, the builder's args).

    Raises:
        ConfigError: an unknown key or a value that does not fit; the message names it.
    """
    try:
        return RayOptions.model_validate(values)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, "ray option")) from None


def parse_group(flag: str) -> tuple[str, dict[str, Any]]:
    """`--group 'PATTERN[,PATTERN...]:REPLICAS[:CPUS]'` as a group's name and its values.

    Raises:
        ConfigError: the flag has another form.
    """
    match = _GROUP_FLAG.fullmatch(flag.strip())
    if match is None:
        raise ConfigError(f"--group {flag!r}: write PATTERN[,PATTERN...]:REPLICAS[:CPUS], e.g. 'efficientnet*:2'")
    models = tuple(p.strip() for p in match["models"].split(",") if p.strip())
    name = re.sub(r"[^a-z0-9_-]+", "-", models[0].lower()).strip("-_") or "group"
    values: dict[str, Any] = {"models": models, "replicas": int(match["replicas"])}
    if match["cpus"]:
        values["replica_cpus"] = float(match["cpus"])
    return name, values
