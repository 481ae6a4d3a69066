"""Images in: decode (EXIF orientation, first frame), resize to the input, preprocess like keras.applications."""

from __future__ import annotations

import asyncio
import io
import warnings
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from layerserve.errors import BadRequestError, LayerserveError, ModelLoadError, PayloadTooLargeError
from layerserve.settings import ModelConfig
from layerserve.tensors import Array, TensorSpec

IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/webp", "image/bmp", "image/gif")
_TORCH_MEAN, _TORCH_STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
_CAFFE_MEAN_BGR = np.array([103.939, 116.779, 123.68])
_FILTERS = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
    "box": Image.Resampling.BOX,
    "hamming": Image.Resampling.HAMMING,
}


class UnprocessableImageError(LayerserveError):
    """The bytes are not a decodable image (422)."""

    status_code = 422


@dataclass(frozen=True)
class ImageSpec:
    """How encoded images become one model input: its name, size, channels and preprocessing."""

    input_name: str
    height: int
    width: int
    channels: int
    dtype: np.dtype[Any]
    config: ModelConfig

    @classmethod
    def for_input(cls, spec: TensorSpec, config: ModelConfig) -> ImageSpec:
        """The image spec of a model input shaped (-1, H, W, C), C 1 or 3.

        Raises:
            ModelLoadError: the input is not an image-shaped float or uint8 tensor, or caffe meets grayscale.
        """
        shape = spec.shape
        if len(shape) != 4 or min(shape[1:]) < 1 or shape[3] not in (1, 3):
            raise ModelLoadError(
                f"input: image needs an input shaped [-1, H, W, 1 or 3], '{spec.name}' is {list(shape)}"
            )
        if spec.datatype not in ("FP16", "FP32", "FP64", "UINT8"):
            raise ModelLoadError(f"input: image needs a float or UINT8 input, '{spec.name}' is {spec.datatype}")
        if config.preprocess == "caffe" and config.scale is None and shape[3] != 3:
            raise ModelLoadError("preprocess: caffe needs a 3-channel input")
        return cls(spec.name, shape[1], shape[2], shape[3], spec.dtype, config)


def decode(raw: bytes, max_pixels: int) -> Image.Image:
    """Open an encoded image (first frame), refusing it before decoding when it has too many pixels.

    Raises:
        UnprocessableImageError: empty, corrupt or not an image.
        PayloadTooLargeError: width x height over `max_pixels`.
    """
    if not raw:
        raise UnprocessableImageError("empty image: the body has no bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit applies below
            image = Image.open(io.BytesIO(raw))
    except Image.DecompressionBombError as error:
        raise PayloadTooLargeError(f"image too large: {error}") from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise UnprocessableImageError("not a decodable image (JPEG, PNG, WebP, BMP or GIF expected)") from None
    width, height = image.size
    if width * height > max_pixels:
        raise PayloadTooLargeError(f"image of {width}x{height} pixels is over the limit of {max_pixels} pixels")
    return image


def _fit(image: Image.Image, spec: ImageSpec) -> Image.Image:
    target = (spec.width, spec.height)
    method = _FILTERS[spec.config.interpolation]
    if spec.config.resize == "squash":
        return image.resize(target, method)
    if spec.config.resize == "center_crop":
        width, height = image.size
        # The largest centred box of the target's aspect ratio, on whole pixels (as a crop then resize).
        crop_w = min(width, round(height * spec.width / spec.height))
        crop_h = min(height, round(width * spec.height / spec.width))
        left, top = (width - crop_w) // 2, (height - crop_h) // 2
        return image.crop((left, top, left + crop_w, top + crop_h)).resize(target, method)
    return ImageOps.pad(image, target, method, color=0)


def to_array(image: Image.Image, spec: ImageSpec) -> Array:
    """Decode, orient, convert, resize and preprocess one image into an (H, W, C) array of the input dtype (`image`
    itself is decoded and oriented in place).

    Raises:
        UnprocessableImageError: the image data is truncated or corrupt.
    """
    return preprocess(seen_pixels(image, spec), spec).astype(spec.dtype, copy=False)


def seen_pixels(image: Image.Image, spec: ImageSpec) -> Array:
    """The image the model sees, before its preprocessing: decoded, oriented, converted and resized, (H, W, C)
    float32 in 0..255 (`image` itself is decoded and oriented in place).

    Raises:
        UnprocessableImageError: the image data is truncated or corrupt.
    """
    mode = "RGB" if spec.channels == 3 else "L"
    try:
        if image.format == "JPEG":
            image.draft(mode, (spec.width, spec.height))
        image.seek(0)
        image.load()  # decoded here, so that bad data is a 422; the image is ours: no step below copies it for nothing
        ImageOps.exif_transpose(image, in_place=True)
        if image.mode != mode:
            image = image.convert(mode)
    except (OSError, ValueError, SyntaxError):
        raise UnprocessableImageError("the image data is truncated or corrupt") from None
    return np.asarray(_fit(image, spec), dtype=np.float32).reshape(spec.height, spec.width, spec.channels)


def preprocess(pixels: Array, spec: ImageSpec) -> Array:
    """Map 0..255 pixels as the model expects (the modes of keras.applications, or scale/offset)."""
    config = spec.config
    if config.scale is not None:
        return pixels * config.scale + config.offset
    if config.preprocess == "tf":
        return pixels / 127.5 - 1.0
    if config.preprocess == "torch":
        normalized: Array = (pixels / 255.0 - _TORCH_MEAN[: spec.channels]) / _TORCH_STD[: spec.channels]
        return normalized
    if config.preprocess == "caffe":
        bgr: Array = pixels[..., ::-1] - _CAFFE_MEAN_BGR
        return bgr
    return pixels


def load_one(raw: bytes, spec: ImageSpec, max_pixels: int) -> Array:
    """Encoded bytes -> one preprocessed (H, W, C) array."""
    return to_array(decode(raw, max_pixels), spec)


class ImageDecoder:
    """Decodes images on a thread pool, off the event loop and in parallel with model calls."""

    def __init__(self, pool: Executor, max_pixels: int) -> None:
        self._pool = pool
        self._max_pixels = max_pixels

    async def decode_batch(self, payloads: list[bytes], spec: ImageSpec) -> Array:
        """Encoded images -> one (N, H, W, C) batch, each image decoded on its own thread.

        Raises:
            UnprocessableImageError, PayloadTooLargeError: per the first bad image.
        """
        if not payloads:
            raise BadRequestError("no image in the request")
        loop = asyncio.get_running_loop()
        jobs = [loop.run_in_executor(self._pool, load_one, raw, spec, self._max_pixels) for raw in payloads]
        return np.stack(await asyncio.gather(*jobs))

    async def decode_seen(self, payload: bytes, spec: ImageSpec) -> Array:
        """One encoded image -> the (H, W, C) pixels the model sees before its preprocessing (see seen_pixels).

        Raises:
            UnprocessableImageError, PayloadTooLargeError: a bad image.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: seen_pixels(decode(payload, self._max_pixels), spec))

    async def decode_inputs(self, inputs: dict[str, Array], spec: ImageSpec | None) -> dict[str, Array]:
        """Replace a BYTES image input (encoded images, one per row) with its decoded batch."""
        if spec is None or spec.input_name not in inputs or inputs[spec.input_name].dtype != object:
            return inputs
        payloads = [bytes(item) for item in inputs[spec.input_name].reshape(-1)]
        return {**inputs, spec.input_name: await self.decode_batch(payloads, spec)}
