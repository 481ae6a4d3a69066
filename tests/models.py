"""Test models: tiny real Keras models built and saved by the tests, and the reference they are compared with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np


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


def build_flat_image() -> Any:
    """An image classifier with no spatial map: 8x8 RGB (0..255) flattened -> 3 softmax scores."""
    keras.utils.set_random_seed(10)
    image = keras.Input((8, 8, 3), name="image")
    flat = keras.layers.Flatten(name="flat")(keras.layers.Rescaling(1 / 255)(image))
    return keras.Model(image, keras.layers.Dense(3, activation="softmax", name="probs")(flat), name="flat_image")


def build_conv_bn() -> Any:
    """8x8 RGB -> a convolution without bias, batch normalization with learned statistics (the export folds it into
    the convolution), ReLU, pooling, 3 softmax scores."""
    keras.utils.set_random_seed(9)
    image = keras.Input((8, 8, 3), name="image")
    conv = keras.layers.Conv2D(6, 3, use_bias=False, name="conv")(image)
    normalization = keras.layers.BatchNormalization(name="bn")
    h = keras.layers.ReLU(name="relu")(normalization(conv))
    pooled = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    model = keras.Model(image, keras.layers.Dense(3, activation="softmax", name="probs")(pooled), name="conv_bn")
    rng = np.random.default_rng(9)
    gamma, beta, mean = rng.uniform(0.5, 2, 6), rng.normal(size=6), rng.normal(size=6)
    normalization.set_weights([gamma, beta, mean, rng.uniform(0.5, 3, 6)])
    return model


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


def save_model(model: Any, folder: Path, filename: str) -> Path:
    """Save `model` as `folder/filename` (the folder made as needed)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / filename
    model.save(path)
    return path


def load_reference(repository: Path, model: str, version: int) -> Any:
    """The saved Keras model, loaded directly with Keras (the independent reference)."""
    folder = repository / model / str(version)
    for name in ("model.keras", "model.h5"):
        if (folder / name).exists():
            return keras.saving.load_model(folder / name, compile=False)
    raise FileNotFoundError(folder)


def build_slow() -> Any:
    """16 floats -> six 1024-wide layers: SLOW_ROWS rows take a while on a CPU, from a small body."""
    keras.utils.set_random_seed(13)
    x = keras.Input((16,), name="x")
    h = x
    for i in range(6):
        h = keras.layers.Dense(1024, activation="tanh", name=f"d{i}")(h)
    return keras.Model(x, h, name="slow")
