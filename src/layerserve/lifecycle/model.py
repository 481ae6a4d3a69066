"""Keras model files: find, check, load, and read their signature."""

from __future__ import annotations

import hashlib
import json
import logging
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from layerserve.errors import ModelLoadError
from layerserve.gpu import configure_tensorflow
from layerserve.tensors import TensorSpec, datatype_of

log = logging.getLogger(__name__)

KERAS_FILE = "model.keras"
H5_FILES = ("model.h5", "model.hdf5")
SAVED_MODEL_FILE = "saved_model.pb"
_UNSAFE_CLASSES = {"Lambda", "TFOpLambda"}


@dataclass(frozen=True)
class Signature:
    """A model's inputs and outputs, in the order its call takes and returns them."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


def find_model_file(version_dir: Path) -> Path:
    """The model inside a version folder: model.keras, model.h5/.hdf5, or the folder itself (SavedModel).

    Raises:
        ModelLoadError: the folder holds none of these.
    """
    for name in (KERAS_FILE, *H5_FILES):
        if (version_dir / name).is_file():
            return version_dir / name
    if (version_dir / SAVED_MODEL_FILE).is_file():
        return version_dir
    expected = ", ".join((KERAS_FILE, *H5_FILES, SAVED_MODEL_FILE))
    raise ModelLoadError(f"{version_dir} holds no model file (expected one of {expected})")


def file_digest(path: Path) -> str:
    """SHA-256 of a model file, or of every file of a SavedModel folder (names and contents)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    # Large reads into one buffer: each read and update releases the GIL, and every chunk takes it back.
    # (Not mmap: a file truncated while mapped would kill the process with SIGBUS.) Not a bytearray either:
    # it would zero its 8 MB holding the GIL; numpy leaves the pages to be filled by the read.
    buffer = np.empty(8 << 20, np.uint8)
    view = buffer.data
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        with file.open("rb") as handle:
            while count := handle.readinto(view):
                digest.update(view[:count])
    return digest.hexdigest()


def _class_names(config: Any) -> set[str]:
    """Every `class_name` in a serialized Keras config, however deeply nested."""
    if isinstance(config, dict):
        found = {config["class_name"]} if isinstance(config.get("class_name"), str) else set()
        for value in config.values():
            found |= _class_names(value)
        return found
    if isinstance(config, list):
        return set().union(*(_class_names(item) for item in config)) if config else set()
    return set()


def check_h5_safety(path: Path) -> None:
    """Refuse a legacy .h5 model that holds code: the h5 loader ignores safe_mode (CVE-2025-9905).

    Raises:
        ModelLoadError: the file has a Lambda layer or no readable model config.
    """
    import h5py

    try:
        with h5py.File(path, "r") as file:
            raw = file.attrs.get("model_config")
    except OSError as error:
        raise ModelLoadError(f"{path.name} is not a readable HDF5 file: {error}") from error
    if raw is None:
        raise ModelLoadError(f"{path.name} has no model_config (weights-only .h5 files cannot be served)")
    config = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    unsafe = _class_names(config) & _UNSAFE_CLASSES
    if unsafe:
        raise ModelLoadError(
            f"{path.name} contains {', '.join(sorted(unsafe))} layers (arbitrary code); "
            "refused unless the server runs with trust_models"
        )


def load_model(path: Path, trust: bool) -> Any:
    """Load a Keras model (without its training config) from a file or SavedModel folder.

    Raises:
        ModelLoadError: the file is corrupt, unsafe, or uses unknown layers.
    """
    configure_tensorflow()  # TensorFlow imported (quietly) and set up before Keras imports it
    import keras

    try:
        if path.is_dir():
            return _wrap_saved_model(path)
        if path.suffix in (".h5", ".hdf5") and not trust:
            check_h5_safety(path)
        if path.suffix == ".keras" and not zipfile.is_zipfile(path):
            raise ModelLoadError(f"{path.name} is not a .keras archive (a zip file): corrupt or truncated")
        return keras.saving.load_model(path, compile=False, safe_mode=not trust)
    except ModelLoadError:
        raise
    except Exception as error:  # Keras raises many kinds on corrupt or unknown content.
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelLoadError(f"cannot load {path.name}: {first_line}") from error


def _wrap_saved_model(path: Path) -> Any:
    """A functional Keras model around a SavedModel's serving_default signature (inputs sorted by name)."""
    import keras
    import tensorflow as tf

    loaded = tf.saved_model.load(str(path))
    if "serving_default" not in loaded.signatures:
        raise ModelLoadError(f"SavedModel {path} has no serving_default signature")
    function = loaded.signatures["serving_default"]
    input_specs = function.structured_input_signature[1]
    output_specs = function.structured_outputs

    class SavedModelSignature(keras.layers.Layer):  # type: ignore[misc]  # keras is untyped
        """Calls the signature with keyword arguments, as SavedModel signatures require."""

        def call(self, inputs: dict[str, Any]) -> Any:
            return function(**inputs)

        def compute_output_spec(self, inputs: dict[str, Any]) -> Any:
            return {k: keras.KerasTensor(s.shape, dtype=s.dtype.name) for k, s in output_specs.items()}

    inputs = {
        name: keras.Input(shape=spec.shape[1:], dtype=spec.dtype.name, name=name)
        for name, spec in sorted(input_specs.items())
    }
    outputs = SavedModelSignature(name="saved_model")(inputs)
    # Identity layers carry the signature's output keys as the served output names.
    named = [keras.layers.Identity(name=key)(outputs[key]) for key in sorted(outputs)]
    model = keras.Model(inputs=list(inputs.values()), outputs=named, name=path.name)
    model.saved_model_handle = [loaded]  # keeps the SavedModel's variables alive with the model
    return model


def _tensor_name(tensor: Any, fallback: str) -> str:
    history = getattr(tensor, "_keras_history", None)
    return str(history.operation.name) if history is not None else fallback


def read_signature(model: Any) -> Signature:
    """Inputs and outputs of a loaded model, with -1 for free dimensions.

    Raises:
        ModelLoadError: the model was saved without an input shape.
    """
    import keras

    try:
        inputs, outputs = keras.tree.flatten(model.inputs), keras.tree.flatten(model.outputs)
    except (AttributeError, ValueError) as error:
        raise ModelLoadError(f"the model has no defined inputs (build it with keras.Input): {error}") from error
    output_names = _output_names(model, outputs)
    return Signature(
        inputs=tuple(_spec(_tensor_name(t, f"input_{i}"), t) for i, t in enumerate(inputs)),
        outputs=tuple(_spec(name, t) for name, t in zip(output_names, outputs, strict=True)),
    )


def _output_names(model: Any, outputs: list[Any]) -> list[str]:
    """Output names: the layer producing each output; `layer:k` where a layer yields several."""
    names = [_tensor_name(t, f"output_{i}") for i, t in enumerate(outputs)]
    if len(set(names)) == len(names):
        return names
    indices = [getattr(t._keras_history, "tensor_index", i) for i, t in enumerate(outputs)]
    return [f"{name}:{index}" if names.count(name) > 1 else name for name, index in zip(names, indices, strict=True)]


def _spec(name: str, tensor: Any) -> TensorSpec:
    shape = tuple(-1 if dim is None else int(dim) for dim in tensor.shape)
    return TensorSpec(name=name, datatype=datatype_of(str(tensor.dtype)), shape=shape)
