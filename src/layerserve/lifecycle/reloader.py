"""Reloader: keeps the registry equal to the repository (poll, load, apply, unload) without failing a request."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from layerserve.engines.base import cache_problem
from layerserve.engines.onnx import start_runtime
from layerserve.engines.process.usage import process_usage, trim_heap
from layerserve.errors import DeadlineExceededError, LoadFailedError, NotFoundError, NotReadyError, QueueFullError
from layerserve.lifecycle.budget import BudgetFullError, MemoryBudget, Resident, megabytes
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
from layerserve.metrics import (
    COLD_START_SECONDS,
    MODEL_EVICTIONS,
    MODEL_LOADS,
    hold_version_series,
    release_version_series,
    set_model_state,
    set_version_memory,
)
from layerserve.serving.pipeline import pipeline_depth
from layerserve.serving.registry import ModelEntry, ModelRegistry
from layerserve.serving.version import ModelVersion, VersionState
from layerserve.settings import ModelConfig, check_config_override

log = logging.getLogger(__name__)

# A model folder as a scan found it: its spec, and the stamp of each version its policy selects.
Scanned = tuple[ModelSpec, dict[int, tuple[object, ...]]]

NOT_LOADED = "not loaded (on demand)"
UNLOADED = "unloaded (on demand: a request loads it again)"
EVICTED = "unloaded to make room under the memory budget (on demand: a request loads it again)"


class Reloader:
    """Applies the difference between the repository and the registry.

    New version folders are loaded and warmed before they become active; removed ones leave the registry
    at once and are closed once their requests are answered; a version whose files changed is reloaded
    beside the old one and swapped in. While polling, a version is loaded only once its files are
    unchanged for one interval (still being copied otherwise). One change at a time.

    Under a memory budget (`model_memory_budget`), versions are listed (UNAVAILABLE) instead, unless their model is
    kept loaded or has a version loaded already; `load_on_demand` loads one for the requests that want it, and
    every load first unloads the least recently used idle versions it needs the room of (see MemoryBudget).
    """

    def __init__(self, registry: ModelRegistry) -> None:
        self._registry = registry
        self._repository = registry.settings.model_repository
        self._seen: dict[tuple[str, int], tuple[object, ...]] = {}
        self._overrides: dict[str, dict[str, Any]] = {}  # model -> the config of its last load, if it had one
        self._lock = asyncio.Lock()
        self._retiring: set[asyncio.Task[None]] = set()
        settings = registry.settings
        self.budget = (
            MemoryBudget(settings.model_memory_budget, int(settings.engine_process_min_mb * 1_000_000))
            if settings.loads_on_demand
            else None
        )
        self._loading: dict[tuple[str, int], asyncio.Task[ModelVersion]] = {}  # on-demand loads, one per version
        self._waiting: dict[tuple[str, int], int] = {}  # requests waiting for each of them

    async def start(self) -> None:
        """Load every model of the repository now (no stability wait), then mark the registry settled."""
        settings = self._registry.settings
        problem = cache_problem(settings.engine_cache_dir) if settings.engine != "keras" else ""
        if problem:
            outcome = "fails (engine: onnx)" if settings.engine == "onnx" else "serves on Keras"
            log.error(
                "the engine cache %s cannot be written (%s): no model can be exported to ONNX; a version whose "
                "export is not in it yet (`layerserve export` fills it ahead) %s; set engine_cache_dir "
                "(--engine-cache-dir) to a writable folder",
                settings.engine_cache_dir, problem, outcome,
            )  # fmt: skip
        if self.budget is not None and settings.watch_resident_memory:
            self.budget.base_bytes = await asyncio.to_thread(self._base_bytes)
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
                scanned = await asyncio.to_thread(self._scan_all, [folder.name for folder in folders])
                with self._registry.preparer.held():  # one preparer child for the loads, one after the other
                    for name, found in self._in_load_order(scanned):
                        await self._sync(name, wait_for_copies=False, scanned=found)
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
            # The folders are read on a thread: a thousand models' configs and files take a fifth of a second.
            present = await asyncio.to_thread(lambda: [folder.name for folder in self._served_folders()])
            polled = [name for name in sorted(present) if not self._is_unloaded(name)]
            scanned = await asyncio.to_thread(self._scan_all, polled)
            with self._registry.preparer.held():
                for name, found in self._in_load_order(scanned):
                    await self._sync(name, wait_for_copies=True, scanned=found)
            for name in set(self._registry.models) - set(present):
                self._retire_all(self._registry.models.pop(name))
                await self._connect_pipelines_again(name)

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

    async def refresh(self, name: str) -> None:
        """Sync one model with its folder now (a poll's work for it, without the wait for copies)."""
        check_model_name(name)
        async with self._lock:
            await self._sync(name, wait_for_copies=False)

    async def unload_model(self, name: str) -> None:
        """Unload every version of a model; polling leaves it unloaded until it is loaded again. Under a memory
        budget its versions are listed instead, and a request loads them again.

        Raises:
            NotFoundError: the model is not in the registry.
        """
        check_model_name(name)
        async with self._lock:
            entry = self._registry.entry(name)
            if self.budget is None:
                entry.is_unloaded = True
                self._retire_all(entry)
                return
            for number, version in list(entry.versions.items()):
                if not version.is_listed:
                    self._list(entry, number, version.path, version.fingerprint, UNLOADED)

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
        """What a loaded version was made from: its files, and its config (a load's config may change it); for a
        pipeline, also the versions each step's folder serves (a changed step connects the pipeline again)."""
        stamp: tuple[object, ...] = (fingerprint(path), config.model_dump_json())
        for step in config.pipeline or []:
            found = scan_model(self._repository / step.model) if self._served(step.model) else None
            served = tuple((n, fingerprint(p)) for n, p in found.versions.items()) if found else ()
            stamp += ((step.model, served, found.pinned if found else None),)
        return stamp

    def _served(self, name: str) -> bool:
        return self._registry.settings.serves_model(name) and (self._repository / name).is_dir()

    def config_of(self, model: str) -> ModelConfig | None:
        """A served model's config (as the registry knows it, else as its folder holds it): None for no such
        model. A pipeline's load reads its steps' with it."""
        entry = self._registry.models.get(model)
        if entry is not None:
            return None if entry.spec.error else entry.spec.config
        if not self._served(model):
            return None
        spec = self._scan(model)
        return None if spec.error else spec.config

    async def step_for_load(self, model: str, version: int | None) -> ModelVersion:
        """The READY version a pipeline's step names, for its load to check (which runs under the lock, so a
        listed one is loaded here, not on demand)."""
        found = self._registry.find(model, version)
        if found.is_listed:
            found = await self._load(self._registry.entry(model), found.version, found.path, found.fingerprint)
        return self._registry.require_ready(found)

    async def hold(self, model: str, version: int | None) -> ModelVersion:
        """The READY version a pipeline's step names, held for one request (loaded on demand when listed)."""
        found = self._registry.find(model, version)
        if found.is_listed and self.budget is not None:
            return await self.load_on_demand(model, found.version)
        self._registry.require_ready(found).hold()
        return found

    async def _connect_pipelines_again(self, changed: str) -> None:
        """Connect again, now, the pipelines (loaded or failed) that name `changed` as a step, whose versions just
        changed: a step swapped by apply, a load or a training job between polls (or with polling off) is followed
        at once, and a step that no longer fits fails the pipeline with the reason."""
        for entry in list(self._registry.models.values()):
            steps = entry.spec.config.pipeline
            if entry.spec.error or not steps or all(step.model != changed for step in steps):
                continue
            for number, version in list(entry.versions.items()):
                if version.is_ready or version.state is VersionState.FAILED:
                    try:
                        await self._load(entry, number, version.path, self._stamp(version.path, entry.spec.config))
                    except BudgetFullError as error:
                        log.warning("pipeline %s: not connected again now: %s", entry.spec.name, error.message)

    def _in_load_order(self, scanned: dict[str, Scanned]) -> list[tuple[str, Scanned]]:
        """The scanned models, pipelines after the models their steps name (which they check as they load)."""
        configs = {name: found[0].config for name, found in scanned.items() if not found[0].error}

        def config_of(name: str) -> ModelConfig | None:
            return configs[name] if name in configs else self.config_of(name)

        return sorted(scanned.items(), key=lambda item: (pipeline_depth(item[0], config_of), item[0]))

    def _entry(self, spec: ModelSpec) -> ModelEntry:
        """The registry's entry of the model `spec` was scanned from, made from it when there is none."""
        entry = self._registry.models.get(spec.name)
        if entry is None:
            entry = self._registry.models[spec.name] = ModelEntry(spec)
        return entry

    def _is_unloaded(self, name: str) -> bool:
        entry = self._registry.models.get(name)
        return entry is not None and entry.is_unloaded

    def _scan_all(self, names: list[str]) -> dict[str, Scanned]:
        """Each model folder's spec and its selected versions' stamps (file reads only: run on a thread)."""
        scanned = {}
        for name in names:
            spec = self._scan(name)
            scanned[name] = (spec, {number: self._stamp(path, spec.config) for number, path in spec.versions.items()})
        return scanned

    async def _sync(
        self, name: str, wait_for_copies: bool, force: bool = False, scanned: Scanned | None = None
    ) -> ModelEntry:
        """Make one model's loaded versions equal to what its folder, policy and pin ask for (as `scanned` found
        them, else as read now)."""
        spec, stamps = scanned if scanned is not None else self._scan_all([name])[name]
        known = self._registry.models.get(name)
        report_problems(spec, known.spec if known else None)
        entry = self._entry(spec)
        entry.spec, entry.pinned = spec, spec.pinned
        if force:
            entry.is_unloaded = False
        if spec.error:
            return entry  # keep serving what was loaded; the index shows the config error
        loads_now = self.budget is None or force or self._is_kept(entry) or bool(entry.ready_versions)
        for number, path in spec.versions.items():
            current = entry.versions.get(number)
            stamp = stamps[number]
            if current is not None and current.fingerprint == stamp and not (force and not current.is_ready):
                continue
            if wait_for_copies and self._seen.get((name, number)) != stamp:
                self._seen[(name, number)] = stamp  # new or changed: load once unchanged for one interval
                continue
            if loads_now or (current is not None and current.is_ready):
                try:
                    await self._load(entry, number, path, stamp)
                    continue
                except BudgetFullError as error:
                    if force:
                        raise
                    if current is not None and current.is_ready:
                        log.warning("model %s version %d: its new files wait: %s", name, number, error.message)
                        continue  # the loaded files go on serving; the next poll tries again
                    log.warning("model %s version %d is listed, not loaded: %s", name, number, error.message)
            self._list(entry, number, path, stamp, NOT_LOADED)
        for key in [key for key in self._seen if key[0] == name and key[1] not in spec.present]:
            del self._seen[key]  # its folder is gone: a model that gets new versions for ever keeps no trace of each
        # Versions whose folder is gone leave now; those the policy no longer selects stay until every
        # selected version serves, so that a model is never left without one while newer ones load.
        is_complete = all(
            number in entry.versions and (entry.versions[number].is_ready or entry.versions[number].is_listed)
            for number in spec.versions
        )
        removed = [n for n in set(entry.versions) - set(spec.versions) if n not in spec.present or is_complete]
        for number in removed:
            self._remove(entry, number)
        if removed:
            await self._connect_pipelines_again(name)
        return entry

    async def _load(
        self, entry: ModelEntry, number: int, path: Path, stamp: tuple[object, ...] | None = None
    ) -> ModelVersion:
        """Load a version beside the one serving under its number, then swap; a failed reload keeps the old."""
        name, config = entry.spec.name, entry.spec.config
        new = ModelVersion(name, number, path, config, stamp if stamp is not None else self._stamp(path, config))
        current = entry.versions.get(number)
        too_big, freeing = self._make_room(entry, new, current)  # raises BudgetFullError before anything changes
        if current is None:
            entry.versions[number] = new  # shown as LOADING in the index
            hold_version_series(name, number)
        if too_big:
            new.state, new.reason = VersionState.FAILED, too_big
            set_model_state(name, number, new.state)
            log.error("model %s version %d FAILED: %s", name, number, too_big)
        else:
            await asyncio.gather(*freeing)  # the unloaded versions' memory is back before the new one takes its own
            if config.pipeline is not None:
                await new.connect_pipeline(self, self._registry.settings.request_timeout_ms)
            else:
                await self._registry.load(new)
            self._count_load(entry, new)
        if new.is_ready or current is None or not current.is_ready:
            if entry.versions.get(number) is not new:
                old = entry.versions.get(number)
                entry.versions[number] = new
                if old is not None:
                    self._retire(old)
            if new.is_ready and (current is None or current.is_ready):  # new files (not a listed one's load)
                await self._connect_pipelines_again(name)
            return new
        current.fingerprint = new.fingerprint  # do not retry the same files on every poll
        current.reason = f"reload failed, the previous files still serve: {new.reason}"
        log.error("model %s version %d: %s", name, number, current.reason)
        return new

    async def load_on_demand(self, name: str, number: int) -> ModelVersion:
        """Load a listed version for a request (one load, however many requests wait for it) and return it held
        for the caller (who releases it); the requests that wait are bounded by the model's `max_queue_size` and
        wait until `request_timeout_ms`.

        Raises:
            NotFoundError: the version is gone from the repository meanwhile.
            NotReadyError: its load failed (the reason), or BudgetFullError: no room can be made now (503).
            QueueFullError: too many requests wait for it already (503).
            DeadlineExceededError: it did not load within `request_timeout_ms` (504).
        """
        key = (name, number)
        settings = self._registry.settings
        waiting = self._waiting.get(key, 0)
        limit = self._registry.entry(name).spec.config.max_queue_size or settings.max_queue_size
        if waiting >= limit:
            raise QueueFullError(f"model '{name}' version {number} is loading and {waiting} requests wait for it")
        task = self._loading.get(key)
        if task is None:
            task = self._loading[key] = asyncio.create_task(self._load_listed(name, number))
            task.add_done_callback(self._loaded)
        self._waiting[key] = waiting + 1
        try:
            async with asyncio.timeout(settings.request_timeout_ms / 1000):
                version = await asyncio.shield(task)
            version.hold()  # before anything else runs: a load waiting for the lock could unload it otherwise
            return version
        except TimeoutError:
            raise DeadlineExceededError(
                f"model '{name}' version {number} did not load within request_timeout_ms "
                f"({settings.request_timeout_ms} ms); it goes on loading"
            ) from None
        finally:
            remaining = self._waiting.pop(key) - 1
            if remaining:
                self._waiting[key] = remaining

    def _loaded(self, task: asyncio.Task[ModelVersion]) -> None:
        """An on-demand load ended: later requests start their own; its error is taken (its waiters may be gone)."""
        for key, loading in list(self._loading.items()):
            if loading is task:
                del self._loading[key]
        if not task.cancelled():
            task.exception()

    async def _load_listed(self, name: str, number: int) -> ModelVersion:
        started = time.perf_counter()
        async with self._lock:
            entry = self._registry.entry(name)
            version = entry.versions.get(number)
            if version is None:
                raise NotFoundError(f"model '{name}' has no version {number} any more")
            if version.is_listed:
                version = await self._load(entry, number, version.path, version.fingerprint)
        if not version.is_ready:
            detail = f": {version.reason}" if version.reason else ""
            raise NotReadyError(f"model '{name}' version {number} is {version.state}{detail}")
        COLD_START_SECONDS.observe(time.perf_counter() - started)
        return version

    def _is_kept(self, entry: ModelEntry) -> bool:
        """Whether the model stays loaded under the budget (setting `keep_loaded`, or its config.yaml's)."""
        return entry.spec.config.keep_loaded or self._registry.settings.keeps_loaded(entry.spec.name)

    def _make_room(
        self, entry: ModelEntry, new: ModelVersion, current: ModelVersion | None
    ) -> tuple[str, list[asyncio.Task[None]]]:
        """Under a budget, unload what a load of `new` needs the room of: the reason it can never fit (if so), and
        the unloads (done once their memory is freed).

        Raises:
            BudgetFullError: no room can be made now (nothing was unloaded).
        """
        budget = self.budget
        if budget is None:
            return "", []
        need = budget.estimate(new)
        if need > budget.limit and not self._is_kept(entry):
            return (
                f"it needs about {megabytes(need)}, more than the whole model_memory_budget "
                f"({megabytes(budget.limit)}): raise the budget, or serve it elsewhere"
            ), []
        everything = self._residents()
        residents = [resident for resident in everything if resident.version is not current]
        idle = self._idle_processes_bytes(need, residents)
        watched = budget.base_bytes is not None
        unattributed = budget.unattributed(self._resident_bytes(), everything, idle) if watched else 0
        need += idle
        try:
            victims = budget.make_room(need, residents, f"model '{new.name}' version {new.version}", unattributed)
        except BudgetFullError as error:
            if not self._is_kept(entry):
                raise
            log.warning("model %s is kept loaded past the budget: %s", new.name, error.message)
            victims = []
        return "", [self._evict(victim) for victim in victims]

    def _count_load(self, entry: ModelEntry, new: ModelVersion) -> None:
        """After a load under a budget: remember what it took, and unload more if it took more than expected."""
        if not new.is_ready:
            return
        MODEL_LOADS.labels(new.name).inc()
        budget = self.budget
        if budget is None:
            return
        # A load frees as much again as it keeps (the file, the parsed graph): given back now, off the loop, not at
        # the next unload's trim, so that what stays resident is what the budget counts.
        asyncio.get_running_loop().run_in_executor(None, trim_heap)
        taken = new.memory()["total_bytes"]
        budget.record(new, taken)
        others = [resident for resident in self._residents() if resident.version is not new]
        taken += self._idle_processes_bytes(taken, others)
        try:
            for victim in budget.make_room(taken, others, f"model '{new.name}' version {new.version}"):
                self._evict(victim)
        except BudgetFullError as error:
            log.warning("over the memory budget after a load: %s", error.message)

    def _idle_processes_bytes(self, need: int, residents: list[Resident]) -> int:
        """The memory of the engine processes kept without a session (for the next big version), which counts
        against the budget: stopped first when `need` would not fit beside them (the cheapest room), else theirs."""
        pool = self._registry.engine_processes
        idle = pool.idle_bytes()
        if (
            idle
            and sum(resident.bytes for resident in residents) + idle + need
            > self._registry.settings.model_memory_budget
        ):
            pool.stop_idle()
            log.info("engine processes without a session stopped to make room (memory budget)")
            return 0
        return idle

    def _base_bytes(self) -> int:
        """The worker's resident memory before any version loads, ONNX Runtime's one-time set-up included (it
        starts now, as it would at the first load): what `watch_resident_memory` holds the budget above."""
        start_runtime()
        trim_heap()
        return self._resident_bytes()

    def _resident_bytes(self) -> int:
        """The worker's resident memory now: its own process and its engine processes."""
        return process_usage()[1] + self._registry.engine_processes.usage()[1]

    def _residents(self) -> list[Resident]:
        """What takes memory now, each version marked kept when it is kept loaded or requests wait for it."""
        budget = self.budget
        assert budget is not None
        entries = list(self._registry.models.values())
        kept = {entry.spec.name for entry in entries if self._is_kept(entry)}
        versions = [version for entry in entries for version in entry.versions.values()]
        return budget.residents(
            versions, lambda version: version.name in kept or (version.name, version.version) in self._waiting
        )

    def _list(
        self, entry: ModelEntry, number: int, path: Path, stamp: tuple[object, ...], reason: str
    ) -> asyncio.Task[None] | None:
        """A version known, not loaded (UNAVAILABLE with `reason`), in place of what served under its number (the
        task that closes that one)."""
        name = entry.spec.name
        current = entry.versions.get(number)
        entry.versions[number] = ModelVersion.listed(name, number, path, entry.spec.config, stamp, reason)
        if current is None:
            hold_version_series(name, number)
            return None
        set_model_state(name, number, VersionState.UNAVAILABLE)
        set_version_memory(name, number, {})  # it holds none now (zeros: workers' metric files cannot drop a series)
        return self._retire(current)

    def _evict(self, version: ModelVersion) -> asyncio.Task[None]:
        """Unload a version to make room: listed again in its place, closed once idle (it is idle now); the task
        that closes it."""
        entry = self._registry.models[version.name]
        MODEL_EVICTIONS.labels(version.name).inc()
        log.info("model %s version %d unloaded to make room (memory budget)", version.name, version.version)
        closing = self._list(entry, version.version, version.path, version.fingerprint, EVICTED)
        assert closing is not None  # it served under its number
        return closing

    def _retire_all(self, entry: ModelEntry) -> None:
        for number in list(entry.versions):
            self._remove(entry, number)

    def _remove(self, entry: ModelEntry, number: int) -> None:
        """A version number leaves the registry: drained and closed, and gone from /metrics."""
        self._retire(entry.versions.pop(number))
        release_version_series(entry.spec.name, number)

    def _retire(self, version: ModelVersion) -> asyncio.Task[None]:
        """Close a version that left the registry once the requests holding it are answered (the task that does)."""

        async def retire() -> None:
            if version.is_listed:
                return  # never loaded: nothing to close
            await version.drain()
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, version.close)
            await loop.run_in_executor(None, trim_heap)  # off the loop: it walks the whole heap
            log.info("model %s version %d unloaded", version.name, version.version)

        task = asyncio.create_task(retire())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        return task
