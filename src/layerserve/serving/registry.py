"""ModelRegistry: model name -> ModelEntry (config, versions, pin); finds the version a request gets."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from layerserve.engines.process.pool import EngineProcessPool
from layerserve.errors import NotFoundError, NotReadyError
from layerserve.features.cache import FeatureCache
from layerserve.lifecycle.prepare import Preparer
from layerserve.lifecycle.repository import ModelSpec, label_version
from layerserve.metrics import SERVED_BY, release_version_series
from layerserve.serving.version import ModelVersion, VersionState
from layerserve.settings import Settings

log = logging.getLogger(__name__)

__all__ = ["ModelEntry", "ModelRegistry", "ModelVersion", "VersionState"]


@dataclass
class ModelEntry:
    """A model: its folder's spec, its loaded versions, the pinned version and whether it was unloaded."""

    spec: ModelSpec
    versions: dict[int, ModelVersion] = field(default_factory=dict)
    pinned: int | None = None
    is_unloaded: bool = False

    @property
    def ready_versions(self) -> list[int]:
        """Versions that serve, ascending."""
        return sorted(v for v, mv in self.versions.items() if mv.is_ready)

    @property
    def active_version(self) -> int | None:
        """The version requests without one get: the pinned one if it is ready, else the newest ready."""
        # Every request asks this: no sorted list of the ready versions.
        pinned = self.versions.get(self.pinned) if self.pinned is not None else None
        if pinned is not None and pinned.is_ready:
            return self.pinned
        return max((number for number, version in self.versions.items() if version.is_ready), default=None)

    @property
    def requested_version(self) -> int | None:
        """The version a request without one gets: the pinned one (else the newest) when it is listed, not loaded,
        so that it loads (on demand); else the active one; else the newest in any state."""
        wanted = self.pinned if self.pinned in self.versions else max(self.versions, default=None)
        if wanted is not None and self.versions[wanted].is_listed:
            return wanted
        return self.active_version or wanted


class ModelRegistry:
    """Every model of the repository, by name; the reloader fills it, requests read it."""

    def __init__(self, settings: Settings, cache: FeatureCache | None = None) -> None:
        self.settings = settings
        self.cache = cache
        self._models: dict[str, ModelEntry] = {}
        # Normal priority: the heavy work runs in the preparer's child process; what these threads do here
        # (open ONNX Runtime sessions, warm up) is short, and ORT's worker threads inherit their priority.
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="model-loader")
        self.exporter = ThreadPoolExecutor(1, thread_name_prefix="cut-exporter")
        self.preparer = Preparer(settings.preparer_idle_s)
        self.engine_processes = EngineProcessPool.from_settings(settings)
        self._settled = asyncio.Event()

    def mark_settled(self) -> None:
        """Every model that should load has settled: readiness turns true."""
        self._settled.set()

    @property
    def is_ready(self) -> bool:
        """Whether every model that should load has settled (READY or FAILED)."""
        return self._settled.is_set()

    async def wait_settled(self) -> None:
        """Return once every model that should load has settled."""
        await self._settled.wait()

    @property
    def models(self) -> dict[str, ModelEntry]:
        """Model name -> entry."""
        return self._models

    async def load(self, version: ModelVersion) -> None:
        """Load a version on the loader thread (off the event loop, one version at a time)."""
        version.cache = self.cache
        await asyncio.get_running_loop().run_in_executor(
            self.loader, version.load, self.settings, self.exporter, self.preparer, self.engine_processes
        )

    def entry(self, name: str) -> ModelEntry:
        """The model's entry.

        Raises:
            NotFoundError: no model of that name.
        """
        try:
            return self._models[name]
        except KeyError:
            raise NotFoundError(f"unknown model '{name}'; models: {', '.join(self._models) or 'none'}") from None

    def label_version(self, name: str, label: str) -> int:
        """The version a label of the model's `version_labels` names.

        Raises:
            NotFoundError: unknown model, or no such label (the message lists the known ones).
            NotReadyError: the model's config.yaml is invalid now, so its labels are unknown.
        """
        return label_version(self.entry(name).spec, label)

    def get(self, name: str, version: int | None = None) -> ModelVersion:
        """The requested version (the active one when `version` is None), READY, not held (see DataPlane.open).

        Raises:
            NotFoundError: unknown model or version.
            NotReadyError: the version is loading or failed.
        """
        return self.check_ready(self.find(name, version))

    @staticmethod
    def check_ready(version: ModelVersion) -> ModelVersion:
        """The version, which a request is about to use (recorded for its metrics), if READY.

        Raises:
            NotReadyError: it is not loaded, loading or failed.
        """
        SERVED_BY.set((version.name, version.version))
        return ModelRegistry.require_ready(version)

    @staticmethod
    def require_ready(version: ModelVersion) -> ModelVersion:
        """The version if READY, recording nothing (a pipeline's step: the request is the pipeline's).

        Raises:
            NotReadyError: it is not loaded, loading or failed.
        """
        if not version.is_ready:
            detail = f": {version.reason}" if version.reason else ""
            raise NotReadyError(f"model '{version.name}' version {version.version} is {version.state}{detail}")
        return version

    def find(self, name: str, version: int | None = None) -> ModelVersion:
        """The requested version in any state (the active one, else the newest, when `version` is None).

        Raises:
            NotFoundError: unknown model or version.
            NotReadyError: the model has no version at all.
        """
        entry = self.entry(name)
        if version is None:
            version = entry.requested_version
            if version is None:
                reason = entry.spec.error or ("it was unloaded" if entry.is_unloaded else "it has no version folders")
                raise NotReadyError(f"model '{name}' has no version to serve: {reason}")
        try:
            return entry.versions[version]
        except KeyError:
            known = ", ".join(str(v) for v in sorted(entry.versions)) or "none"
            raise NotFoundError(f"model '{name}' has no loaded version {version}; versions: {known}") from None

    def index(self) -> list[dict[str, str]]:
        """The repository index: one row per version (and per model without any), with state and reason."""
        rows = []
        for name, entry in sorted(self._models.items()):
            if not entry.versions:
                reason = entry.spec.error or ("unloaded" if entry.is_unloaded else "no version folders")
                rows.append({"name": name, "version": "", "state": "UNAVAILABLE", "reason": reason})
            for number, version in sorted(entry.versions.items()):
                rows.append({"name": name, "version": str(number), "state": version.state, "reason": version.reason})
        return rows

    def close(self) -> None:
        """Stop every model thread and engine process, the loader, the exporter and the preparer's child process;
        the versions' own series leave /metrics (unless another runtime of the process serves them too)."""
        self.loader.shutdown(wait=False, cancel_futures=True)
        self.exporter.shutdown(wait=False, cancel_futures=True)
        self.preparer.close()
        for entry in self._models.values():
            for number, version in entry.versions.items():
                version.close()
                release_version_series(entry.spec.name, number)
        self.engine_processes.stop_idle()
