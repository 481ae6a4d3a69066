"""Image decoding, resizing and preprocessing against independent references (keras.applications)."""

from __future__ import annotations

import io

import keras
import numpy as np
import pytest
from PIL import Image

from layerserve.errors import PayloadTooLargeError
from layerserve.features.images import ImageSpec, UnprocessableImageError, decode, load_one, preprocess
from layerserve.features.labels import imagenet_labels, top_k
from layerserve.features.pooling import pool_features
from layerserve.settings import ModelConfig
from layerserve.tensors import TensorSpec


def spec_for(height: int, width: int, channels: int = 3, **config: object) -> ImageSpec:
    return ImageSpec.for_input(TensorSpec("image", "FP32", (-1, height, width, channels)), ModelConfig(**config))


def encode(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


@pytest.mark.parametrize("mode", ["tf", "torch", "caffe"])
def test_preprocess_modes_match_keras_applications(mode: str) -> None:
    pixels = np.random.default_rng(0).uniform(0, 255, (4, 4, 3)).astype(np.float32)
    expected = keras.applications.imagenet_utils.preprocess_input(pixels.copy(), mode=mode)
    got = preprocess(pixels, spec_for(4, 4, preprocess=mode))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)


def test_explicit_scale_and_offset() -> None:
    pixels = np.full((2, 2, 1), 255.0, np.float32)
    got = preprocess(pixels, spec_for(2, 2, 1, scale=1 / 255, offset=-0.5, preprocess="caffe"))
    np.testing.assert_allclose(got, 0.5)


def test_resize_modes() -> None:
    wide = Image.new("RGB", (40, 20), (255, 0, 0))
    wide.paste((0, 0, 255), (0, 0, 10, 20))  # a blue band at the left edge
    raw = encode(wide, "PNG")
    cropped = load_one(raw, spec_for(10, 10, resize="center_crop", interpolation="nearest"), 10**6)
    assert cropped[..., 0].min() == 255  # the centre crop drops the blue band
    squashed = load_one(raw, spec_for(10, 10, resize="squash", interpolation="nearest"), 10**6)
    assert squashed[5, 0, 2] == 255 and squashed[5, 9, 0] == 255
    padded = load_one(raw, spec_for(10, 10, resize="pad", interpolation="nearest"), 10**6)
    assert padded[0, 5].tolist() == [0, 0, 0] and padded[5, 5, 0] == 255  # black bars above and below


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])  # a JPEG is decoded (drafted) lazily, then turned in place
def test_exif_orientation_is_applied(fmt: str) -> None:
    upright = Image.new("RGB", (40, 20), (0, 0, 0))
    upright.paste((255, 255, 255), (0, 0, 10, 20))  # white on the left
    stored = upright.rotate(90, expand=True)  # stored turned 90 degrees counter-clockwise
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    raw = encode(stored, fmt, exif=exif, **({"quality": 95} if fmt == "JPEG" else {}))
    got = load_one(raw, spec_for(20, 40, resize="squash", interpolation="nearest"), 10**6)
    assert got.shape == (20, 40, 3)
    assert got[10, 2].min() > 240 and got[10, 37].max() < 15


def test_grayscale_gif_first_frame_and_jpeg() -> None:
    frames = [Image.new("L", (8, 8), 200), Image.new("L", (8, 8), 10)]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:])
    got = load_one(buffer.getvalue(), spec_for(8, 8, 1), 10**6)
    assert got.shape == (8, 8, 1) and abs(float(got.mean()) - 200) < 2
    photo = Image.new("RGB", (640, 480), (30, 120, 200))
    got = load_one(encode(photo, "JPEG", quality=95), spec_for(64, 64), 10**6)
    np.testing.assert_allclose(got.mean(axis=(0, 1)), [30, 120, 200], atol=3)


def test_bad_images() -> None:
    with pytest.raises(UnprocessableImageError, match="empty"):
        decode(b"", 10**6)
    with pytest.raises(UnprocessableImageError, match="not a decodable image"):
        decode(b"GIF89a not really", 10**6)
    truncated = encode(Image.new("RGB", (64, 64), (1, 2, 3)), "PNG")[:60]
    with pytest.raises(UnprocessableImageError):
        load_one(truncated, spec_for(8, 8), 10**6)
    with pytest.raises(PayloadTooLargeError, match="over the limit of 100 pixels"):
        decode(encode(Image.new("RGB", (20, 20)), "PNG"), 100)


def test_labels_and_top_k() -> None:
    names = imagenet_labels()
    assert len(names) == 1000 and names[285] == "Egyptian cat" and names[281] == "tabby"
    names[0] = "changed by a caller"
    assert imagenet_labels()[0] == "tench"  # the names are read once, and every caller gets its own list
    scores = np.array([[0.1, 0.7, 0.2], [0.5, 0.2, 0.3]], np.float32)
    best = top_k(scores, ["a", "b", "c"], 2)
    assert [[c["label"] for c in row] for row in best] == [["b", "c"], ["a", "c"]]
    assert best[0][0] == {"label": "b", "index": 1, "score": pytest.approx(0.7)}


@pytest.mark.parametrize("classes", [1, 2, 7, 64, 65, 1000])
def test_top_k_orders_as_a_stable_argsort_with_ties_and_nan(classes: int) -> None:
    # Few classes are sorted in Python, many by numpy: both give the order of a stable argsort of the negated
    # scores (ties: the lower index first; NaN last) and the same scores.
    rng = np.random.default_rng(classes)
    scores = rng.integers(0, 4, size=(5, classes)).astype(np.float32) / 4  # many ties
    scores[1, rng.integers(0, classes)] = np.nan
    labels = [f"c{i}" for i in range(classes)]
    for k in (1, 3, classes):
        best = top_k(scores, labels, k)
        expected = np.argsort(-scores, axis=1, kind="stable")[:, : min(k, classes)]
        assert [[c["index"] for c in row] for row in best] == expected.tolist()
        for number, (row, indices) in enumerate(zip(best, expected, strict=True)):
            assert [c["label"] for c in row] == [labels[i] for i in indices]
            np.testing.assert_array_equal([c["score"] for c in row], scores[number, indices])
            assert all(type(c["index"]) is int and type(c["score"]) is float for c in row)


def test_pooling() -> None:
    maps = np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4)
    np.testing.assert_allclose(pool_features(maps, None), maps.mean(axis=(1, 2)))
    np.testing.assert_allclose(pool_features(maps, "max"), maps.max(axis=(1, 2)))
    assert pool_features(maps, "none").shape == (1, 2, 3, 4)
    vectors = np.ones((3, 5), np.float32)
    assert pool_features(vectors, None).shape == (3, 5)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "BMP", "GIF"])
def test_every_accepted_format_decodes(fmt: str) -> None:
    colour = (200, 40, 90)
    image = Image.new("RGB", (32, 24), colour)
    options: dict[str, object] = {"quality": 95} if fmt in ("JPEG", "WEBP") else {}
    got = load_one(encode(image, fmt, **options), spec_for(16, 16), 10**6)
    tolerance = 20 if fmt == "GIF" else 4  # GIF's 256-colour palette
    np.testing.assert_allclose(got.mean(axis=(0, 1)), colour, atol=tolerance)
