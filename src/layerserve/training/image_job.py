"""The server's side of an image-classifier job (ImageData). Its features phase: each photo's (and each augmented
copy's) output of the base model's layer, computed by the base as it serves (its engine, batched) and kept in the
feature store under the base's version, the layer and the photo's digest, so that a second training on the same
photos computes none."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from layerserve.dataplane import DataPlane
from layerserve.errors import BadRequestError, QueueFullError
from layerserve.messages import FeaturesRequest
from layerserve.serving.layers import LayerGraph
from layerserve.training.image_data import LabelledPhoto
from layerserve.training.image_recipe import ImageTrainingParams, new_model_config, split_photos, write_features

_CHUNK = 32  # photos a features request carries: one batch of the base's
_AUGMENTATIONS = ("flip", "crop")
_CROP = 0.8  # the centre crop keeps this share of each side
_QUEUE_FULL_WAITS_S = (0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass(frozen=True)
class BaseLayer:
    """Where the features come from: a version of the base model, its layer, and what else changes a photo's
    features: the version's weights (a digest of its model file: a folder written again under the same number) and
    how it reads images (a digest of its image settings)."""

    model: str
    version: int
    layer: str
    weights: str = ""
    reading: str = ""

    def feature_id(self, photo: LabelledPhoto, how: str) -> str:
        """A photo's (or its augmented copy's) id in the feature store, apart from ids clients give."""
        return f"train-{self.weights[:12]}-{self.reading}-{photo.digest}{'-' + how if how else ''}"


_POOLING = ("GlobalAveragePooling2D", "GlobalMaxPooling2D", "GlobalAveragePooling1D", "GlobalMaxPooling1D")


def feature_layer(graph: LayerGraph, asked: str | None) -> tuple[str, str]:
    """(the tensor whose features are computed, the Keras layer that outputs it): the one `asked` names, else the
    graph's last pooling layer.

    Raises:
        BadRequestError: no such tensor (close names given), a model input, a layer of several outputs or of rank
            over 4, no pooling layer to default to.
    """
    if asked is None:
        pooled = [layer for layer in graph.layers if layer.class_name in _POOLING]
        if not pooled:
            raise BadRequestError(
                "the base model has no pooling layer to train on by default: name one of its layers as params.layer"
            )
        if "/" in pooled[-1].name:
            raise BadRequestError(
                f"the base's last pooling layer {pooled[-1].name!r} is inside a nested model: name a layer of the "
                "base's own graph as params.layer"
            )
        return pooled[-1].outputs[0].name, pooled[-1].name
    spec = graph.spec(asked, "layer")
    for layer in graph.layers:
        if any(output.name == spec.name for output in layer.outputs):
            if "/" in layer.name:
                raise BadRequestError(
                    f"layer {asked!r} is inside a model nested in the base: name a layer of the base's own graph"
                )
            if layer.class_name == "InputLayer":
                raise BadRequestError(f"{asked!r} is the base model's input: name one of its layers")
            if len(layer.outputs) != 1 or len(spec.shape) > 4:
                raise BadRequestError(
                    f"layer {asked!r} gives {len(layer.outputs)} outputs of rank {len(spec.shape)}: name a layer with "
                    "one output, a vector or a map"
                )
            return spec.name, layer.name
    raise BadRequestError(f"{asked!r} is not a layer's output of the base model: name one of its layers")


def augmented(photo: LabelledPhoto, how: str) -> bytes:
    """The photo flipped left-right, or cropped to its centre, encoded as PNG."""
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(photo.data)) as opened:
        image = ImageOps.exif_transpose(opened).convert("RGB")
    if how == "flip":
        image = ImageOps.mirror(image)
    else:
        width, height = image.size
        left, top = round(width * (1 - _CROP) / 2), round(height * (1 - _CROP) / 2)
        image = image.crop((left, top, width - left, height - top))
    encoded = io.BytesIO()
    image.save(encoded, format="PNG")
    return encoded.getvalue()


async def photo_features(
    data: DataPlane, base: BaseLayer, photos: list[LabelledPhoto], classes: list[str], training: list[int],
    validation: list[int], augment: bool, report: Callable[[dict[str, Any]], None],
) -> tuple[dict[str, np.ndarray], dict[str, int]]:  # fmt: skip
    """(x_train, y_train, x_val, y_val; {"computed", "reused"}): the training photos (and, with `augment`, their
    flipped and cropped copies) and the validation photos, as rows of the base's layer output (maps averaged).

    Raises:
        LayerserveError: the base cannot serve (not found, failed, the budget full), the feature store failed.
    """
    wanted: dict[str, tuple[LabelledPhoto, str]] = {}  # feature id -> (photo, augmentation or "")
    rows_of: list[tuple[int, str]] = []  # (photo index, feature id) per row, training rows first
    for index in training:
        photo = photos[index]
        for how in ("", *(_AUGMENTATIONS if augment else ())):
            feature_id = base.feature_id(photo, how)
            wanted.setdefault(feature_id, (photo, how))
            rows_of.append((index, feature_id))
    for index in validation:
        feature_id = base.feature_id(photos[index], "")
        wanted.setdefault(feature_id, (photos[index], ""))
        rows_of.append((index, feature_id))
    ids = list(wanted)
    found: dict[str, np.ndarray] = {}
    for start in range(0, len(ids), 256):
        chunk = ids[start : start + 256]
        stored = await data.stored_features(base.model, chunk, base.version, base.layer)
        found.update({i: f.array for i, f in zip(chunk, stored, strict=True) if f is not None and f.array.ndim == 1})
    reused = len(found)
    missing = [i for i in ids if i not in found]
    report({"phase": "features", "done": reused, "total": len(ids), "reused": reused})
    for start in range(0, len(missing), _CHUNK):
        chunk = missing[start : start + _CHUNK]
        items = await asyncio.to_thread(_encoded, [wanted[i] for i in chunk])  # off the loop: ms a photo
        request = FeaturesRequest(
            base.model, items, base.layer, pool="default", version=base.version, use_cache=False, ids=chunk
        )
        rows = await _features_of(data, request)
        found.update(zip(chunk, np.asarray(rows, np.float32), strict=True))
        done = reused + start + len(chunk)
        report({"phase": "features", "done": done, "total": len(ids), "reused": reused})
    x = np.stack([found[feature_id].reshape(-1) for _, feature_id in rows_of]).astype(np.float32)
    y = np.array([classes.index(photos[index].label) for index, _ in rows_of], np.int64)
    cut = len(rows_of) - len(validation)
    features: dict[str, np.ndarray] = {"x_train": x[:cut], "y_train": y[:cut], "x_val": x[cut:], "y_val": y[cut:]}
    return features, {"computed": len(missing), "reused": reused}


async def _features_of(data: DataPlane, request: FeaturesRequest) -> np.ndarray:
    """The features of one request's photos, waiting for room when the base's queue is full (it serves meanwhile)."""
    for wait_s in _QUEUE_FULL_WAITS_S:
        try:
            return np.asarray((await data.features(request)).features)
        except QueueFullError:
            await asyncio.sleep(wait_s)
    return np.asarray((await data.features(request)).features)


def _encoded(photos: list[tuple[LabelledPhoto, str]]) -> list[bytes | str]:
    """Each photo's bytes, or its augmented copy's."""
    return [photo.data if not how else augmented(photo, how) for photo, how in photos]


class ImageData:
    """Labelled photos and the base layer to train on (a JobData): the features are computed once the job starts,
    and written for its process (features.json and its arrays), with what it needs to build the served model."""

    recipe = "image"

    def __init__(
        self, data: DataPlane, base: BaseLayer, keras_layer: str, base_folder: Path, base_config: dict[str, Any],
        photos: list[LabelledPhoto], classes: list[str], params: ImageTrainingParams, trust: bool,
    ) -> None:  # fmt: skip
        self._data, self._base, self._photos, self._classes, self._params = data, base, photos, classes, params
        self._spec = {
            "recipe": self.recipe, "base_folder": str(base_folder), "layer": keras_layer, "classes": classes,
            "trust": trust, "config_yaml": new_model_config(base_config, base.model, base.version, base.layer),
            "summary": {"base": {"model": base.model, "version": base.version, "layer": base.layer},
                        "photos": {label: sum(p.label == label for p in photos) for label in classes}},
        }  # fmt: skip
        self.rows = len(photos)

    def write(self, job_dir: Path) -> dict[str, Any]:
        """Nothing yet (the photos stay in memory until the job starts); what job.json adds."""
        return self._spec

    async def prepare(self, job_dir: Path, report: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """The features of the photos (see photo_features), into the job's folder (write_features); {"features":
        {"computed", "reused", "seconds"}}."""
        started = time.perf_counter()
        training, validation = split_photos(
            [photo.label for photo in self._photos], self._params.validation_split, self._params.seed
        )
        features, counts = await photo_features(
            self._data, self._base, self._photos, self._classes, training, validation, self._params.augment, report
        )
        await asyncio.to_thread(write_features, job_dir, features)
        self._photos = []  # the features are all the process needs
        return {"features": {**counts, "seconds": round(time.perf_counter() - started, 3)}}
