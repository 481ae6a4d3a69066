"""Explanations of a class score: where in the image the model saw the evidence for it, computed with forward passes
only (so on the engine that serves the model, ONNX Runtime included, with no gradients and no TensorFlow).

- Score-CAM (Wang et al., 2020) over a convolutional layer's activations: each of the layer's most active channels,
  upsampled and scaled to [0, 1], masks the image; the class's score on each masked image, less its score on a
  black image, weighs that channel; the heatmap is the weighed sum of the channels, its negative part cut.
- Occlusion, for a model with no spatial layer: a grid of patches, each greyed out in turn; the heatmap is the drop
  of the class's score.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from layerserve.errors import BadRequestError
from layerserve.serving.layers import LayerGraph
from layerserve.tensors import Array

# (a batch of model inputs, the outputs wanted) -> those outputs
Predict = Callable[[Array, tuple[str, ...]], Awaitable[dict[str, Array]]]
METHODS = ("score-cam", "occlusion")
_MIN_SPATIAL = 2  # a layer whose map is 1x1 locates nothing


@dataclass(frozen=True)
class Explanation:
    """A heatmap (rows x columns over the image the model saw, in [0, 1]) for one class's score."""

    heatmap: Array
    class_index: int
    score: float
    method: str
    layer: str | None


def spatial_layer(graph: LayerGraph, asked: str | None, image_size: tuple[int, int]) -> str | None:
    """The layer Score-CAM uses: the one `asked` names, else the last whose output is a map (N, h, w, channels) of at
    least 2x2 and smaller than the image; None when there is none (occlusion then).

    Raises:
        BadRequestError: the named layer does not exist (close names given), or its output is not such a map.
    """
    if asked is not None:
        shape = graph.spec(asked, "layer").shape
        if any(
            layer.class_name == "InputLayer" and any(o.name == asked for o in layer.outputs) for layer in graph.layers
        ):
            raise BadRequestError(f"{asked!r} is the model's input: name one of its layers")
        if len(shape) != 4 or min(shape[1], shape[2]) < _MIN_SPATIAL:
            raise BadRequestError(
                f"layer {asked!r} gives {list(shape)}: Score-CAM needs a map shaped [-1, rows, columns, channels] of "
                "at least 2x2"
            )
        return asked
    found = None
    for layer in graph.layers:
        for spec in layer.outputs:
            shape = spec.shape
            if (
                layer.class_name != "InputLayer" and len(shape) == 4 and min(shape[1], shape[2]) >= _MIN_SPATIAL
                and (shape[1], shape[2]) != image_size
            ):  # fmt: skip
                found = spec.name
    return found


def _normalized(maps: Array) -> Array:
    """Each map scaled to [0, 1] (a flat one to 0)."""
    low = maps.min(axis=(1, 2), keepdims=True)
    span = maps.max(axis=(1, 2), keepdims=True) - low
    scaled: Array = np.where(span > 0, (maps - low) / np.where(span > 0, span, 1), 0.0)
    return scaled


def upsampled(maps: Array, size: tuple[int, int]) -> Array:
    """(n, h, w) maps -> (n, rows, columns), bilinear with the corners aligned to the pixels' centres."""
    from PIL import Image

    rows, columns = size
    return np.stack(
        [
            np.asarray(
                Image.fromarray(m.astype(np.float32), mode="F").resize((columns, rows), Image.Resampling.BILINEAR)
            )
            for m in maps
        ]
    )


async def _scores(predict: Predict, count: int, images: Callable[[int, int], Array], output: str, batch: int) -> Array:
    """The score rows of `output` for `count` model inputs, made `batch` at a time by `images(start, stop)` on a
    thread (masked copies of an image are tens of MB: never all at once, never on the event loop)."""
    rows = []
    for start in range(0, count, batch):
        chunk = await asyncio.to_thread(images, start, min(count, start + batch))
        rows.append(np.asarray((await predict(chunk, (output,)))[output], np.float64).reshape(len(chunk), -1))
    return np.concatenate(rows)


def _chosen(scores: Array, class_index: int | None) -> int:
    if class_index is None:
        return int(np.argmax(scores))
    if not 0 <= class_index < scores.size:
        raise BadRequestError(f"class {class_index} is out of range: the model scores {scores.size} classes")
    return class_index


async def score_cam(
    predict: Predict, pixels: Array, to_input: Callable[[Array], Array], layer: str, output: str,
    class_index: int | None, channels: int, batch: int,
) -> Explanation:  # fmt: skip
    """Score-CAM over `layer` for the image `pixels` ((H, W, C), 0..255): see the module. `channels` of the layer's
    channels are used (the most active ones)."""
    answer = await predict(to_input(pixels[None]), (layer, output))
    activations = np.asarray(answer[layer], np.float64)[0]  # (h, w, k)
    scores = np.asarray(answer[output], np.float64).reshape(-1)
    chosen = _chosen(scores, class_index)
    strongest = np.argsort(activations.mean(axis=(0, 1)))[::-1][:channels]
    maps = np.moveaxis(activations[:, :, strongest], -1, 0)  # (n, h, w)

    def masked(start: int, stop: int) -> Array:  # the image masked by maps[start:stop], a black image last
        images = np.zeros((stop - start, *pixels.shape), np.float32)
        if start < len(maps):
            masks = _normalized(upsampled(maps[start:stop], pixels.shape[:2]))
            images[: len(masks)] = pixels[None] * masks[..., None]
        return to_input(images)

    found = (await _scores(predict, len(maps) + 1, masked, output, batch))[:, chosen]
    weights = found[:-1] - found[-1]  # each channel's evidence over a black image's
    heatmap = np.maximum(np.tensordot(maps, weights, axes=(0, 0)), 0.0)
    peak = heatmap.max()
    return Explanation(heatmap / peak if peak > 0 else heatmap, chosen, float(scores[chosen]), "score-cam", layer)


async def occlusion(
    predict: Predict, pixels: Array, to_input: Callable[[Array], Array], output: str, class_index: int | None,
    grid: int, batch: int,
) -> Explanation:  # fmt: skip
    """Occlusion on a `grid` x `grid` of patches for the image `pixels` ((H, W, C), 0..255): see the module."""
    scores = (await _scores(predict, 1, lambda *_: to_input(pixels[None].astype(np.float32)), output, 1))[0]
    chosen = _chosen(scores, class_index)
    height, width = pixels.shape[:2]
    rows = [round(i * height / grid) for i in range(grid + 1)]
    columns = [round(j * width / grid) for j in range(grid + 1)]
    grey = pixels.mean(axis=(0, 1))

    def occluded(start: int, stop: int) -> Array:  # the image with patches start..stop-1 of the grid greyed, each
        images = np.repeat(pixels[None], stop - start, axis=0).astype(np.float32)
        for row, patch in enumerate(range(start, stop)):
            i, j = divmod(patch, grid)
            images[row, rows[i] : rows[i + 1], columns[j] : columns[j + 1]] = grey
        return to_input(images)

    found = (await _scores(predict, grid * grid, occluded, output, batch))[:, chosen]
    heatmap = np.maximum(scores[chosen] - found, 0.0).reshape(grid, grid)
    peak = heatmap.max()
    return Explanation(heatmap / peak if peak > 0 else heatmap, chosen, float(scores[chosen]), "occlusion", None)


def overlay_png(pixels: Array, heatmap: Array) -> bytes:
    """The image the model saw with the heatmap over it (red where it is high), as PNG."""
    from PIL import Image

    height, width = pixels.shape[:2]
    heat = upsampled(heatmap[None], (height, width))[0].clip(0, 1)[..., None]
    base = pixels if pixels.shape[2] == 3 else np.repeat(pixels, 3, axis=2)
    red = np.array([255.0, 40.0, 0.0])
    blended = base * (1 - 0.6 * heat) + red * 0.6 * heat
    encoded = io.BytesIO()
    Image.fromarray(blended.clip(0, 255).astype(np.uint8)).save(encoded, format="PNG")
    return encoded.getvalue()
