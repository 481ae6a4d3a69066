"""MemoryBudget: under `model_memory_budget`, what the loaded versions take, what a load will need, and which
versions to unload to make room for it (the least recently used idle ones, never one kept loaded)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from layerserve.errors import LayerserveError, NotReadyError
from layerserve.lifecycle.model import find_model_file
from layerserve.serving.version import ModelVersion, VersionState

log = logging.getLogger(__name__)

# A version not loaded before is estimated from its model file: the ONNX graph holds the same weights, and its
# session, warm-up arena and the server's objects add about as much again for small models (measured in
# docs/many-models.md); a load's own figure replaces the estimate once known.
_FILE_FACTOR = 2.0
_FIXED_BYTES = 2 << 20


def first_load_estimate(version_folder: Path) -> int:
    """What a version never loaded is expected to take: a multiple of its model file's size (see the factors)."""
    try:
        model_file = find_model_file(version_folder)
        files = [p for p in model_file.rglob("*") if p.is_file()] if model_file.is_dir() else [model_file]
        size = sum(p.stat().st_size for p in files)
    except (OSError, LayerserveError):  # no model file: its load fails, and takes nothing
        return _FIXED_BYTES
    return int(size * _FILE_FACTOR) + _FIXED_BYTES


class BudgetFullError(NotReadyError):
    """No room can be made for a load now: every loaded version is in use or kept loaded (503, with Retry-After)."""


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

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._measured: dict[tuple[object, ...], int] = {}  # a version's fingerprint -> its last load's figure

    def figure(self, version: ModelVersion) -> int:
        """What a version takes: its own figure once READY (and its cuts), else what its load is expected to."""
        if version.is_ready:
            return version.memory()["total_bytes"]
        return self.estimate(version)

    def estimate(self, version: ModelVersion) -> int:
        """What loading `version` is expected to take: its last load's figure, else `first_load_estimate`."""
        measured = self._measured.get(version.fingerprint)
        return measured if measured is not None else first_load_estimate(version.path)

    def record(self, version: ModelVersion, taken: int) -> None:
        """Remember what a load of this version took (its next load is expected to take as much)."""
        self._measured[version.fingerprint] = taken
        if len(self._measured) > 100_000:  # versions that come and go for ever keep no trace of each
            self._measured.pop(next(iter(self._measured)))

    def residents(self, versions: Iterable[ModelVersion], is_kept: Callable[[ModelVersion], bool]) -> list[Resident]:
        """The versions that take memory (READY or LOADING), with their figures."""
        return [
            Resident(version, self.figure(version), is_kept(version))
            for version in versions
            if version.state in (VersionState.READY, VersionState.LOADING)
        ]

    def make_room(self, need: int, residents: list[Resident], for_what: str) -> list[ModelVersion]:
        """The versions to unload so that `need` more bytes fit: the least recently used READY ones that no
        request holds and that are not kept loaded, as few as it takes.

        Raises:
            BudgetFullError: no choice of them makes room (nothing is unloaded then).
        """
        used = sum(resident.bytes for resident in residents)
        if used + need <= self.limit:
            return []
        candidates = sorted(
            (r for r in residents if r.version.is_ready and not r.version.in_use and not r.is_kept),
            key=lambda resident: resident.version.last_used,
        )
        victims, freed = [], 0
        for resident in candidates:
            if used - freed + need <= self.limit:
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
