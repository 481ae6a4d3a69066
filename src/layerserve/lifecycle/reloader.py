"""Reloader: keeps the registry equal to the repository (poll, load, apply, unload) without failing a request."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from layerserve.engines.base import cache_problem
from layerserve.engines.process.usage import trim_heap
from layerserve.errors import LoadFailedError, NotFoundError
from layerserve.lifecycle.repository import (
    ModelSpec,
    check_model_name,
    fingerprint,
    label_version,
    model_folders,
    report_problems,
    scan_model,
    write_pin,
)
from layerserve.metrics import hold_version_series, release_version_series
from layerserve.serving.registry import ModelEntry, ModelRegistry
from layerserve.serving.version import ModelVersion
from layerserve.settings import ModelConfig, check_config_override

log = logging.getLogger(__name__)


class Reloader:
    """Applies the difference between the repository and the registry.

    New version folders are loaded and warmed before they become active; removed ones leave the registry
    at once and are closed once their requests are answered; a version whose files changed is reloaded
    beside the old one and swapped in. While polling, a version is loaded only once its files are
    unchanged for one interval (still being copied otherwise). One change at a time.
    """

    def __init__(self, registry: ModelRegistry) -> None:
        self._registry = registry
        self._repository = registry.settings.model_repository
        self._seen: dict[tuple[str, int], tuple[object, ...]] = {}
        self._overrides: dict[str, dict[str, Any]] = {}  # model -> the config of its last load, if it had one
        self._lock = asyncio.Lock()
        self._retiring: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Load every model of the repository now (no stability wait), then mark the registry settled."""
        settings = self._registry.settings
        problem = cache_problem(settings.engine_cache_dir) if settings.engine != "keras" else ""
        if problem:
            outcome = "none can load (engine: onnx)" if settings.engine == "onnx" else "each serves on Keras"
            log.error(
                "the engine cache %s cannot be written (%s): no model can be exported to ONNX, %s; "
                "set engine_cache_dir (--engine-cache-dir) to a writable folder",
                settings.engine_cache_dir, problem, outcome,
            )  # fmt: skip
        try:
            async with self._lock:
                folders = self._served_folders()
                if not folders:
                    selected = f" that the setting models ({settings.models!r}) selects" if settings.models else ""
                    log.warning(
                        "the repository %s has no model folders%s: expected %s/<model>/<version>/model.keras; "
                        "models copied in later are loaded within a poll",
                        self._repository, selected, self._repository,
                    )  # fmt: skip
                for folder in folders:
                    await self._sync(folder.name, wait_for_copies=False)
        finally:
            self._registry.mark_settled()

    async def run(self, interval_s: float) -> None:
        """Poll the repository every `interval_s` until cancelled (fail-soft: errors are logged)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.poll()
            except Exception:  # fail-soft boundary: a bad poll must not stop the reloader
                log.exception("repository poll failed")

    async def poll(self) -> None:
        """One pass over the repository: new, changed and removed models and versions."""
        async with self._lock:
            present = {folder.name for folder in self._served_folders()}
            for name in sorted(present):
                entry = self._registry.models.get(name)
                if entry is None or not entry.is_unloaded:
                    await self._sync(name, wait_for_copies=True)
            for name in set(self._registry.models) - present:
                self._retire_all(self._registry.models.pop(name))

    async def load_model(self, name: str, config: Mapping[str, Any] | None = None) -> ModelEntry:
        """(Re)load a model from the repository now, including one unloaded before.

        A `config` (config.yaml keys) replaces those keys of the model's config.yaml from now on, over polls,
        until the next load without one (or a restart); if the model then fails to load, the config is
        dropped again.

        Raises:
            NotFoundError: no such model folder.
            ConfigError: `config` has an unknown key or a wrong value (400).
            LoadFailedError: no version of it could be loaded.
        """
        check_model_name(name)
        self._check_served(name)
        if config:
            check_config_override(config)
        async with self._lock:
            if not (self._repository / name).is_dir():
                raise NotFoundError(f"the repository has no model folder '{name}'")
            previous = self._overrides.pop(name, None)
            if config:
                self._overrides[name] = dict(config)
            entry = await self._sync(name, wait_for_copies=False, force=True)
            # With a config, every version must serve with it; without, one ready version is enough.
            failed = [mv for mv in entry.versions.values() if config and mv.config != entry.spec.config]
            if entry.spec.error or failed or (entry.versions and not entry.ready_versions):
                if config:
                    self._overrides.pop(name, None)
                    if previous is not None:
                        self._overrides[name] = previous
                failed = failed or list(entry.versions.values())
                reasons = entry.spec.error or "; ".join(f"version {mv.version}: {mv.reason}" for mv in failed)
                raise LoadFailedError(f"model '{name}' failed to load: {reasons}")
        return entry

    async def unload_model(self, name: str) -> None:
        """Unload every version of a model; polling leaves it unloaded until it is loaded again.

        Raises:
            NotFoundError: the model is not in the registry.
        """
        check_model_name(name)
        async with self._lock:
            entry = self._registry.entry(name)
            entry.is_unloaded = True
            self._retire_all(entry)

    async def apply(self, name: str, number: int) -> ModelVersion:
        """Pin a version as the active one (loading it first if the policy did not), persisted in the repository.

        Raises:
            NotFoundError: no such model or version folder.
            LoadFailedError: the version cannot be loaded.
            RepositoryWriteError: the pin cannot be written.
        """
        check_model_name(name)
        self._check_served(name)
        async with self._lock:
            spec = self._scan(name)
            if number not in spec.present:
                known = ", ".join(str(v) for v in sorted(spec.present)) or "none"
                raise NotFoundError(f"model '{name}' has no version folder {number}; versions: {known}")
            entry = self._entry(spec)
            version = entry.versions.get(number)
            if version is None or not version.is_ready:
                version = await self._load(entry, number, spec.present[number])
            if not version.is_ready:
                raise LoadFailedError(f"model '{name}' version {number} failed to load: {version.reason}")
            write_pin(self._repository / name, number)
            entry.pinned = number
            entry.is_unloaded = False
            log.info("model %s: version %d applied (pinned)", name, number)
            return version

    async def apply_label(self, name: str, label: str) -> ModelVersion:
        """Pin the version a label of the model's config.yaml names (read now), as `apply` does; the pin is
        that version number: a later change of the label does not move it.

        Raises:
            NotFoundError: no such model, label or version folder.
            NotReadyError: the model's config.yaml is invalid.
            LoadFailedError: the version cannot be loaded.
            RepositoryWriteError: the pin cannot be written.
        """
        check_model_name(name)
        if not (self._repository / name).is_dir():
            raise NotFoundError(f"unknown model '{name}': no folder of that name in the repository")
        return await self.apply(name, label_version(scan_model(self._repository / name), label))

    async def unpin(self, name: str) -> ModelEntry:
        """Drop the pin: the newest loaded version is active again, and the policy applies.

        Raises:
            NotFoundError: unknown model.
            RepositoryWriteError: the pin cannot be removed.
        """
        check_model_name(name)
        async with self._lock:
            self._registry.entry(name)
            write_pin(self._repository / name, None)
            return await self._sync(name, wait_for_copies=False)

    def _served_folders(self) -> list[Path]:
        return [
            folder for folder in model_folders(self._repository) if self._registry.settings.serves_model(folder.name)
        ]

    def _check_served(self, name: str) -> None:
        """Raises NotFoundError for a model folder this server does not serve (setting `models`)."""
        if not self._registry.settings.serves_model(name):
            raise NotFoundError(
                f"model '{name}' is not served here: the setting models ({self._registry.settings.models!r}) "
                "leaves it out"
            )

    def _scan(self, name: str) -> ModelSpec:
        return scan_model(self._repository / name, self._overrides.get(name))

    def _stamp(self, path: Path, config: ModelConfig) -> tuple[object, ...]:
        """What a loaded version was made from: its files, and its config (a load's config may change it)."""
        return (fingerprint(path), config.model_dump_json())

    def _entry(self, spec: ModelSpec) -> ModelEntry:
        """The registry's entry of the model `spec` was scanned from, made from it when there is none."""
        entry = self._registry.models.get(spec.name)
        if entry is None:
            entry = self._registry.models[spec.name] = ModelEntry(spec)
        return entry

    async def _sync(self, name: str, wait_for_copies: bool, force: bool = False) -> ModelEntry:
        """Make one model's loaded versions equal to what its folder, policy and pin ask for."""
        spec = self._scan(name)
        known = self._registry.models.get(name)
        report_problems(spec, known.spec if known else None)
        entry = self._entry(spec)
        entry.spec, entry.pinned = spec, spec.pinned
        if force:
            entry.is_unloaded = False
        if spec.error:
            return entry  # keep serving what was loaded; the index shows the config error
        for number, path in spec.versions.items():
            current = entry.versions.get(number)
            stamp = self._stamp(path, spec.config)
            if current is not None and current.fingerprint == stamp and not (force and not current.is_ready):
                continue
            if wait_for_copies and self._seen.get((name, number)) != stamp:
                self._seen[(name, number)] = stamp  # new or changed: load once unchanged for one interval
                continue
            await self._load(entry, number, path, stamp)
        for key in [key for key in self._seen if key[0] == name and key[1] not in spec.present]:
            del self._seen[key]  # its folder is gone: a model that gets new versions for ever keeps no trace of each
        # Versions whose folder is gone leave now; those the policy no longer selects stay until every
        # selected version serves, so that a model is never left without one while newer ones load.
        is_complete = all(number in entry.versions and entry.versions[number].is_ready for number in spec.versions)
        for number in set(entry.versions) - set(spec.versions):
            if number not in spec.present or is_complete:
                self._remove(entry, number)
        return entry

    async def _load(
        self, entry: ModelEntry, number: int, path: Path, stamp: tuple[object, ...] | None = None
    ) -> ModelVersion:
        """Load a version beside the one serving under its number, then swap; a failed reload keeps the old."""
        name, config = entry.spec.name, entry.spec.config
        new = ModelVersion(name, number, path, config, stamp if stamp is not None else self._stamp(path, config))
        current = entry.versions.get(number)
        if current is None:
            entry.versions[number] = new  # shown as LOADING in the index
            hold_version_series(name, number)
        await self._registry.load(new)
        if new.is_ready or current is None or not current.is_ready:
            if entry.versions.get(number) is not new:
                old = entry.versions.get(number)
                entry.versions[number] = new
                if old is not None:
                    self._retire(old)
            return new
        current.fingerprint = new.fingerprint  # do not retry the same files on every poll
        current.reason = f"reload failed, the previous files still serve: {new.reason}"
        log.error("model %s version %d: %s", name, number, current.reason)
        return new

    def _retire_all(self, entry: ModelEntry) -> None:
        for number in list(entry.versions):
            self._remove(entry, number)

    def _remove(self, entry: ModelEntry, number: int) -> None:
        """A version number leaves the registry: drained and closed, and gone from /metrics."""
        self._retire(entry.versions.pop(number))
        release_version_series(entry.spec.name, number)

    def _retire(self, version: ModelVersion) -> None:
        """Close a version that left the registry once the requests holding it are answered."""

        async def retire() -> None:
            await version.drain()
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, version.close)
            await loop.run_in_executor(None, trim_heap)  # off the loop: it walks the whole heap
            log.info("model %s version %d unloaded", version.name, version.version)

        task = asyncio.create_task(retire())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
