"""What every engine is: the Engine protocol, the engine kinds, probe batches, verdicts and the ONNX cache path."""

from __future__ import annotations

import functools
import math
import re
import tempfile
from dataclasses import dataclass
from enum import StrEnum
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from layerserve.tensors import Array, TensorSpec


class EngineKind(StrEnum):
    """The engines a version can run on (`engine` setting and config key; `auto`: ONNX, else Keras)."""

    AUTO = "auto"
    ONNX = "onnx"
    KERAS = "keras"


class Engine(Protocol):
    """Runs one batch: arrays in the model's input order -> arrays in its output order."""

    name: EngineKind
    in_process: bool  # False: runs in another process, so never on the event loop

    def run(self, inputs: list[Array]) -> list[Array]:
        """Compute the outputs for one batch."""
        ...

    def resident(self) -> tuple[int, int]:
        """(Bytes of its session in its engine process, its share of that process's other memory); (0, 0) for
        an engine in this process."""
        ...

    def close(self) -> None:
        """Free what the engine holds outside this process's objects (its process); runs once, at unload."""
        ...


def graph_name(name: str) -> str:
    """A tensor name TensorFlow and ONNX accept (layer names may hold ':' or start with other characters)."""
    cleaned = re.sub(r"[^A-Za-z0-9_.\-/]", "_", name)
    return cleaned if re.match(r"[A-Za-z0-9.]", cleaned) else f"t{cleaned}"


@dataclass(frozen=True)
class EngineChoice:
    """The engine a version runs on, and why (the reason for a fallback, or the verification result)."""

    engine: Engine
    reason: str


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


# Readable by every user (mkstemp's files are the owner's only): a cache filled ahead by another user (an image build's
# root, an init container) serves. An export holds nothing that its model file does not.
CACHE_FILE_MODE = 0o644


def onnx_cache_path(cache_dir: Path, digest: str) -> Path:
    """Where the export of a model file with this digest is cached, per exporter version."""
    return cache_dir / f"{digest[:40]}-{_exporter_tag()}.onnx"


def cache_problem(cache_dir: Path) -> str:
    """Why exports cannot be kept in `cache_dir` (created when missing), as the OS says; "" when they can."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache_dir, prefix=".write-check-"):
            pass
    except OSError as error:
        return str(error)
    return ""


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
    lasting: bool = True  # False: the export failed for a reason outside the model (a full disk); not kept

    def to_dict(self) -> dict[str, Any]:
        """The stored form."""
        return {"max_difference": self.max_difference, "export_error": self.error}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verdict:
        """Read the stored form."""
        difference = data["max_difference"]
        return cls(None if difference is None else float(difference), str(data["export_error"]))
