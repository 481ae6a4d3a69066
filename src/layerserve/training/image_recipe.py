"""The image-classifier recipe: a small head (a hidden layer, dropout, softmax) trained on a base model's layer
output for labelled photos (the features the server computed, see training/image_features.py), then written as one
model: the base cut at that layer with the head on top, so a request costs one engine call and the version keeps
the base weights it was trained on."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from layerserve.errors import BadRequestError
from layerserve.training.recipe import LABELS_FILE, METRICS_FILE, TrainingParams, progress_reporter, stage_version

FEATURES_FILE = "features.json"  # the features' arrays: each's dtype and shape, its raw bytes in <name>.bin beside it
# What a trained model's config.yaml keeps of its base's: how its images are read and batched.
_INHERITED_CONFIG = ("engine", "resize", "interpolation", "preprocess", "scale", "offset", "max_batch_size",
                     "max_delay_ms", "warmup_batch_size")  # fmt: skip


class ImageTrainingParams(TrainingParams):
    """Training parameters of the image recipe."""

    base: str = Field(description="The image model whose layer the head is trained on (a model of the repository).")
    base_version: int | None = Field(None, ge=1, description="Its version (default: the one it serves now).")
    layer: str | None = Field(
        None, description="The base's layer whose output the head reads (default: its last pooled layer); a map is "
        "averaged over its spatial axes.",
    )  # fmt: skip
    hidden: int = Field(128, ge=0, le=8192, description="Units of the head's hidden layer (0: none).")
    dropout: float = Field(0.2, ge=0, lt=1, description="Dropout before the head's output layer.")
    epochs: int = Field(
        60, ge=1, le=1000,
        description="The most passes over the training photos: training stops once the validation loss has not "
        "improved for `patience` epochs, and keeps the best epoch's weights.",
    )  # fmt: skip
    patience: int = Field(8, ge=1, le=1000, description="Epochs without a better validation loss before stopping.")
    batch_size: int = Field(32, ge=1, le=65536, description="Photos per training step.")
    learning_rate: float = Field(0.001, gt=0, le=1, description="Adam's learning rate.")
    validation_split: float = Field(
        0.2, ge=0, lt=1, description="Share of each class's photos held out for validation (at least one each)."
    )
    seed: int = Field(0, ge=0, description="Seed of the split, the augmentation and the weights.")
    augment: bool = Field(
        True, description="Also train on each training photo flipped left-right and cropped to its centre 80%."
    )


def write_features(job_dir: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write named arrays into a job's folder as raw bytes and a JSON index (nothing to unpickle)."""
    index = {}
    for name, array in arrays.items():
        contiguous = np.ascontiguousarray(array)
        contiguous.tofile(job_dir / f"{name}.bin")
        index[name] = {"dtype": contiguous.dtype.str, "shape": list(contiguous.shape)}
    (job_dir / FEATURES_FILE).write_text(json.dumps(index), encoding="utf-8")


def read_features(job_dir: Path) -> dict[str, np.ndarray]:
    """The arrays write_features wrote."""
    index = json.loads((job_dir / FEATURES_FILE).read_text(encoding="utf-8"))
    return {
        name: np.fromfile(job_dir / f"{name}.bin", dtype=np.dtype(spec["dtype"])).reshape(spec["shape"])
        for name, spec in index.items()
    }


def split_photos(labels: list[str], validation_split: float, seed: int) -> tuple[list[int], list[int]]:
    """(training, validation) indexes: each class's photos shuffled, `validation_split` of them held out (at least
    one, and never the class's last) when the split is not 0."""
    by_class: dict[str, list[int]] = {}
    for index, label in enumerate(labels):
        by_class.setdefault(label, []).append(index)
    rng = random.Random(seed)
    training, validation = [], []
    for label in sorted(by_class):
        indexes = by_class[label]
        rng.shuffle(indexes)
        held = 0 if validation_split == 0 else min(len(indexes) - 1, max(1, round(len(indexes) * validation_split)))
        validation += indexes[:held]
        training += indexes[held:]
    return sorted(training), sorted(validation)


ProgressCallback = Callable[[dict[str, Any]], None]


@dataclass
class TrainedHead:
    """A trained head with its history."""

    model: Any
    labels: list[str]
    metrics: dict[str, list[float]] = field(default_factory=dict)
    best_epoch: int = 0


def train_head(
    features: dict[str, np.ndarray], labels: list[str], params: ImageTrainingParams,
    progress: ProgressCallback | None = None,
) -> TrainedHead:  # fmt: skip
    """Train the head on `features` (x_train, y_train, x_val, y_val: rows and class indexes into `labels`), with
    early stopping on the validation loss when there are validation rows."""
    import keras

    keras.utils.set_random_seed(params.seed)
    x_train, y_train = features["x_train"], features["y_train"]
    x_val, y_val = features["x_val"], features["y_val"]
    inputs = keras.Input((x_train.shape[1],), name="features")
    x = inputs
    if params.hidden:
        x = keras.layers.Dense(params.hidden, activation="relu", name="head_hidden")(x)
    x = keras.layers.Dropout(params.dropout, name="head_dropout")(x)
    scores = keras.layers.Dense(len(labels), activation="softmax", name="head_scores")(x)
    head = keras.Model(inputs, scores, name="head")
    head.compile(
        optimizer=keras.optimizers.Adam(params.learning_rate),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    held_out = len(x_val) > 0
    callbacks = [progress_reporter(params.epochs, progress)] if progress else []
    if held_out:
        callbacks.append(
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=params.patience, restore_best_weights=True)
        )
    history = head.fit(
        x_train, y_train, validation_data=(x_val, y_val) if held_out else None, epochs=params.epochs,
        batch_size=params.batch_size, shuffle=True, verbose=0, callbacks=callbacks,
    )  # fmt: skip
    metrics = {key: [float(v) for v in values] for key, values in history.history.items()}
    best = metrics["val_loss"].index(min(metrics["val_loss"])) + 1 if held_out else len(metrics["loss"])
    return TrainedHead(head, labels, metrics, best)


def served_model(base: Any, layer: str, head: Any) -> Any:
    """One Keras model: `base` from its inputs to `layer` (a map averaged over its spatial axes, as the features
    were), then the head's layers with their trained weights.

    Raises:
        BadRequestError: the base has no such layer.
    """
    import keras

    try:
        x = base.get_layer(layer).output
    except ValueError:
        raise BadRequestError(f"the base model has no layer {layer!r}") from None
    if len(x.shape) == 4:
        x = keras.layers.GlobalAveragePooling2D(name="head_pool")(x)
    elif len(x.shape) == 3:
        x = keras.layers.GlobalAveragePooling1D(name="head_pool")(x)
    try:
        for trained in head.layers[1:]:  # past its Input
            x = trained(x)
        return keras.Model(base.inputs, x, name="image_classifier")
    except ValueError as error:  # e.g. a base that has a layer of the head's names already
        raise BadRequestError(f"the base cut at {layer!r} and the head do not make one model: {error}") from None


def new_model_config(base_config: dict[str, Any], base: str, version: int, layer: str) -> str:
    """The config.yaml of a model training creates: the base's image settings, and where it came from."""
    import yaml

    config = {key: base_config[key] for key in _INHERITED_CONFIG if base_config.get(key) is not None}
    config = {
        "description": f"image classifier trained by layerserve on {base} version {version}, layer {layer}",
        "input": "image", **config,
    }  # fmt: skip
    return str(yaml.safe_dump(config, sort_keys=False))


def write_image_version(
    model_dir: Path, model: Any, trained: TrainedHead, summary: dict[str, Any], config_yaml: str, tag: str = ""
) -> int:
    """Write the next version folder of an image model atomically (see stage_version); returns its number."""

    def fill(version_dir: Path) -> None:
        model.save(version_dir / "model.keras")
        (version_dir / LABELS_FILE).write_text("\n".join(trained.labels) + "\n", encoding="utf-8")
        written = {**summary, "history": trained.metrics, "best_epoch": trained.best_epoch}
        (version_dir / METRICS_FILE).write_text(json.dumps(written, ensure_ascii=False, indent=1), encoding="utf-8")

    return stage_version(model_dir, fill, config_yaml, tag)
