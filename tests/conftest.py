"""Session fixtures: a real repository of small Keras models saved to disk, and a real server on it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest

from layerserve.settings import Settings
from tests.live_server import LiveServer, start_server


def build_mlp(seed: int) -> Any:
    """10 floats -> 3 softmax scores."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((10,), name="x")
    h = keras.layers.Dense(16, activation="relu", name="hidden")(x)
    return keras.Model(x, keras.layers.Dense(3, activation="softmax", name="probs")(h), name="mlp")


def build_multi() -> Any:
    """Two inputs (FP32 features, INT32 tokens) -> two outputs (a regression pair, 5 softmax scores)."""
    keras.utils.set_random_seed(3)
    features = keras.Input((4,), name="features")
    tokens = keras.Input((3,), dtype="int32", name="tokens")
    embedded = keras.layers.Flatten(name="flat")(keras.layers.Embedding(10, 2, name="embedding")(tokens))
    joined = keras.layers.Concatenate(name="joined")([features, embedded])
    regression = keras.layers.Dense(2, name="regression")(joined)
    probs = keras.layers.Dense(5, activation="softmax", name="probs")(joined)
    return keras.Model([features, tokens], [regression, probs], name="multi")


def build_sequential() -> Any:
    """A Sequential model (saved as legacy .h5): 6 floats -> 2 values."""
    keras.utils.set_random_seed(5)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])


def build_lambda() -> Any:
    """A model with a Lambda layer: code inside the file, refused without trust_models."""
    x = keras.Input((3,), name="x")
    return keras.Model(x, keras.layers.Lambda(lambda t: t * 2, name="double")(x))


def build_scalar() -> Any:
    """A regression model: 4 floats -> one value (shape [-1, 1])."""
    keras.utils.set_random_seed(6)
    x = keras.Input((4,), name="x")
    h = keras.layers.Dense(8, activation="tanh", name="hidden")(x)
    return keras.Model(x, keras.layers.Dense(1, name="value")(h), name="scalar")


def build_tiny_image() -> Any:
    """An image classifier small enough to build in a second: 8x8 RGB (0..255) -> 3 softmax scores."""
    keras.utils.set_random_seed(8)
    image = keras.Input((8, 8, 3), name="image")
    h = keras.layers.Conv2D(4, 3, activation="relu", name="conv")(keras.layers.Rescaling(1 / 255)(image))
    pooled = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    return keras.Model(image, keras.layers.Dense(3, activation="softmax", name="probs")(pooled), name="tiny_image")


def build_tiny_text(vocabulary_size: int, sequence_length: int) -> Any:
    """A text classifier over token ids (INT32 [-1, sequence_length]) -> 2 softmax scores."""
    keras.utils.set_random_seed(9)
    tokens = keras.Input((sequence_length,), dtype="int32", name="tokens")
    embedded = keras.layers.Embedding(vocabulary_size, 4, name="embedding")(tokens)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(embedded)
    return keras.Model(tokens, keras.layers.Dense(2, activation="softmax", name="probs")(pooled), name="tiny_text")


def build_mobilenet() -> Any:
    keras.utils.set_random_seed(11)
    return keras.applications.MobileNetV2(weights=None, input_shape=(96, 96, 3), alpha=0.35)


def build_nested() -> Any:
    """The transfer-learning shape: a MobileNetV2 base used as one layer of an outer model."""
    keras.utils.set_random_seed(12)
    base = keras.applications.MobileNetV2(weights=None, input_shape=(96, 96, 3), alpha=0.35, include_top=False)
    image = keras.Input((96, 96, 3), name="image")
    pooled = keras.layers.GlobalAveragePooling2D(name="pool")(base(image))
    return keras.Model(image, keras.layers.Dense(4, activation="softmax", name="head")(pooled), name="outer")


def _save(model: Any, folder: Path, filename: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / filename
    model.save(path)
    return path


@pytest.fixture(scope="session")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model repository with good, legacy, SavedModel, unsafe, corrupt and misconfigured models."""
    repo = tmp_path_factory.mktemp("repository")
    _save(build_mlp(1), repo / "mlp" / "1", "model.keras")
    _save(build_mlp(2), repo / "mlp" / "2", "model.keras")
    (repo / "mlp" / "config.yaml").write_text("description: two versions\nversion_policy: all\n")
    (repo / "mlp" / "draft").mkdir()  # not a version number: ignored
    _save(build_multi(), repo / "multi" / "1", "model.keras")
    _save(build_sequential(), repo / "legacy_h5" / "3", "model.h5")
    _save(build_mlp(4), repo / "keras_engine" / "1", "model.keras")
    (repo / "keras_engine" / "config.yaml").write_text("engine: keras\n")
    build_multi().export(str(repo / "saved" / "1"), format="tf_saved_model", verbose=False)
    _save(build_lambda(), repo / "unsafe_h5" / "1", "model.h5")
    (repo / "corrupt" / "1").mkdir(parents=True)
    (repo / "corrupt" / "1" / "model.keras").write_bytes(b"PK\x03\x04 this is not a zip file")
    _save(build_mlp(5), repo / "misconfigured" / "1", "model.keras")
    _save(build_mobilenet(), repo / "mobilenet" / "1", "model.keras")
    _save(build_nested(), repo / "nested" / "1", "model.keras")
    (repo / "misconfigured" / "config.yaml").write_text("max_batch_sise: 8\n")
    return repo


def load_reference(repository: Path, model: str, version: int) -> Any:
    """The saved Keras model, loaded directly with Keras (the independent reference)."""
    folder = repository / model / str(version)
    for name in ("model.keras", "model.h5"):
        if (folder / name).exists():
            return keras.saving.load_model(folder / name, compile=False)
    raise FileNotFoundError(folder)


@pytest.fixture(scope="session")
def settings(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """Server settings over the test repository, with a private ONNX cache."""
    return Settings(model_repository=repository, engine_cache_dir=tmp_path_factory.mktemp("onnx-cache"))


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


def build_slow() -> Any:
    """16 floats -> six 1024-wide layers: SLOW_ROWS rows take a while on a CPU, from a small body."""
    keras.utils.set_random_seed(13)
    x = keras.Input((16,), name="x")
    h = x
    for i in range(6):
        h = keras.layers.Dense(1024, activation="tanh", name=f"d{i}")(h)
    return keras.Model(x, h, name="slow")


@pytest.fixture(scope="session")
def guarded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server with admin and API tokens, a 1 MB body limit, its gRPC door, over `mlp` and `slow` (one
    request per model call, so that a second request waits in the queue while the first is computed)."""
    repo = tmp_path_factory.mktemp("guarded")
    _save(build_mlp(1), repo / "mlp" / "1", "model.keras")
    _save(build_slow(), repo / "slow" / "1", "model.keras")
    (repo / "slow" / "config.yaml").write_text("max_batch_size: 1\n")
    settings = Settings(
        model_repository=repo, engine_cache_dir=tmp_path_factory.mktemp("guarded-cache"), admin_token=ADMIN_TOKEN,
        api_token=API_TOKEN, max_body_bytes=1024 * 1024, reload_interval_s=0,
    )  # fmt: skip
    live = start_server(settings, grpc=True)
    yield live
    live.stop()
