"""The text-classifier recipe: tokenize (layerserve's Tokenizer), train embedding + average pooling + softmax,
and write the result as a new version folder atomically (a hidden staging folder, then a rename)."""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Self

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from layerserve.errors import BadRequestError
from layerserve.settings import describe_validation_error
from layerserve.training.tokenizer import Tokenizer

LABELS_FILE = "labels.txt"
METRICS_FILE = "metrics.json"
NEW_MODEL_CONFIG = "description: text classifier trained by layerserve\ninput: text\n"  # a model training creates


class TrainingParams(BaseModel):
    """A recipe's training parameters (unknown names are refused)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def parse(cls, values: Any) -> Self:
        """Params from a mapping of names to values (HTTP or CLI).

        Raises:
            BadRequestError: not a mapping, an unknown name or a bad value (each named, the known listed).
        """
        if not isinstance(values, dict):
            raise BadRequestError("'params' must be a JSON object of training parameters")
        try:
            return cls.model_validate(values)
        except ValidationError as error:
            known = ", ".join(cls.model_fields)
            raise BadRequestError(f"{describe_validation_error(error, 'param')} (known params: {known})") from None


class TextTrainingParams(TrainingParams):
    """Training parameters of the text recipe."""

    split: Literal["whitespace", "character"] = Field(
        "whitespace", description="whitespace: words (English); character: each character (Chinese)."
    )
    ngrams: int = Field(2, ge=1, le=4, description="Token n-grams up to this length are added.")
    max_tokens: int = Field(20000, ge=10, le=1_000_000, description="Vocabulary size (most frequent tokens).")
    sequence_length: int = Field(128, ge=1, le=4096, description="Tokens per text (padded or cut).")
    embedding_dim: int = Field(32, ge=2, le=1024, description="Width of the token embedding.")
    epochs: int = Field(
        20, ge=1, le=1000,
        description="The most passes over the training rows: training stops once the validation loss has not "
        "improved for `patience` epochs, and keeps the best epoch's weights.",
    )  # fmt: skip
    patience: int = Field(2, ge=1, le=1000, description="Epochs without a better validation loss before stopping.")
    batch_size: int = Field(32, ge=1, le=65536, description="Rows per training step.")
    learning_rate: float = Field(
        0.01, gt=0, le=1,
        description="Adam's peak learning rate: reached after a short warm-up, then decayed along a cosine to "
        "zero at the last of `epochs`.",
    )  # fmt: skip
    validation_split: float = Field(0.2, ge=0, lt=1, description="Share of the rows held out for validation.")
    seed: int = Field(0, ge=0, description="Seed of the shuffle, the split and the weights.")


ProgressCallback = Callable[[dict[str, Any]], None]


@dataclass
class TrainedText:
    """A trained text classifier with what serving it needs."""

    model: Any
    tokenizer: Tokenizer
    labels: list[str]
    metrics: dict[str, list[float]] = field(default_factory=dict)
    best_epoch: int = 0  # the epoch whose weights these are (the lowest validation loss)


def check_dataset(texts: list[str], labels: list[str]) -> None:
    """Refuse data no job should start on.

    Raises:
        BadRequestError: empty data, lengths that differ, non-strings, or a single label.
    """
    if not texts:
        raise BadRequestError("the dataset is empty")
    if len(texts) != len(labels):
        raise BadRequestError(f"{len(texts)} texts but {len(labels)} labels: give one label per text")
    if not all(isinstance(t, str) for t in texts) or not all(isinstance(label, str) for label in labels):
        raise BadRequestError("texts and labels must be strings")
    if len(set(labels)) < 2:
        raise BadRequestError(f"the dataset has a single label {labels[0]!r}: a classifier needs at least two")


def check_text_model(model_dir: Path) -> None:
    """Training may add versions to a text model, or create a new one; nothing else.

    Raises:
        BadRequestError: the model exists and its config.yaml is invalid or not `input: text`.
    """
    from layerserve.lifecycle.repository import scan_model

    if not model_dir.exists():
        return
    spec = scan_model(model_dir)
    if spec.error:
        raise BadRequestError(f"model '{model_dir.name}' has an invalid config.yaml: {spec.error}")
    if spec.config.input != "text":
        raise BadRequestError(
            f"model '{model_dir.name}' is not a text model (its config.yaml has input: {spec.config.input}); "
            "train a new model name, or one whose config.yaml says input: text"
        )


def check_version_writable(model_dir: Path) -> None:
    """Training writes its version into the model's folder (a new model's, beside the others; a new repository's,
    into the nearest folder there is): refuse before it starts when that folder is read-only.

    Raises:
        ReadOnlyRepositoryError: the folder cannot be written (409).
    """
    from layerserve.lifecycle.repository import check_writable

    folder = model_dir
    while not folder.is_dir() and folder.parent != folder:
        folder = folder.parent
    check_writable(folder, f"train model '{model_dir.name}'")


def train_text_classifier(
    texts: list[str], labels: list[str], params: TextTrainingParams, progress: ProgressCallback | None = None
) -> TrainedText:
    """Train the recipe on shuffled data, holding out `validation_split` for validation metrics.

    `progress` gets `{"epoch", "epochs", "step", "steps"}` during each epoch (at most once a second) and,
    at each epoch's end, the epoch's metrics too (`loss`, `accuracy`, `val_loss`, `val_accuracy`). With held-out
    rows, training stops early (see TextTrainingParams.epochs) and the weights are the best epoch's.

    Raises:
        BadRequestError: per check_dataset.
    """
    import keras

    check_dataset(texts, labels)
    order = list(range(len(texts)))
    random.Random(params.seed).shuffle(order)
    texts, labels = [texts[i] for i in order], [labels[i] for i in order]
    held_out = int(len(texts) * params.validation_split)
    cut = len(texts) - held_out
    names = sorted(set(labels))
    tokenizer = Tokenizer(params.split, params.ngrams, params.max_tokens, params.sequence_length).fit(texts[:cut])
    x, y = tokenizer.encode(texts), np.array([names.index(label) for label in labels])
    keras.utils.set_random_seed(params.seed)
    tokens = keras.Input((params.sequence_length,), dtype="int32", name="tokens")
    # Padding is masked: the average is over a text's own tokens, not diluted by its padding.
    embedded = keras.layers.Embedding(tokenizer.size, params.embedding_dim, mask_zero=True, name="embedding")(tokens)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(embedded)
    dropped = keras.layers.Dropout(0.2, name="dropout")(pooled)
    scores = keras.layers.Dense(len(names), activation="softmax", name="scores")(dropped)
    model = keras.Model(tokens, scores, name="text_classifier")
    model.compile(
        optimizer=keras.optimizers.Adam(_learning_rate(params, steps_per_epoch=-(-cut // params.batch_size))),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    validation = (x[cut:], y[cut:]) if held_out else None
    callbacks = [progress_reporter(params.epochs, progress)] if progress else []
    if held_out:
        callbacks.append(
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=params.patience, restore_best_weights=True)
        )
    history = model.fit(
        x[:cut], y[:cut], validation_data=validation, epochs=params.epochs, batch_size=params.batch_size,
        verbose=0, callbacks=callbacks,
    )  # fmt: skip
    metrics = {key: [float(v) for v in values] for key, values in history.history.items()}
    # The weights are the best validation epoch's (early stopping restored them), or without held-out rows the last's.
    best = metrics["val_loss"].index(min(metrics["val_loss"])) + 1 if held_out else len(metrics["loss"])
    return TrainedText(model, tokenizer, names, metrics, best_epoch=best)


def _learning_rate(params: TextTrainingParams, steps_per_epoch: int) -> Any:
    """A linear warm-up to `learning_rate` over half an epoch (at most a tenth of the run), then a cosine decay to
    zero at the last epoch: a high rate early makes the embedding converge in few epochs, the decay settles it."""
    import keras

    total = steps_per_epoch * params.epochs
    warmup = max(1, min(total // 10, steps_per_epoch // 2))
    return keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps=max(1, total - warmup), warmup_target=params.learning_rate, warmup_steps=warmup
    )


def progress_reporter(epochs: int, report: ProgressCallback) -> Any:
    """A Keras callback that reports each epoch's steps (at most once a second) and metrics to `report`."""
    import keras

    class ProgressReporter(keras.callbacks.Callback):  # type: ignore[misc]  # keras is untyped
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._epoch, self._last = epoch + 1, 0.0
            report({"epoch": self._epoch, "epochs": epochs, "step": 0, "steps": self.params.get("steps") or 0})

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            now = time.monotonic()
            if now - self._last >= 1.0:
                self._last = now
                steps = self.params.get("steps") or 0
                report({"epoch": self._epoch, "epochs": epochs, "step": batch + 1, "steps": steps})

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            metrics = {key: float(value) for key, value in (logs or {}).items()}
            steps = self.params.get("steps") or 0
            report({"epoch": epoch + 1, "epochs": epochs, "step": steps, "steps": steps, **metrics})

    return ProgressReporter()


def write_version(model_dir: Path, trained: TrainedText, params: TextTrainingParams, tag: str = "") -> int:
    """Write the next version folder of a text model atomically (see stage_version); returns its number."""

    def fill(version_dir: Path) -> None:
        trained.model.save(version_dir / "model.keras")
        trained.tokenizer.save(version_dir)
        (version_dir / LABELS_FILE).write_text("\n".join(trained.labels) + "\n", encoding="utf-8")
        summary = {"params": params.model_dump(), "history": trained.metrics, "best_epoch": trained.best_epoch}
        (version_dir / METRICS_FILE).write_text(json.dumps(summary, ensure_ascii=False, indent=1), encoding="utf-8")

    return stage_version(model_dir, fill, NEW_MODEL_CONFIG, tag)


def stage_version(model_dir: Path, fill: Callable[[Path], None], new_model_config: str, tag: str = "") -> int:
    """Write the next version folder of a model atomically; returns its number.

    `fill` writes the version's files into a hidden `.staging-<tag>-*` folder, which is then renamed to its number.
    A model that does not exist yet is staged whole (`new_model_config` as its config.yaml, and version 1) beside
    the other models and renamed into place, so the reloader never sees half of it.
    """
    is_new = not model_dir.exists()
    parent = model_dir.parent if is_new else model_dir
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".staging-{tag}-", dir=parent))
    try:
        version_dir = staging / "1" if is_new else staging
        version_dir.mkdir(exist_ok=True)
        fill(version_dir)
        if is_new:
            (staging / "config.yaml").write_text(new_model_config, encoding="utf-8")
            staging.rename(model_dir)
            return 1
        numbers = [int(p.name) for p in model_dir.iterdir() if p.name.isascii() and p.name.isdigit()]
        number = max(numbers, default=0) + 1
        staging.rename(model_dir / str(number))
        return number
    finally:
        shutil.rmtree(staging, ignore_errors=True)
