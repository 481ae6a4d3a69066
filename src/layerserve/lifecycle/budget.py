"""MemoryBudget: under `model_memory_budget`, what the loaded versions take, what a load will need, and which
versions to unload to make room for it (the least recently used idle ones, never one kept loaded)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from layerserve.errors import BudgetFullError, LayerserveError
from layerserve.lifecycle.model import find_model_file
from layerserve.serving.version import ModelVersion, VersionState

log = logging.getLogger(__name__)

# A version never loaded is estimated from its model file: its fixed cost, and its file's size times a factor. The
# factor starts at what the weights and their session take here (about the file again), or in an engine process
# (the session's arena for its activations, and the process's own memory: about six times the file for
# EfficientNet-Lite0); each load's measured figure raises it to the largest seen for its kind (docs/many-models.md).
_FIXED_BYTES = 2 << 20
_START_FACTORS = {"here": 2.0, "engine process": 6.0}


def model_file_bytes(version_folder: Path) -> int:
    """The size of a version's model file (all of a SavedModel folder); 0 if it has none."""
    try:
        model_file = find_model_file(version_folder)
        files = [p for p in model_file.rglob("*") if p.is_file()] if model_file.is_dir() else [model_file]
        return sum(p.stat().st_size for p in files)
    except (OSError, LayerserveError):  # no model file: its load fails, and takes nothing
        return 0


def first_load_estimate(version_folder: Path, process_min_bytes: int, factors: dict[str, float] | None = None) -> int:
    """What a version never loaded is expected to take (see the factors above)."""
    size = model_file_bytes(version_folder)
    kind = "engine process" if size >= process_min_bytes else "here"
    return int(size * (factors or _START_FACTORS)[kind]) + _FIXED_BYTES


def megabytes(count: int) -> str:
    """Bytes as MB (binary), for messages."""
    return f"{count / (1 << 20):.1f} MB"


@dataclass(frozen=True)
class Resident:
    """A loaded (or loading) version and what it takes."""

    version: ModelVersion
    bytes: int
    is_kept: bool


class MemoryBudget:
    """The budget's arithmetic: the versions' own memory figures (`ModelVersion.memory`), an estimate for those
    not loaded yet (the figure of their last load, else their file's size), and the choice of what to unload."""

    def __init__(self, limit: int, process_min_bytes: int) -> None:
        self.limit = limit
        self._process_min_bytes = process_min_bytes  # graphs this large open in an engine process
        self._measured: dict[tuple[object, ...], int] = {}  # a version's fingerprint -> its last load's figure
        self._factors = dict(_START_FACTORS)
        self.base_bytes: int | None = None  # the worker's resident memory with no version loaded (if watched)

    def figure(self, version: ModelVersion) -> int:
        """What a version takes: its own figure once READY (and its cuts), else what its load is expected to."""
        if version.is_ready:
            return version.memory()["total_bytes"]
        return self.estimate(version)

    def estimate(self, version: ModelVersion) -> int:
        """What loading `version` is expected to take: its last load's figure, else `first_load_estimate`."""
        measured = self._measured.get(version.fingerprint)
        if measured is not None:
            return measured
        return first_load_estimate(version.path, self._process_min_bytes, self._factors)

    def record(self, version: ModelVersion, taken: int) -> None:
        """Remember what a load of this version took (its next load is expected to take as much), and what it
        says of versions of its kind never loaded."""
        self._measured[version.fingerprint] = taken
        size = model_file_bytes(version.path)
        if size:
            kind = "engine process" if size >= self._process_min_bytes else "here"
            self._factors[kind] = max(self._factors[kind], (taken - _FIXED_BYTES) / size)
        if len(self._measured) > 100_000:  # versions that come and go for ever keep no trace of each
            self._measured.pop(next(iter(self._measured)))

    def unattributed(self, resident_bytes: int, residents: list[Resident], idle_bytes: int) -> int:
        """What the worker's resident memory (its process and its engine processes) holds past its base, the
        residents' figures and its idle engine processes: 0 until `base_bytes` is known."""
        if self.base_bytes is None:
            return 0
        counted = self.base_bytes + sum(resident.bytes for resident in residents) + idle_bytes
        return max(0, resident_bytes - counted)

    def residents(self, versions: Iterable[ModelVersion], is_kept: Callable[[ModelVersion], bool]) -> list[Resident]:
        """The versions that take memory (READY or LOADING), with their figures."""
        return [
            Resident(version, self.figure(version), is_kept(version))
            for version in versions
            if version.state in (VersionState.READY, VersionState.LOADING)
        ]

    def make_room(
        self, need: int, residents: list[Resident], for_what: str, unattributed: int = 0
    ) -> list[ModelVersion]:
        """The versions to unload so that `need` more bytes fit: the least recently used READY ones that no
        request holds and that are not kept loaded, as few as it takes.

        `unattributed` is what the worker's resident memory holds past its base and the residents' figures (see
        `unattributed`): it is taken to be the residents', in proportion to their figures (their Python objects,
        what the allocator kept of their loads), so each unload is expected to free its share of it too. Only the
        figures decide whether room can be made at all.

        Raises:
            BudgetFullError: no choice of them makes room by their figures (nothing is unloaded then).
        """
        used = sum(resident.bytes for resident in residents)
        if used + unattributed + need <= self.limit:
            return []
        scale = 1 + unattributed / used if used else 1.0
        candidates = sorted(
            (r for r in residents if r.version.is_ready and not r.version.in_use and not r.is_kept),
            key=lambda resident: resident.version.last_used,
        )
        victims, freed = [], 0
        for resident in candidates:
            if (used - freed) * scale + need <= self.limit:
                break
            victims.append(resident.version)
            freed += resident.bytes
        if used - freed + need > self.limit:
            busy = sum(1 for r in residents if r.version.in_use or not r.version.is_ready)
            kept = sum(1 for r in residents if r.is_kept)
            raise BudgetFullError(
                f"no memory for {for_what} now: it needs about {megabytes(need)}, the model_memory_budget is "
                f"{megabytes(self.limit)} and {megabytes(used)} is resident in {len(residents)} versions ("
                f"{busy} in use or loading, {kept} kept loaded) of which only {megabytes(freed)} could be unloaded; "
                "retry shortly, or raise model_memory_budget"
            )
        return victims


__all__ = ["BudgetFullError", "MemoryBudget", "Resident", "first_load_estimate", "megabytes", "model_file_bytes"]
