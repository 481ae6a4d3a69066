"""The many-models benchmark's repository: N distinct small Keras models (and a few EfficientNet-sized ones), each
exported to ONNX by layerserve's own preparer into the engine cache the servers then use.

    .venv/bin/python benchmarks/many_models_repo.py FOLDER [--models 1000] [--big 3] [--seed 1]

FOLDER gets `repo/<model>/1/model.keras`, `onnx/` (the servers' `--engine-cache-dir`) and `manifest.json` (each
model's input, file size, hash, ONNX size and preparation time). A model already there is kept, so a second run
costs only the hashes; the manifest records what it was built with, and a folder built otherwise is refused.

Small models are dense (a vector of 16-128 floats, two hidden layers) or convolutional (a 16x16 RGB image, two
convolutions, a hidden layer); their weights are drawn per model (each file has its own hash) and their sizes spread
log-uniformly over 100 KB - 5 MB. The big ones are EfficientNet-Lite0 (19 MB) with Google's ImageNet weights, each
tensor scaled by its own noise (1 + 1% Gaussian), so that each is a file of its own.

Warming the cache calls `layerserve.lifecycle.prepare.prepare_model`, what the server's preparer process runs on a
model's first load (load the file, export with tf2onnx, verify against Keras, locate the layers), here in one
process for every model, so that the timed runs measure loading a prepared model (an ONNX Runtime session) and
not tf2onnx. The server finds the records by the files' hashes, as it would after its own first load of each.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

MANIFEST_FORMAT = 1
SMALL_BYTES = (100_000, 5_000_000)
_OVERHEAD_BYTES = 25_000  # a .keras archive's config and metadata
_IMAGE = (16, 16, 3)


@dataclass(frozen=True)
class ModelEntry:
    """One model of the repository, as the load generator needs it."""

    name: str
    kind: str  # dense, conv or efficientnet
    input_name: str
    input_shape: tuple[int, ...]  # without the batch dimension
    file_bytes: int = 0
    digest: str = ""
    onnx_bytes: int = 0
    prepare_s: float = 0.0  # the preparation in this run (0: found in the cache)


@dataclass(frozen=True)
class Manifest:
    """What a folder holds: its parameters and its models."""

    models: int
    big: int
    seed: int
    entries: tuple[ModelEntry, ...]

    @property
    def repository(self) -> str:
        """The repository, relative to the folder."""
        return "repo"

    def to_json(self) -> dict[str, Any]:
        """The stored form."""
        return {"format": MANIFEST_FORMAT, "models": self.models, "big": self.big, "seed": self.seed,
                "entries": [asdict(entry) for entry in self.entries]}  # fmt: skip

    @classmethod
    def read(cls, folder: Path) -> Manifest | None:
        """The folder's manifest, or None (none yet, or of another format)."""
        try:
            data = json.loads((folder / "manifest.json").read_text())
        except (OSError, ValueError):
            return None
        if data.get("format") != MANIFEST_FORMAT:
            return None
        entries = tuple(ModelEntry(**{**e, "input_shape": tuple(e["input_shape"])}) for e in data["entries"])
        return cls(data["models"], data["big"], data["seed"], entries)


def plan(models: int, big: int, seed: int) -> list[tuple[ModelEntry, int]]:
    """Each model's entry and its target parameter count, drawn from `seed` (big ones spread through the names)."""
    rng = np.random.default_rng(seed)
    big_at = set(rng.choice(models, size=min(big, models), replace=False).tolist()) if big else set()
    low, high = (math.log(size) for size in SMALL_BYTES)
    planned = []
    for index in range(models):
        if index in big_at:
            planned.append((ModelEntry(f"efficientnet_{index:04d}", "efficientnet", "image", (224, 224, 3)), 0))
            continue
        parameters = int((math.exp(rng.uniform(low, high)) - _OVERHEAD_BYTES) / 4)
        if rng.random() < 0.5:
            width = int(rng.choice([16, 32, 64, 128]))
            planned.append((ModelEntry(f"dense_{index:04d}", "dense", "x", (width,)), parameters))
        else:
            planned.append((ModelEntry(f"conv_{index:04d}", "conv", "image", _IMAGE), parameters))
    return planned


def build_model(entry: ModelEntry, parameters: int, seed: int) -> Any:
    """The Keras model of an entry, about `parameters` weights (small kinds), its weights drawn from `seed`."""
    import keras

    keras.utils.set_random_seed(seed)
    classes = 2 + seed % 9
    if entry.kind == "efficientnet":
        return _efficientnet(seed)
    inputs = keras.Input(entry.input_shape, name=entry.input_name)
    if entry.kind == "dense":
        width = entry.input_shape[0]
        hidden = max(8, int((-(width + classes) + math.sqrt((width + classes) ** 2 + 4 * parameters)) / 2))
        x = keras.layers.Dense(hidden, activation="relu", name="hidden1")(inputs)
        x = keras.layers.Dense(hidden, activation="relu", name="hidden2")(x)
    else:
        channels = max(4, int(math.sqrt(parameters / 18)))
        hidden = max(8, int(parameters / 2 / (channels + classes)))
        x = keras.layers.Conv2D(channels, 3, activation="relu", name="conv1")(inputs)
        x = keras.layers.Conv2D(channels, 3, activation="relu", name="conv2")(x)
        x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
        x = keras.layers.Dense(hidden, activation="relu", name="hidden")(x)
    outputs = keras.layers.Dense(classes, activation="softmax", name="probs")(x)
    return keras.Model(inputs, outputs, name=entry.name)


def _efficientnet(seed: int) -> Any:
    from layerserve.demo.efficientnet_lite0 import build_efficientnet_lite0, checkpoint_path
    from layerserve.demo.torch_checkpoint import load_state_dict

    rng = np.random.default_rng(seed)
    weights = load_state_dict(checkpoint_path())
    noisy = {key: np.asarray(value) * (1 + 0.01 * rng.standard_normal(np.shape(value))).astype(np.float32)
             for key, value in weights.items()}  # fmt: skip
    return build_efficientnet_lite0(noisy)


def build(folder: Path, models: int, big: int, seed: int) -> Manifest:
    """Build what is missing of the folder's repository, prepare what is missing of its cache; its manifest."""
    from layerserve.engines.base import onnx_cache_path
    from layerserve.lifecycle.model import file_digest
    from layerserve.lifecycle.prepare import ModelSource, prepare_model, read_record

    old = Manifest.read(folder)
    if old is not None and (old.models, old.big, old.seed) != (models, big, seed):
        raise SystemExit(f"{folder} holds {old.models} models (big {old.big}, seed {old.seed}): use another folder")
    entries = []
    for index, (entry, parameters) in enumerate(plan(models, big, seed)):
        path = folder / "repo" / entry.name / "1" / "model.keras"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(".model.partial.keras")  # a run cut short leaves no half file under the name
            build_model(entry, parameters, seed * 100_003 + index).save(partial)
            partial.replace(path)
        digest = file_digest(path)
        cache_file = onnx_cache_path(folder / "onnx", digest)
        record = read_record(cache_file)
        prepare_s = 0.0
        if record is None or "inputs" not in record:
            started = time.perf_counter()
            record = prepare_model(ModelSource(path, digest, trust=False), cache_file, 2)
            prepare_s = time.perf_counter() - started
            if record.get("max_difference") is None:
                raise SystemExit(f"{entry.name} did not export to ONNX: {record}")
        size = cache_file.stat().st_size
        entries.append(ModelEntry(**{**asdict(entry), "file_bytes": path.stat().st_size, "digest": digest,
                                     "onnx_bytes": size, "prepare_s": round(prepare_s, 3)}))  # fmt: skip
        if index % 50 == 49:
            import keras

            keras.backend.clear_session()  # the graphs of the models exported so far
            print(f"{index + 1} of {models} models built and prepared", flush=True)
    manifest = Manifest(models, big, seed, tuple(entries))
    (folder / "manifest.json").write_text(json.dumps(manifest.to_json(), indent=1) + "\n")
    return manifest


def main() -> None:
    """Build (or complete) one folder."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--big", type=int, default=3, help="EfficientNet-sized models among them")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    from layerserve.logs import import_tensorflow_quietly

    import_tensorflow_quietly()
    build(args.folder, args.models, args.big, args.seed)


if __name__ == "__main__":
    main()
