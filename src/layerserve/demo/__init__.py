"""The built-in demo repository: EfficientNet-Lite0 (ImageNet) and a small token classifier."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

EFFICIENTNET_CONFIG = """\
description: >-
  EfficientNet-Lite0, Google's ImageNet weights (75% top-1). Input: RGB 224x224, raw 0..255 values.
"""

TOKEN_CLASSIFIER_CONFIG = """\
description: >-
  A small untrained (seeded) text-shaped model for latency tests: 64 int32 token ids -> 4 class scores.
"""


def build_token_classifier(seed: int = 7) -> Any:
    """64 int32 token ids -> Embedding -> Conv1D -> max pool -> 4 softmax scores (seeded weights)."""
    import keras

    keras.utils.set_random_seed(seed)
    tokens = keras.Input((64,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(1000, 32, name="embedding")(tokens)
    x = keras.layers.Conv1D(64, 3, activation="relu", name="conv")(x)
    x = keras.layers.GlobalMaxPooling1D(name="pool")(x)
    scores = keras.layers.Dense(4, activation="softmax", name="scores")(x)
    return keras.Model(tokens, scores, name="token_classifier")


def build_demo_repository(target: Path) -> None:
    """Write the demo repository into `target` (the ImageNet weights come from an installed package)."""
    from layerserve.demo.efficientnet_lite0 import build_efficientnet_lite0

    models: dict[str, tuple[Callable[[], Any], str]] = {
        "efficientnet_lite0": (build_efficientnet_lite0, EFFICIENTNET_CONFIG),
        "token_classifier": (build_token_classifier, TOKEN_CLASSIFIER_CONFIG),
    }
    for name, (build, config) in models.items():
        version_dir = target / name / "1"
        version_dir.mkdir(parents=True, exist_ok=True)
        (target / name / "config.yaml").write_text(config, encoding="utf-8")
        build().save(version_dir / "model.keras")
        log.info("wrote %s", version_dir / "model.keras")
