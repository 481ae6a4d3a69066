"""Session fixtures: a real repository of small Keras models saved to disk, and a real server on it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest

from layerserve.settings import Settings
from tests.live_server import LiveServer, start_server
from tests.models import (
    build_lambda,
    build_mlp,
    build_mobilenet,
    build_multi,
    build_nested,
    build_sequential,
    build_slow,
    save_model,
)
from tests.otlp_receiver import OtlpReceiver, start_http_receiver


@pytest.fixture(scope="session")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model repository with good, legacy, SavedModel, unsafe, corrupt and misconfigured models."""
    repo = tmp_path_factory.mktemp("repository")
    save_model(build_mlp(1), repo / "mlp" / "1", "model.keras")
    save_model(build_mlp(2), repo / "mlp" / "2", "model.keras")
    (repo / "mlp" / "config.yaml").write_text("description: two versions\nversion_policy: all\n")
    (repo / "mlp" / "draft").mkdir()  # not a version number: ignored
    save_model(build_multi(), repo / "multi" / "1", "model.keras")
    save_model(build_sequential(), repo / "legacy_h5" / "3", "model.h5")
    save_model(build_mlp(4), repo / "keras_engine" / "1", "model.keras")
    (repo / "keras_engine" / "config.yaml").write_text("engine: keras\n")
    build_multi().export(str(repo / "saved" / "1"), format="tf_saved_model", verbose=False)
    save_model(build_lambda(), repo / "unsafe_h5" / "1", "model.h5")
    (repo / "corrupt" / "1").mkdir(parents=True)
    (repo / "corrupt" / "1" / "model.keras").write_bytes(b"PK\x03\x04 this is not a zip file")
    save_model(build_mlp(5), repo / "misconfigured" / "1", "model.keras")
    save_model(build_mobilenet(), repo / "mobilenet" / "1", "model.keras")
    save_model(build_nested(), repo / "nested" / "1", "model.keras")
    (repo / "misconfigured" / "config.yaml").write_text("max_batch_sise: 8\n")
    return repo


@pytest.fixture(scope="session")
def engine_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's ONNX cache: a model file prepared by one test is not prepared again by the next (the cache is
    keyed by the file's hash, and shared safely by servers side by side). Tests of preparation itself use their own."""
    return tmp_path_factory.mktemp("onnx-cache")


@pytest.fixture(scope="session")
def settings(repository: Path, engine_cache: Path) -> Settings:
    """Server settings over the test repository, with the session's ONNX cache."""
    return Settings(model_repository=repository, engine_cache_dir=engine_cache)


@pytest.fixture(scope="session")
def server(settings: Settings) -> Iterator[LiveServer]:
    """A real server on 127.0.0.1 over the test repository, ready; its gRPC door on a port of its own."""
    live = start_server(settings, grpc=True)
    yield live
    live.stop()


@pytest.fixture(scope="session")
def demo_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in demo repository, built once."""
    from layerserve.demo import build_demo_repository

    target = tmp_path_factory.mktemp("demo")
    build_demo_repository(target)
    return target


@pytest.fixture(scope="session")
def demo_engine_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ONNX cache for the servers over the demo repository: EfficientNet is exported and verified once."""
    return tmp_path_factory.mktemp("demo-engine-cache")


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded random generator."""
    return np.random.default_rng(1234)


@pytest.fixture
def anyio_backend() -> str:
    """Async tests run on asyncio (anyio's pytest plugin)."""
    return "asyncio"


ADMIN_TOKEN, API_TOKEN = "admin-secret", "api-secret"
SLOW_ROWS = 4000  # rows of a request that keeps the slow model busy for a while (seconds on a CPU)


@pytest.fixture(scope="session")
def guarded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server with admin and API tokens, a 1 MB body limit, its gRPC door, over `mlp` and `slow` (one
    request per model call and one lane in its engine process, so that a second request waits in the queue while
    the first is computed)."""
    repo = tmp_path_factory.mktemp("guarded")
    save_model(build_mlp(1), repo / "mlp" / "1", "model.keras")
    save_model(build_slow(), repo / "slow" / "1", "model.keras")
    (repo / "slow" / "config.yaml").write_text("max_batch_size: 1\n")
    settings = Settings(
        model_repository=repo, engine_cache_dir=tmp_path_factory.mktemp("guarded-cache"), admin_token=ADMIN_TOKEN,
        api_token=API_TOKEN, max_body_bytes=1024 * 1024, reload_interval_s=0, engine_lanes=1,
    )  # fmt: skip
    live = start_server(settings, grpc=True)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    """An OTLP/HTTP receiver (tests/otlp_receiver.py), for a traced server's spans."""
    started = start_http_receiver()
    yield started
    started.stop()
