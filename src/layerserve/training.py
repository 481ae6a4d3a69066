"""The text-classifier recipe: tokenize (layerserve's Tokenizer), train embedding + average pooling + softmax,
and write the result as a new version folder atomically (a hidden staging folder, then a rename)."""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from layerserve.errors import BadRequestError
from layerserve.text import Tokenizer

LABELS_FILE = "labels.txt"
METRICS_FILE = "metrics.json"


@dataclass(frozen=True)
class TextTrainingParams:
    """Training parameters of the text recipe."""

    split: Literal["whitespace", "character"] = "whitespace"
    ngrams: int = 2
    max_tokens: int = 20000
    sequence_length: int = 128
    embedding_dim: int = 32
    epochs: int = 8
    batch_size: int = 32
    learning_rate: float = 0.005
    validation_split: float = 0.2
    seed: int = 0


@dataclass
class TrainedText:
    """A trained text classifier with what serving it needs."""

    model: Any
    tokenizer: Tokenizer
    labels: list[str]
    metrics: dict[str, list[float]] = field(default_factory=dict)


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


def train_text_classifier(texts: list[str], labels: list[str], params: TextTrainingParams) -> TrainedText:
    """Train the recipe on shuffled data, holding out `validation_split` for validation metrics.

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
    embedded = keras.layers.Embedding(tokenizer.size, params.embedding_dim, name="embedding")(tokens)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(embedded)
    dropped = keras.layers.Dropout(0.2, name="dropout")(pooled)
    scores = keras.layers.Dense(len(names), activation="softmax", name="scores")(dropped)
    model = keras.Model(tokens, scores, name="text_classifier")
    model.compile(
        optimizer=keras.optimizers.Adam(params.learning_rate),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    validation = (x[cut:], y[cut:]) if held_out else None
    history = model.fit(
        x[:cut], y[:cut], validation_data=validation, epochs=params.epochs, batch_size=params.batch_size, verbose=0
    )
    metrics = {key: [float(v) for v in values] for key, values in history.history.items()}
    return TrainedText(model, tokenizer, names, metrics)


def write_version(model_dir: Path, trained: TrainedText, params: TextTrainingParams) -> int:
    """Write the next version folder of a model atomically; returns its number."""
    model_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=model_dir))
    try:
        trained.model.save(staging / "model.keras")
        trained.tokenizer.save(staging)
        (staging / LABELS_FILE).write_text("\n".join(trained.labels) + "\n", encoding="utf-8")
        summary = {"params": asdict(params), "history": trained.metrics}
        (staging / METRICS_FILE).write_text(json.dumps(summary, ensure_ascii=False, indent=1), encoding="utf-8")
        numbers = [int(p.name) for p in model_dir.iterdir() if p.name.isdigit()]
        number = max(numbers, default=0) + 1
        staging.rename(model_dir / str(number))
        return number
    finally:
        shutil.rmtree(staging, ignore_errors=True)
