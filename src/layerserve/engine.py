"""Engines run one batch of a version: ONNX Runtime (exported once, verified) or the Keras compiled call."""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from layerserve.errors import ModelLoadError
from layerserve.gpu import onnx_providers
from layerserve.tensors import Array, TensorSpec

log = logging.getLogger(__name__)


class Engine(Protocol):
    """Runs one batch: arrays in the model's input order -> arrays in its output order."""

    name: str
    in_process: bool  # False: runs in another process, so never on the event loop

    def run(self, inputs: list[Array]) -> list[Array]:
        """Compute the outputs for one batch."""
        ...

    def close(self) -> None:
        """Free what the engine holds outside this process's objects (its process); runs once, at unload."""
        ...


def graph_name(name: str) -> str:
    """A tensor name TensorFlow and ONNX accept (layer names may hold ':' or start with other characters)."""
    cleaned = re.sub(r"[^A-Za-z0-9_.\-/]", "_", name)
    return cleaned if re.match(r"[A-Za-z0-9.]", cleaned) else f"t{cleaned}"


def _tf_spec(spec: TensorSpec) -> Any:
    import tensorflow as tf

    shape = [None if dim == -1 else dim for dim in spec.shape]
    dtype = tf.string if spec.datatype == "BYTES" else tf.as_dtype(spec.dtype)
    return tf.TensorSpec(shape=shape, dtype=dtype, name=graph_name(spec.name))


class KerasEngine:
    """The model's call compiled once as a `tf.function` with a free batch dimension."""

    name = "keras"
    in_process = True

    def __init__(self, model: Any, inputs: tuple[TensorSpec, ...]) -> None:
        import keras
        import tensorflow as tf

        self._flatten = keras.tree.flatten
        signature = [_tf_spec(spec) for spec in inputs]
        single = len(inputs) == 1

        def call(*tensors: Any) -> Any:
            return model(tensors[0] if single else list(tensors), training=False)

        self._function = tf.function(call, input_signature=signature, autograph=False)

    def run(self, inputs: list[Array]) -> list[Array]:
        """Compute the outputs for one batch."""
        return [np.asarray(t) for t in self._flatten(self._function(*inputs))]

    def close(self) -> None:
        """Nothing to do: the function is freed with the object."""


class OnnxEngine:
    """An ONNX Runtime session over an exported graph."""

    name = "onnx"
    in_process = True

    def __init__(self, path: Path, inputs: tuple[TensorSpec, ...], threads: int) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        # Idle ORT threads otherwise spin for a while after each call, taking the cores HTTP needs.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = onnx_providers(ort.get_available_providers())
        self._session = ort.InferenceSession(str(path), options, providers=providers)
        names = [i.name for i in self._session.get_inputs()]
        if len(names) != len(inputs):
            raise ModelLoadError(f"exported graph has {len(names)} inputs, the model {len(inputs)}")
        wanted = [graph_name(spec.name) for spec in inputs]
        # tf2onnx keeps the TensorSpec names; fall back to position if it renamed them.
        self._input_names = wanted if sorted(names) == sorted(wanted) else names

    def run(self, inputs: list[Array]) -> list[Array]:
        """Compute the outputs for one batch."""
        return list(self._session.run(None, dict(zip(self._input_names, inputs, strict=True))))

    def close(self) -> None:
        """Nothing to do: the session is freed with the object."""


def open_onnx(
    path: Path, inputs: tuple[TensorSpec, ...], threads: int, process_min_bytes: int | None, warmup_rows: int
) -> Engine:
    """A session over the graph at `path`: in a process of its own, warmed up there with `warmup_rows`,
    when the file has at least `process_min_bytes` (see engine_process); else in this one."""
    if process_min_bytes is not None and path.stat().st_size >= process_min_bytes:
        from layerserve.engine_process import ProcessOnnxEngine  # imports this module

        return ProcessOnnxEngine(path, inputs, threads, warmup_rows)
    return OnnxEngine(path, inputs, threads)


@dataclass(frozen=True)
class EngineChoice:
    """The engine a version runs on, and why (the reason for a fallback, or the verification result)."""

    engine: Engine
    reason: str


def export_onnx(model: Any, inputs: tuple[TensorSpec, ...], target: Path) -> None:
    """Export the model's call to an ONNX file, written atomically (temporary name, then rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    signature = [_tf_spec(spec) for spec in inputs]
    handle, temporary = tempfile.mkstemp(suffix=".onnx.tmp", dir=target.parent)
    os.close(handle)
    try:
        with warnings.catch_warnings():
            # tf2onnx and Keras' exporter warn about NumPy 2 aliases they patch themselves.
            warnings.simplefilter("ignore")
            model.export(
                temporary,
                format="onnx",
                verbose=False,
                input_signature=[signature] if len(signature) > 1 else signature,
            )
        Path(temporary).replace(target)
    finally:
        Path(temporary).unlink(missing_ok=True)


def probe_batch(inputs: tuple[TensorSpec, ...], rows: int) -> list[Array]:
    """A deterministic batch for warm-up and verification: small ints, normal floats, short strings.

    Batches up to 4 MB are drawn once and kept (read-only): every reload of a model warms up with the same
    one, and drawing an image batch costs milliseconds of CPU.
    """
    row_bytes = sum(math.prod(1 if d == -1 else d for d in spec.shape[1:]) * spec.dtype.itemsize for spec in inputs)
    return list(_kept_probe(inputs, rows) if rows * row_bytes <= _KEPT_PROBE_BYTES else _draw_probe(inputs, rows))


_KEPT_PROBE_BYTES = 4 << 20


@functools.lru_cache(maxsize=8)
def _kept_probe(inputs: tuple[TensorSpec, ...], rows: int) -> tuple[Array, ...]:
    batch = _draw_probe(inputs, rows)
    for array in batch:
        array.flags.writeable = False
    return batch


def _draw_probe(inputs: tuple[TensorSpec, ...], rows: int) -> tuple[Array, ...]:
    rng = np.random.default_rng(0)
    batch = []
    for spec in inputs:
        shape = (rows, *(1 if dim == -1 else dim for dim in spec.shape[1:]))
        if spec.datatype == "BYTES":
            batch.append(np.full(shape, b"probe", dtype=object))
        elif spec.datatype == "BOOL":
            batch.append(rng.integers(0, 2, shape).astype(bool))
        elif spec.dtype.kind in "iu":
            batch.append(rng.integers(0, 2, shape).astype(spec.dtype))
        else:
            batch.append(rng.normal(size=shape).astype(spec.dtype))
    return tuple(batch)


def max_difference(expected: list[Array], actual: list[Array]) -> float:
    """The largest absolute difference between two lists of outputs, scaled by each output's magnitude
    when it exceeds 1 (float32 error grows with it); inf if their shapes differ."""
    worst = 0.0
    for a, b in zip(expected, actual, strict=True):
        if a.shape != b.shape:
            return float("inf")
        if a.size and a.dtype.kind in "fiub":
            reference = a.astype(np.float64)
            scale = max(1.0, float(np.max(np.abs(reference))))
            worst = max(worst, float(np.max(np.abs(reference - b.astype(np.float64)))) / scale)
    return worst


def onnx_cache_path(cache_dir: Path, digest: str) -> Path:
    """Where the export of a model file with this digest is cached, per exporter version."""
    return cache_dir / f"{digest[:40]}-{_exporter_tag()}.onnx"


@functools.cache
def _exporter_tag() -> str:
    """The exporters' versions, read once from the package metadata: importing Keras would start TensorFlow
    in the server process, and parsing the metadata files holds the GIL for milliseconds on every load."""
    return f"keras{metadata.version('keras')}-tf2onnx{metadata.version('tf2onnx')}"


@dataclass(frozen=True)
class Verdict:
    """An ONNX export checked against Keras on the probe batch: its largest difference, or why there is none."""

    max_difference: float | None
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The stored form."""
        return {"max_difference": self.max_difference, "export_error": self.error}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verdict:
        """Read the stored form."""
        difference = data["max_difference"]
        return cls(None if difference is None else float(difference), str(data["export_error"]))


def export_and_verify(model: Any, inputs: tuple[TensorSpec, ...], cache_file: Path, probe: list[Array]) -> Verdict:
    """Export the model to `cache_file` (unless it is there) and compare ONNX Runtime with Keras on `probe`."""
    expected = KerasEngine(model, inputs).run(probe)
    try:
        if not cache_file.exists():
            export_onnx(model, inputs, cache_file)
        difference = max_difference(expected, OnnxEngine(cache_file, inputs, 1).run(probe))
    except ModelLoadError as error:
        return Verdict(None, f"ONNX export unusable: {error.message}")
    except Exception as error:  # tf2onnx and ORT raise many kinds for unsupported ops.
        log.warning("ONNX export failed for %s", cache_file.name, exc_info=True)
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return Verdict(None, f"ONNX export failed: {first[:300]}")
    return Verdict(difference)


def choose_engine(
    verdict: Verdict,
    choice: str,
    cache_file: Path,
    inputs: tuple[TensorSpec, ...],
    atol: float,
    threads: int,
    keras_engine: Callable[[], Engine],
    process_min_bytes: int | None = None,
    warmup_rows: int = 1,
) -> EngineChoice:
    """The engine per `choice` (auto/onnx/keras): the verified ONNX export (see `open_onnx` for where it
    runs), else `keras_engine()`.

    Raises:
        ModelLoadError: `choice` is onnx and the export failed or differs from Keras by more than `atol`.
    """
    if choice == "keras":
        return EngineChoice(keras_engine(), "engine=keras was requested")
    difference = verdict.max_difference
    if difference is not None and difference <= atol:
        engine = open_onnx(cache_file, inputs, threads, process_min_bytes, warmup_rows)
        where = "" if engine.in_process else f"; runs in engine process {getattr(engine, 'pid', '?')}"
        return EngineChoice(engine, f"ONNX verified against Keras: max difference {difference:.2e}{where}")
    reason = verdict.error or f"ONNX verification failed: max difference {difference:.2e} > {atol:.0e}"
    if choice == "onnx":
        raise ModelLoadError(reason)
    log.warning("%s; serving with the Keras compiled call", reason)
    return EngineChoice(keras_engine(), reason + "; serving with the Keras compiled call")
