"""The reloader driven poll by poll: new, copying, changed, removed and corrupt versions; pins; unload."""

from __future__ import annotations

import logging
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from layerserve.errors import ConfigError, LoadFailedError, NotFoundError
from layerserve.lifecycle.reloader import Reloader
from layerserve.lifecycle.repository import PIN_FILE
from layerserve.serving.registry import ModelRegistry
from layerserve.settings import Settings
from tests.models import build_mlp

pytestmark = pytest.mark.anyio

X = np.random.default_rng(0).normal(size=(3, 10)).astype(np.float32)


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two model files with different weights, and what each answers for X."""
    folder = tmp_path_factory.mktemp("weights")
    files = {}
    for name, seed in (("a", 1), ("b", 2)):
        model = build_mlp(seed)
        files[name] = folder / f"{name}.keras"
        model.save(files[name])
    return files


def expected(weights: dict[str, Path], name: str) -> np.ndarray:
    import keras

    return np.asarray(keras.saving.load_model(weights[name])(X))


def add_version(repo: Path, number: int, source: Path) -> None:
    (repo / "m" / str(number)).mkdir(parents=True)
    shutil.copyfile(source, repo / "m" / str(number) / "model.keras")


async def answer(registry: ModelRegistry, version: int | None = None) -> tuple[int, np.ndarray]:
    served = registry.get("m", version)
    return served.version, (await served.predict({"x": X}))["probs"]


@pytest.fixture
async def repo_and_reloader(
    tmp_path: Path, weights: dict[str, Path], engine_cache: Path
) -> AsyncIterator[tuple[Path, Reloader, ModelRegistry]]:
    repo = tmp_path / "repo"
    add_version(repo, 1, weights["a"])
    (repo / "m" / "config.yaml").write_text("version_policy: all\n")
    registry = ModelRegistry(Settings(model_repository=repo, engine_cache_dir=engine_cache))
    reloader = Reloader(registry)
    await reloader.start()
    yield repo, reloader, registry
    registry.close()


async def test_new_version_loads_after_one_stable_interval_then_becomes_active(
    repo_and_reloader: tuple[Path, Reloader, ModelRegistry], weights: dict[str, Path]
) -> None:
    repo, reloader, registry = repo_and_reloader
    assert registry.is_ready and (await answer(registry))[0] == 1
    folder = repo / "m" / "2"
    folder.mkdir()
    data = weights["b"].read_bytes()
    (folder / "model.keras").write_bytes(data[: len(data) // 2])  # a copy in progress
    await reloader.poll()
    assert 2 not in registry.models["m"].versions
    (folder / "model.keras").write_bytes(data)  # the copy grows
    await reloader.poll()
    assert 2 not in registry.models["m"].versions  # changed since the last poll: still copying
    await reloader.poll()
    version, probs = await answer(registry)
    assert version == 2
    np.testing.assert_allclose(probs, expected(weights, "b"), atol=1e-5)
    np.testing.assert_allclose((await answer(registry, 1))[1], expected(weights, "a"), atol=1e-5)


async def test_changed_file_is_reloaded_and_removed_version_unloaded(
    repo_and_reloader: tuple[Path, Reloader, ModelRegistry], weights: dict[str, Path]
) -> None:
    repo, reloader, registry = repo_and_reloader
    add_version(repo, 2, weights["b"])
    await reloader.poll()
    await reloader.poll()
    old = registry.get("m", 1)
    shutil.copyfile(weights["b"], repo / "m" / "1" / "model.keras")
    await reloader.poll()
    await reloader.poll()
    assert registry.get("m", 1) is not old
    np.testing.assert_allclose((await answer(registry, 1))[1], expected(weights, "b"), atol=1e-5)
    shutil.rmtree(repo / "m" / "2")
    await reloader.poll()
    assert list(registry.models["m"].versions) == [1]
    assert ("m", 2) not in reloader._seen  # what a version looked like while copied in goes with its folder
    with pytest.raises(NotFoundError, match="no loaded version 2"):
        registry.get("m", 2)


async def test_corrupt_new_version_is_failed_and_the_old_serves(
    repo_and_reloader: tuple[Path, Reloader, ModelRegistry],
) -> None:
    repo, reloader, registry = repo_and_reloader
    (repo / "m" / "3").mkdir()
    (repo / "m" / "3" / "model.keras").write_bytes(b"not a model")
    await reloader.poll()
    await reloader.poll()
    rows = {r["version"]: r for r in registry.index()}
    assert rows["3"]["state"] == "FAILED" and "not a .keras archive" in rows["3"]["reason"]
    assert (await answer(registry))[0] == 1
    await reloader.poll()  # unchanged files: no retry
    assert registry.models["m"].versions[3].state == "FAILED"
    with pytest.raises(LoadFailedError, match="version 3 failed to load"):
        await reloader.apply("m", 3)


async def test_latest_policy_unloads_older_versions(
    tmp_path: Path, weights: dict[str, Path], engine_cache: Path
) -> None:
    repo = tmp_path / "repo"
    add_version(repo, 1, weights["a"])
    registry = ModelRegistry(Settings(model_repository=repo, engine_cache_dir=engine_cache))
    reloader = Reloader(registry)
    await reloader.start()
    add_version(repo, 2, weights["b"])
    await reloader.poll()
    await reloader.poll()
    assert list(registry.models["m"].versions) == [2]
    registry.close()


async def test_apply_loads_pins_persists_and_survives_a_restart(
    tmp_path: Path, weights: dict[str, Path], engine_cache: Path
) -> None:
    repo = tmp_path / "repo"
    add_version(repo, 1, weights["a"])
    add_version(repo, 2, weights["b"])
    settings = Settings(model_repository=repo, engine_cache_dir=engine_cache)
    registry = ModelRegistry(settings)
    reloader = Reloader(registry)
    await reloader.start()
    assert list(registry.models["m"].versions) == [2]  # latest: 1
    await reloader.apply("m", 1)  # not selected by the policy: loaded first
    assert (await answer(registry))[0] == 1
    assert (repo / "m" / PIN_FILE).read_text().strip() == "1"
    add_version(repo, 3, weights["b"])
    await reloader.poll()
    await reloader.poll()
    assert (await answer(registry))[0] == 1  # the pin holds while newer versions arrive
    assert sorted(registry.models["m"].versions) == [1, 3]
    registry.close()

    restarted = ModelRegistry(settings)
    await Reloader(restarted).start()
    assert (await answer(restarted))[0] == 1
    await Reloader(restarted).unpin("m")
    assert not (repo / "m" / PIN_FILE).exists()
    assert (await answer(restarted))[0] == 3
    assert list(restarted.models["m"].versions) == [3]
    restarted.close()


async def test_unload_and_load(repo_and_reloader: tuple[Path, Reloader, ModelRegistry]) -> None:
    _, reloader, registry = repo_and_reloader
    await reloader.unload_model("m")
    assert registry.index() == [{"name": "m", "version": "", "state": "UNAVAILABLE", "reason": "unloaded"}]
    await reloader.poll()
    assert not registry.models["m"].versions  # polling leaves it unloaded
    await reloader.load_model("m")
    assert (await answer(registry))[0] == 1
    with pytest.raises(NotFoundError):
        await reloader.load_model("nope")


async def test_deselected_versions_serve_until_their_replacements_are_ready(
    tmp_path: Path, weights: dict[str, Path], engine_cache: Path
) -> None:
    repo = tmp_path / "repo"
    add_version(repo, 1, weights["a"])
    registry = ModelRegistry(Settings(model_repository=repo, engine_cache_dir=engine_cache))
    reloader = Reloader(registry)
    await reloader.start()
    add_version(repo, 2, weights["b"])
    add_version(repo, 3, weights["a"])
    await reloader.poll()  # 2 and 3 seen once (maybe still copying): 1 must keep serving
    assert (await answer(registry))[0] == 1
    (repo / "m" / "4").mkdir()
    (repo / "m" / "4" / "model.keras").write_bytes(b"corrupt")
    await reloader.poll()
    await reloader.poll()  # 4 is the only selected version and it FAILED: 1 keeps serving
    assert (await answer(registry))[0] == 1
    shutil.rmtree(repo / "m" / "4")
    await reloader.poll()
    await reloader.poll()
    assert (await answer(registry))[0] == 3 and list(registry.models["m"].versions) == [3]
    registry.close()


async def test_a_load_config_lasts_over_polls_until_a_load_without_one(
    repo_and_reloader: tuple[Path, Reloader, ModelRegistry], weights: dict[str, Path]
) -> None:
    repo, reloader, registry = repo_and_reloader
    add_version(repo, 2, weights["b"])
    await reloader.load_model("m", {"max_batch_size": 2, "version_policy": {"latest": 1}})
    served = registry.get("m")
    assert served.version == 2 and served.batching()["max_batch_size"] == 2
    assert set(registry.models["m"].versions) == {2}  # the config's policy, not config.yaml's `all`
    for _ in range(2):
        await reloader.poll()
    assert registry.get("m") is served  # polls keep the loaded config: nothing reloaded
    np.testing.assert_allclose((await served.predict({"x": X}))["probs"], expected(weights, "b"), atol=1e-5)
    await reloader.load_model("m")
    assert set(registry.models["m"].versions) == {1, 2}
    assert registry.get("m").batching()["max_batch_size"] == registry.settings.max_batch_size


async def test_a_load_whose_config_fails_keeps_the_old_version_and_drops_the_config(
    repo_and_reloader: tuple[Path, Reloader, ModelRegistry],
) -> None:
    _, reloader, registry = repo_and_reloader
    served = registry.get("m")
    with pytest.raises(LoadFailedError, match="version 1: reload failed, the previous files still serve: unknown"):
        await reloader.load_model("m", {"classify_output": "no_such_layer"})
    assert registry.get("m") is served and served.config.classify_output is None
    await reloader.poll()
    await reloader.poll()
    assert registry.get("m").config.classify_output is None


async def test_a_load_config_with_an_unknown_key_is_refused_before_loading(
    repo_and_reloader: tuple[Path, Reloader, ModelRegistry],
) -> None:
    _, reloader, registry = repo_and_reloader
    served = registry.get("m")
    with pytest.raises(ConfigError, match="config key 'batch' is not supported; supported keys: description, engine"):
        await reloader.load_model("m", {"batch": 4})
    assert registry.get("m") is served


async def test_a_config_error_is_logged_once_over_polls_and_again_when_it_changes(
    repo_and_reloader: tuple[Path, Reloader, ModelRegistry], caplog: pytest.LogCaptureFixture
) -> None:
    repo, reloader, registry = repo_and_reloader
    config = repo / "m" / "config.yaml"
    with caplog.at_level(logging.INFO, "layerserve.lifecycle.repository"):
        config.write_text("max_batch_sise: 8\n")
        for _ in range(3):
            await reloader.poll()
        config.write_text("max_batch_size: -1\n")
        await reloader.poll()
        await reloader.poll()
        config.write_text("version_policy: all\n")
        await reloader.poll()
        await reloader.poll()
    logged = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in logged] == ["ERROR", "ERROR", "INFO"], logged
    assert "'max_batch_sise': unknown key" in logged[0][1] and "max_batch_size" in logged[1][1], logged
    assert logged[2][1] == "model m: its config.yaml is valid again"
    assert (await answer(registry))[0] == 1  # the loaded version served throughout


@pytest.mark.parametrize("models", ["", "efficientnet*"])
async def test_a_repository_without_model_folders_is_a_warning_naming_the_layout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, models: str
) -> None:
    (tmp_path / "repo" / "other").mkdir(parents=True)  # a model folder the setting models leaves out
    repo = tmp_path / "repo" if models else tmp_path / "repo" / "other"
    registry = ModelRegistry(Settings(model_repository=repo, engine_cache_dir=tmp_path / "cache", models=models))
    with caplog.at_level(logging.WARNING, "layerserve.lifecycle.reloader"):
        await Reloader(registry).start()
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith(f"the repository {repo} has no model folders") and f"{repo}/<model>/<version>/" in message
    assert ("the setting models ('efficientnet*') selects" in message) == bool(models), message
    assert registry.is_ready and registry.models == {}
    registry.close()


async def test_an_engine_cache_that_cannot_be_written_is_one_error_and_models_serve_on_keras(
    tmp_path: Path, weights: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    repo = tmp_path / "repo"
    add_version(repo, 1, weights["a"])
    (tmp_path / "a-file").write_text("where the cache's parent folder should be")
    cache = tmp_path / "a-file" / "cache"
    registry = ModelRegistry(Settings(model_repository=repo, engine_cache_dir=cache))
    with caplog.at_level(logging.INFO, "layerserve"):
        await Reloader(registry).start()
    try:
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and errors[0].startswith(f"the engine cache {cache} cannot be written ("), errors
        assert "--engine-cache-dir" in errors[0]
        assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
        version, served = await answer(registry)
        assert version == 1 and registry.models["m"].versions[1].engine_name == "keras"
        np.testing.assert_allclose(served, expected(weights, "a"), atol=1e-5)
    finally:
        registry.close()
