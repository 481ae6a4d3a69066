"""DataPlane: infer, classify and features as Python calls on numpy arrays, images and texts (no wire format).

The calls a program makes when it keeps its own web app (Flask, Tornado, ...) and uses layerserve inside it:
every request leases its version, is checked against the version's signature and layer graph, and goes
through the same feature cache, batcher and engine as the server's requests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from layerserve.errors import BadRequestError
from layerserve.features.images import ImageDecoder
from layerserve.features.labels import top_k
from layerserve.features.pooling import POOLS, pool_features
from layerserve.protocols.v2 import check_input, check_model_inputs
from layerserve.serving.registry import ModelRegistry, ModelVersion
from layerserve.tensors import Array, check_batch_sizes, datatype_of


@dataclass(frozen=True)
class InferResult:
    """The outputs of one infer call, by name, and the version that computed them."""

    model: str
    version: int
    outputs: dict[str, Array]


def _checked_inputs(version: ModelVersion, inputs: Mapping[str, Any]) -> dict[str, Array]:
    """The inputs as arrays, each checked against its tensor in the version's graph (a model input or a layer).

    Raises:
        BadRequestError: an unknown name, a datatype or shape that does not fit, unequal batch sizes.
    """
    if not inputs:
        raise BadRequestError("no inputs given")
    arrays: dict[str, Array] = {}
    for name, value in inputs.items():
        # Lists take the tensor's datatype; an array keeps its own (a float64 array for FP32 is refused).
        array = (
            value if isinstance(value, np.ndarray) else np.asarray(value, dtype=version.graph.spec(name, "input").dtype)
        )
        if array.ndim == 0:
            raise BadRequestError(f"input '{name}': expected an array with a batch dimension, got a scalar")
        check_input(name, datatype_of(array.dtype), tuple(array.shape), version.graph, None)  # as V2 checks it
        arrays[name] = array
    check_model_inputs(arrays, version.graph)
    check_batch_sizes(arrays)
    return arrays


class DataPlane:
    """The transport-neutral calls over a registry of models (see the module's docstring)."""

    def __init__(self, registry: ModelRegistry, decoder: ImageDecoder) -> None:
        self._registry = registry
        self._decoder = decoder

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        outputs: Sequence[str] = (),
        version: int | None = None,
        timeout_ms: int | None = None,
        use_cache: bool = True,
    ) -> InferResult:
        """Named arrays in (model inputs, or layers to cut at), named outputs (model outputs or any layer) out.

        Raises:
            NotFoundError: unknown model or version (404 over HTTP).
            NotReadyError, QueueFullError: the version cannot take it now (503).
            DeadlineExceededError: not answered within `timeout_ms` (504).
            BadRequestError: inputs or outputs that do not fit the version (400).
        """
        async with self._registry.lease(model, version) as served:
            for name in outputs:
                served.graph.spec(name, "output")
            arrays = _checked_inputs(served, inputs)
            computed = await served.predict(arrays, tuple(outputs), timeout_ms, use_cache)
            return InferResult(served.name, served.version, computed)

    async def classify(
        self, model: str, items: Sequence[bytes | str], top: int = 5, version: int | None = None
    ) -> list[list[dict[str, Any]]]:
        """Encoded images (bytes) or texts (str) in; per item, the `top` best classes as {label, index, score}.

        Raises:
            UnsupportedMediaTypeError: the model takes neither images nor texts.
            UnprocessableImageError, PayloadTooLargeError: a bad image.
        """
        async with self._registry.lease(model, version) as served:
            scores = await self._rows(served, items, served.classify_output, "")
            return top_k(scores, served.labels, top)

    async def features(
        self, model: str, items: Sequence[bytes | str], layer: str, pool: str = "", version: int | None = None
    ) -> Array:
        """Encoded images or texts in; one layer's output per item, pooled per `pool` ("" keeps it whole)."""
        if pool and pool not in POOLS:
            raise BadRequestError(f"pool must be one of {', '.join(POOLS)}, got {pool!r}")
        async with self._registry.lease(model, version) as served:
            served.graph.spec(layer, "output")
            return await self._rows(served, items, layer, pool)

    async def _rows(self, served: ModelVersion, items: Sequence[bytes | str], output: str, pool: str) -> Array:
        if not items:
            raise BadRequestError("no images or texts given")
        if all(isinstance(item, str) for item in items):
            inputs = served.encode_texts([str(item) for item in items])
            rows = (await served.predict(inputs, (output,)))[output]
            return pool_features(rows, pool) if pool else rows
        images = [item for item in items if isinstance(item, bytes)]
        if len(images) != len(items):
            raise BadRequestError("give encoded images (bytes) or texts (str), not a mix")
        served.require_image()
        return await served.image_output(images, output, self._decoder, True, pool)
