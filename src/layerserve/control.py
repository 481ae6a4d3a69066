"""ControlPlane: what changes which versions serve (load, unload, apply a version or label, unpin), for every door
and for training jobs; with peers (Ray Serve replicas), each change is made on every replica."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from layerserve.lifecycle.peers import ControlOp, Peers
from layerserve.lifecycle.reloader import Reloader
from layerserve.serving.version import ModelVersion
from layerserve.settings import Settings


class ControlPlane:
    """Load, unload and apply through the reloader; told to the peers, if any (see lifecycle/peers.py)."""

    def __init__(self, settings: Settings, reloader: Reloader, peers: Peers | None = None) -> None:
        self._settings = settings
        self._reloader = reloader
        self._peers = peers

    async def load(self, model: str, config: dict[str, Any] | None = None) -> tuple[int, ...]:
        """(Re)load a model from the repository, `config` replacing config.yaml keys; its ready versions once
        settled (with peers, once every replica has loaded it).

        Raises:
            NotFoundError: no such model folder. BadRequestError: a bad config key. ConflictError: it failed.
        """
        entry = await self._reloader.load_model(model, config)
        await self._tell(ControlOp("load", model, config=config))
        return tuple(entry.ready_versions)

    async def load_on_demand(self, model: str, version: int) -> ModelVersion:
        """Under a memory budget: load a listed version for the requests that want it, unloading the least recently
        used idle versions to make room, here only (each replica keeps its own budget); returned held.

        Raises:
            BudgetFullError, QueueFullError: no room now, or too many requests wait (503); and see
            Reloader.load_on_demand.
        """
        return await self._reloader.load_on_demand(model, version)

    async def refresh(self, model: str) -> None:
        """Bring one model in line with its folder now, as a poll would (new versions listed, or loaded if it
        serves already), without waiting for copies; the peers see it at their next poll."""
        await self._reloader.refresh(model)

    async def unload(self, model: str) -> None:
        """Unload every version of a model (they finish their requests first), on every replica."""
        await self._reloader.unload_model(model)
        await self._tell(ControlOp("unload", model))

    async def apply(self, model: str, version: int | None = None, label: str | None = None) -> int | None:
        """Pin `version` (or the one `label` names) as the active version, or, with neither, unpin; the active
        version once in place (with peers, once every replica serves it)."""
        if version is None and label is None:
            active = (await self._reloader.unpin(model)).active_version
            await self._tell(ControlOp("unpin", model))
            return active
        if version is not None:
            pinned = (await self._reloader.apply(model, version)).version
        else:
            assert label is not None
            pinned = (await self._reloader.apply_label(model, label)).version
        await self._tell(ControlOp("apply", model, version=pinned))
        return pinned

    async def make(self, op: ControlOp) -> None:
        """Make a change another replica was asked for (told to no one further).

        Raises:
            LayerserveError: it failed here (as `load`, `unload` and `apply` say).
        """
        if not self._settings.serves_model(op.model):  # another group's model
            return
        if op.kind == "load":
            await self._reloader.load_model(op.model, op.config)
        elif op.kind == "unload":
            await self._reloader.unload_model(op.model)
        elif op.kind == "apply":
            assert op.version is not None
            await self._reloader.apply(op.model, op.version)
        else:
            await self._reloader.unpin(op.model)

    async def keep_in_step(self, is_ready: Callable[[], bool]) -> None:
        """Until cancelled: tell the peers how this replica stands and make what they were asked (no peers: return)."""
        if self._peers is not None:
            await self._peers.run(self.make, is_ready)

    async def _tell(self, op: ControlOp) -> None:
        if self._peers is not None:
            await self._peers.tell(op)
