"""MemoryBudget's choice of what to unload: the least recently used idle versions, as few as the figures (and the
memory they miss, where the worker's resident memory is watched) take; a 503 only when the figures cannot fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerserve.lifecycle.budget import BudgetFullError, MemoryBudget, Resident
from layerserve.serving.version import ModelVersion, VersionState
from layerserve.settings import ModelConfig

MB = 1 << 20


def ready(name: str, last_used: float) -> ModelVersion:
    """A READY version (as the reloader sees it: state and last use) of a model file that does not exist."""
    version = ModelVersion.listed(name, 1, Path("/nonexistent") / name / "1", ModelConfig(), (name,), "")
    version.state, version.last_used = VersionState.READY, last_used
    return version


def residents(*figures_mb: int) -> list[Resident]:
    """Ready versions m0, m1, ... of these figures, m0 the least recently used."""
    return [Resident(ready(f"m{i}", float(i)), mb * MB, False) for i, mb in enumerate(figures_mb)]


def test_figures_alone_unload_the_least_recently_used_as_few_as_it_takes() -> None:
    budget = MemoryBudget(100 * MB, process_min_bytes=1 << 40)
    loaded = residents(30, 30, 30)
    assert budget.make_room(10 * MB, loaded, "x") == []
    assert [v.name for v in budget.make_room(20 * MB, loaded, "x")] == ["m0"]
    assert [v.name for v in budget.make_room(70 * MB, loaded, "x")] == ["m0", "m1"]


def test_memory_the_figures_miss_is_shared_by_the_versions_and_unloads_more() -> None:
    budget = MemoryBudget(100 * MB, process_min_bytes=1 << 40)
    loaded = residents(20, 20, 20, 20)  # 80 MB by their figures; the worker holds 40 MB more than that
    assert budget.make_room(20 * MB, loaded, "x", unattributed=0) == []
    # Each version is taken to hold 1.5 times its figure: 20 MB more fits once 2 of the 4 are unloaded.
    assert [v.name for v in budget.make_room(20 * MB, loaded, "x", unattributed=40 * MB)] == ["m0", "m1"]


def test_unattributed_memory_never_makes_a_503_that_the_figures_would_not() -> None:
    budget = MemoryBudget(100 * MB, process_min_bytes=1 << 40)
    loaded = residents(30, 30)
    busy = Resident(ready("busy", 9.0), 30 * MB, is_kept=True)
    # Unloading both idle versions cannot make room by the scaled figures; by the figures it does: both go.
    victims = budget.make_room(20 * MB, [*loaded, busy], "x", unattributed=500 * MB)
    assert [v.name for v in victims] == ["m0", "m1"]
    with pytest.raises(BudgetFullError, match="model_memory_budget"):
        budget.make_room(80 * MB, [*loaded, busy], "x", unattributed=500 * MB)


def test_unattributed_is_what_the_worker_holds_past_its_base_and_the_figures() -> None:
    budget = MemoryBudget(100 * MB, process_min_bytes=1 << 40)
    loaded = residents(20, 20)
    assert budget.unattributed(500 * MB, loaded, 0) == 0  # not watched: no base
    budget.base_bytes = 80 * MB
    assert budget.unattributed(150 * MB, loaded, 5 * MB) == 25 * MB
    assert budget.unattributed(100 * MB, loaded, 0) == 0
