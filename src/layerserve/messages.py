"""The data plane's typed requests and answers: numpy arrays, images and texts, no wire format.

Every transport translates its wire format (V2 JSON or binary, TF Serving JSON, gRPC protobuf, Python calls) into
these and back; the data plane checks them against the version they lease and answers them (see DataPlane).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from layerserve.serving.statistics import VersionStatistics
from layerserve.settings import VersionPolicy
from layerserve.tensors import Array, TensorSpec


@dataclass(frozen=True)
class RequestedOutput:
    """An output asked for (a model output or any layer): as binary data (None: the request's default; a wire
    detail the data plane passes through), as its `classification` best classes (Triton's extension)."""

    name: str
    binary: bool | None = None
    classification: int | None = None


def requested_outputs(outputs: Sequence[str | RequestedOutput]) -> tuple[RequestedOutput, ...]:
    """Output names or RequestedOutputs as RequestedOutputs."""
    return tuple(o if isinstance(o, RequestedOutput) else RequestedOutput(o) for o in outputs)


@dataclass(frozen=True)
class InferRequest:
    """Named inputs (model inputs, or layers to cut at) in, named outputs out.

    `inputs` are arrays (a list takes its tensor's datatype); an image or text model's first input may also be
    a BYTES array of encoded images or UTF-8 texts. `base64_inputs` names the BYTES inputs whose elements came
    as text on the wire (JSON): encoded images there are base64. `outputs` may be names; none: the model's.
    """

    model: str
    inputs: Mapping[str, Any]
    outputs: Sequence[str | RequestedOutput] = ()
    version: int | None = None
    id: str | None = None
    timeout_ms: int | None = None
    use_cache: bool = True
    binary_output: bool = False
    base64_inputs: frozenset[str] = field(default_factory=frozenset)

    _requested: tuple[RequestedOutput, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_requested", requested_outputs(self.outputs))

    @property
    def requested(self) -> tuple[RequestedOutput, ...]:
        """The outputs asked for, as RequestedOutputs."""
        return self._requested


@dataclass(frozen=True)
class InferResponse:
    """The outputs of one infer request by name, in the order asked for (a classification as its BYTES tensor
    of `score:index[:label]`), and the version that computed them."""

    model: str
    version: int
    outputs: dict[str, Array]
    id: str | None = None


@dataclass(frozen=True)
class ClassifyRequest:
    """Encoded images (bytes) or texts (str) in; their `top_k` best classes out."""

    model: str
    items: Sequence[bytes | str]
    top_k: int = 5
    version: int | None = None
    use_cache: bool = True


@dataclass(frozen=True)
class ClassifyResponse:
    """Per item, its best classes as {label, index, score}, best first."""

    model: str
    version: int
    predictions: list[list[dict[str, Any]]]


@dataclass(frozen=True)
class ExplainRequest:
    """One encoded image in; where the model saw the evidence for a class (`target`: a label or an index; default
    its top one), by `method` (score-cam over `layer`, default the last spatial one; or occlusion)."""

    model: str
    image: bytes
    version: int | None = None
    target: str | None = None
    method: str = "score-cam"
    layer: str | None = None
    channels: int = 32


@dataclass(frozen=True)
class ExplainResponse:
    """A heatmap over the image the model saw (`pixels`, before its preprocessing), for one class."""

    model: str
    version: int
    heatmap: Array
    class_index: int
    label: str
    score: float
    method: str
    layer: str | None
    pixels: Array

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (without the pixels)."""
        rows, columns = self.heatmap.shape
        return {
            "model_name": self.model, "model_version": str(self.version),
            "class": {"label": self.label, "index": self.class_index, "score": self.score},
            "method": self.method, "layer": self.layer, "rows": rows, "columns": columns,
            "heatmap": np.round(self.heatmap, 4).tolist(),
        }  # fmt: skip


@dataclass(frozen=True)
class FeaturesRequest:
    """Encoded images or texts in; one layer's output per item out, pooled per `pool` ("" keeps it whole), and
    stored under `ids` (one per item) when given."""

    model: str
    items: Sequence[bytes | str]
    layer: str
    pool: str = ""
    version: int | None = None
    use_cache: bool = True
    ids: Sequence[str] = ()


@dataclass(frozen=True)
class FeaturesResponse:
    """One row of `layer`'s output per item."""

    model: str
    version: int
    layer: str
    features: Array


@dataclass(frozen=True)
class ModelMetadata:
    """A version's signature and where it stands: its model's versions, active and pinned version and labels,
    its state and reason, engine, layers, cuts and batching."""

    name: str
    version: int
    versions: tuple[int, ...]
    active_version: int | None
    pinned_version: int | None
    version_labels: dict[str, int]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    state: str
    reason: str
    engine: str
    engine_reason: str
    layer_count: int
    cuts: list[dict[str, Any]]
    batching: dict[str, object]
    description: str
    version_policy: VersionPolicy
    input: str = "tensor"  # what /classify and /features take: "image", "text", or "tensor" (neither)
    cache: bool = False  # whether answers are served from the feature cache
    memory: dict[str, int] = field(default_factory=dict)  # resident bytes by part (ModelVersion.memory)
    last_used: float | None = None  # Unix time a request last used it (or it loaded)


@dataclass(frozen=True)
class RepositoryEntry:
    """One row of the repository index: a version (None: a model without any) and its state and reason."""

    name: str
    version: int | None
    state: str
    reason: str


@dataclass(frozen=True)
class StatisticsReport:
    """One version's statistics (Triton's counts and durations)."""

    name: str
    version: int
    statistics: VersionStatistics
