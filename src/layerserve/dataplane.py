"""DataPlane: the only way from a door to a version. `open(model, version)` leases a version and gives a VersionView
(infer, classify, features, its signature, layers and per-version parse state); the rest reads the registry for
every door alike (metadata, readiness, statistics, the index, stored features).

The HTTP routes, the gRPC servicer and programs that keep their own web app (Flask, Tornado, ...) all call these, on
the typed requests and answers of messages.py.
"""

from __future__ import annotations

import difflib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from layerserve.errors import BadRequestError
from layerserve.features.explain import METHODS, occlusion, score_cam, spatial_layer
from layerserve.features.feature_store import FeatureStore, StoredFeature, check_ids
from layerserve.features.images import ImageDecoder, preprocess
from layerserve.features.labels import classification_strings, top_k
from layerserve.features.pooling import check_pool, pool_features
from layerserve.lifecycle.model import Signature
from layerserve.messages import (
    ClassifyRequest,
    ClassifyResponse,
    ExplainRequest,
    ExplainResponse,
    FeaturesRequest,
    FeaturesResponse,
    InferRequest,
    InferResponse,
    ModelMetadata,
    RepositoryEntry,
    RequestedOutput,
    StatisticsReport,
)
from layerserve.protocols.v2 import CheckDeclared
from layerserve.serving.layers import LayerGraph
from layerserve.serving.registry import ModelRegistry
from layerserve.serving.version import ModelVersion
from layerserve.settings import ModelConfig
from layerserve.tensors import Array

State = TypeVar("State")
_MAX_CHANNELS = 512  # Score-CAM's masked images an explanation may cost
_OCCLUSION_GRID = 8
# Loads a listed version (on demand, under a memory budget) and returns it held: the control plane's.
OnDemandLoader = Callable[[str, int], Awaitable[ModelVersion]]


def answer_outputs(
    requested: tuple[RequestedOutput, ...], computed: dict[str, Array], labels: list[str] | None, labelled: str
) -> dict[str, Array]:
    """The computed outputs in the order asked for, each requested classification made into its BYTES tensor
    (`labels` name the classes of the `labelled` output only: any other's is Triton's plain `score:index`)."""
    if not requested:
        return computed
    answer: dict[str, Array] = {}
    for wanted in requested:
        array = computed[wanted.name]
        if wanted.classification is not None:
            own_labels = labels if wanted.name == labelled else None
            array = classification_strings(array, own_labels, wanted.classification)
        answer[wanted.name] = array
    return answer


@dataclass(frozen=True)
class VersionStatus:
    """A version's state as TF Serving's model status reports it."""

    version: int
    state: str
    reason: str


class VersionView:
    """One request's hold on a version (`async with data.open(...) as view`): what a door may read of it, and its
    answers. The version is held until the block ends, so a version swapped out meanwhile (during a cache lookup, an
    image decode, a queue) is closed only after every view on it is done. A version not loaded (on demand) is
    loaded on entering, before the block runs."""

    __slots__ = ("_decoder", "_load", "_store", "_version")

    def __init__(
        self, version: ModelVersion, decoder: ImageDecoder, store: FeatureStore,
        load: Callable[[], Awaitable[ModelVersion]] | None = None,
    ) -> None:  # fmt: skip
        self._version = version
        self._decoder = decoder
        self._store = store
        self._load = load

    async def __aenter__(self) -> VersionView:
        if self._load is None:
            self._version.hold()
        else:
            self._version = await self._load()  # held already
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._version.release()

    @property
    def model(self) -> str:
        """The model's name."""
        return self._version.name

    @property
    def version(self) -> int:
        """The version's number."""
        return self._version.version

    @property
    def folder(self) -> Path:
        """The version's folder in the repository."""
        return self._version.path

    @property
    def model_digest(self) -> str:
        """The SHA-256 of the version's model file, as loaded."""
        return self._version.model_digest

    @property
    def config(self) -> ModelConfig:
        """The model's config.yaml, as the version loaded it."""
        return self._version.config

    @property
    def signature(self) -> Signature:
        """The model's inputs and outputs."""
        return self._version.signature

    @property
    def graph(self) -> LayerGraph:
        """Every layer's output by name (a request may name any as an output, or as an input: a cut)."""
        return self._version.graph

    @property
    def labels(self) -> list[str] | None:
        """The class names of the classify output, if the model has any."""
        return self._version.labels

    @property
    def classify_output(self) -> str:
        """The output whose scores /classify ranks."""
        return self._version.classify_output

    @property
    def encoded_input(self) -> str | None:
        """The input that may come encoded as BYTES (images, or UTF-8 texts), if any."""
        return self._version.encoded_input

    @property
    def takes_texts(self) -> bool:
        """Whether the model is a text model (its items are texts, tokenized here)."""
        return self._version.tokenizer is not None

    @property
    def check_declared(self) -> CheckDeclared:
        """Checks an input's declared name, datatype and shape before its data is read (parsers call it)."""
        return self._version.checks.declared

    def require_image(self) -> None:
        """Raises UnsupportedMediaTypeError when the model does not take images."""
        self._version.require_image()

    def parse_state(self, kind: type[State]) -> State:
        """The door's parse state of `kind` for this version (templates of requests seen before), made on first use
        and gone with the version."""
        states = self._version.parse_states
        state = states.get(kind)
        if state is None:
            state = states[kind] = kind()
        return state  # type: ignore[return-value]  # kept under its own kind

    async def infer(self, request: InferRequest) -> InferResponse:
        """Named arrays in (model inputs, or layers to cut at), named outputs (model outputs or any layer) out.

        Raises:
            NotReadyError, QueueFullError: the version cannot take it now (503).
            DeadlineExceededError: not answered within the request's `timeout_ms` (504).
            BadRequestError: inputs or outputs that do not fit the version (400).
        """
        served = self._version
        inputs = served.checks.inputs(request.inputs, request.base64_inputs)
        names = tuple(output.name for output in request.requested)
        served.checks.outputs(names)
        if served.encoded_input is not None:
            inputs = await served.decode_encoded(inputs, self._decoder)
        computed = await served.predict(inputs, names, request.timeout_ms, request.use_cache)
        outputs = answer_outputs(request.requested, computed, served.labels, served.classify_output)
        return InferResponse(served.name, served.version, outputs, request.id)

    async def classify(self, request: ClassifyRequest) -> ClassifyResponse:
        """Encoded images (bytes) or texts (str) in; per item, the `top_k` best classes as {label, index, score}.

        Raises:
            UnsupportedMediaTypeError: the model takes neither images nor texts (or not these).
            UnprocessableImageError, PayloadTooLargeError: a bad image.
        """
        served = self._version
        if type(request.top_k) is not int or request.top_k < 1:
            raise BadRequestError(f"top_k must be a positive integer, got {request.top_k!r}")
        scores = await self._rows(request.items, served.classify_output, "", request.use_cache)
        return ClassifyResponse(served.name, served.version, top_k(scores, served.labels, request.top_k))

    async def explain(self, request: ExplainRequest) -> ExplainResponse:
        """Where in one image the model saw the evidence for a class (see layerserve.features.explain), computed by
        the version's engine and kept in the feature cache by the image's digest and what was asked.

        Raises:
            UnsupportedMediaTypeError: the model does not take images.
            UnprocessableImageError, PayloadTooLargeError: a bad image.
            BadRequestError: an unknown method, class or layer, or channels out of range.
        """
        served = self._version
        spec = served.require_image()
        if request.method not in METHODS:
            raise BadRequestError(f"method must be one of {', '.join(METHODS)}, got {request.method!r}")
        if type(request.channels) is not int or not 1 <= request.channels <= _MAX_CHANNELS:
            raise BadRequestError(f"channels must be an integer from 1 to {_MAX_CHANNELS}, got {request.channels!r}")
        target = self._target_index(request.target)
        layer = None
        if request.method == "score-cam":
            layer = spatial_layer(served.graph, request.layer, (spec.height, spec.width))
        pixels = await self._decoder.decode_seen(request.image, spec)

        def to_input(images: Array) -> Array:
            return preprocess(images, spec).astype(spec.dtype, copy=False)

        async def predict(batch: Array, outputs: tuple[str, ...]) -> dict[str, Array]:
            return await served.predict({spec.input_name: batch}, outputs, use_cache=False)

        async def compute() -> list[Array]:
            output, batch = served.classify_output, served.max_batch_size
            if layer is None:
                found = await occlusion(predict, pixels, to_input, output, target, _OCCLUSION_GRID, batch)
            else:
                found = await score_cam(predict, pixels, to_input, layer, output, target, request.channels, batch)
            return [found.heatmap.astype(np.float32), np.array([found.class_index, found.score], np.float64)]

        method = "score-cam" if layer else "occlusion"  # the method that runs
        asked = f"{method}\0{layer}\0{request.channels}" if layer else method
        what = f"explain\0{asked}\0{'' if target is None else target}"
        heatmap, (found_index, score) = await served.derived(request.image, what, 2, compute)
        index, labels = int(found_index), served.labels
        label = labels[index] if labels and index < len(labels) else str(index)
        return ExplainResponse(served.name, served.version, heatmap, index, label, float(score), method, layer, pixels)

    def _target_index(self, target: str | None) -> int | None:
        """The class a request names (a label of the model's, or an index), None for its top one."""
        if target is None or target == "":
            return None
        labels = self._version.labels or []
        if target in labels:
            return labels.index(target)
        if target.isascii() and target.isdigit():
            return int(target)
        if not labels:
            raise BadRequestError(f"class {target!r} is not an index; this model has no labels: give a class index")
        close = difflib.get_close_matches(target, labels, n=5, cutoff=0.5)
        listed = ", ".join(repr(label) for label in (close or labels[:5]))
        raise BadRequestError(
            f"class {target!r} is neither a label of the model nor an index; expected one of its {len(labels)} labels "
            f"({'close ones' if close else 'the first'}: {listed}) or an index from 0 to {len(labels) - 1}"
        )

    def check_features(self, layer: str, pool: str, what: str = "pool") -> None:
        """Raises BadRequestError for an unknown layer or pool (before the items are read)."""
        self._version.graph.spec(layer, "output")
        check_pool(pool, what)

    async def features(self, request: FeaturesRequest) -> FeaturesResponse:
        """Encoded images or texts in; one layer's output per item (pooled), stored under the request's ids.

        Raises:
            BadRequestError: an unknown layer or pool, ids that are not one distinct id per item.
        """
        served = self._version
        self.check_features(request.layer, request.pool)
        rows = await self._rows(request.items, request.layer, request.pool, request.use_cache)
        if request.ids:
            ids = list(request.ids)
            check_ids(ids, len(rows))
            stored = [StoredFeature(i, served.version, request.layer, row) for i, row in zip(ids, rows, strict=True)]
            await self._store.put_many(served.name, stored)
        return FeaturesResponse(served.name, served.version, request.layer, rows)

    async def _rows(self, items: Sequence[bytes | str], output: str, pool: str, use_cache: bool) -> Array:
        served = self._version
        if not items:
            raise BadRequestError("no images or texts given")
        if all(isinstance(item, str) for item in items):
            inputs = served.encode_texts([str(item) for item in items])
            rows = (await served.predict(inputs, (output,), None, use_cache))[output]
            return pool_features(rows, pool) if pool else rows
        images = [item for item in items if isinstance(item, bytes)]
        if len(images) != len(items):
            raise BadRequestError("give encoded images (bytes) or texts (str), not a mix")
        served.require_image()
        return await served.image_output(images, output, self._decoder, use_cache, pool)


class DataPlane:
    """The transport-neutral calls over a registry of models (see the module's docstring)."""

    def __init__(
        self, registry: ModelRegistry, decoder: ImageDecoder, store: FeatureStore,
        load_on_demand: OnDemandLoader | None = None,
    ) -> None:  # fmt: skip
        self._registry = registry
        self._decoder = decoder
        self._store = store
        self._load_on_demand = load_on_demand

    def open(self, model: str, version: int | None = None) -> VersionView:
        """The requested version (the active one when `version` is None), to hold in an `async with`: READY, or
        listed and loaded on entering (under a memory budget; see Reloader.load_on_demand for its errors).

        Raises:
            NotFoundError: unknown model or version.
            NotReadyError: the version is loading or failed.
        """
        served = self._registry.find(model, version)
        if served.is_listed and self._load_on_demand is not None:
            load, number = self._load_on_demand, served.version
            return VersionView(served, self._decoder, self._store, lambda: load(model, number))
        return VersionView(self._registry.check_ready(served), self._decoder, self._store)

    def label_version(self, model: str, label: str) -> int:
        """The version a label of the model's `version_labels` names.

        Raises:
            NotFoundError: unknown model, or no such label (the message lists the known ones).
            NotReadyError: the model's config.yaml is invalid now, so its labels are unknown.
        """
        return self._registry.label_version(model, label)

    async def infer(self, request: InferRequest) -> InferResponse:
        """`VersionView.infer` on the version the request names.

        Raises:
            NotFoundError: unknown model or version (404 over HTTP); and as VersionView.infer.
        """
        async with self.open(request.model, request.version) as view:
            return await view.infer(request)

    async def classify(self, request: ClassifyRequest) -> ClassifyResponse:
        """`VersionView.classify` on the version the request names."""
        async with self.open(request.model, request.version) as view:
            return await view.classify(request)

    async def features(self, request: FeaturesRequest) -> FeaturesResponse:
        """`VersionView.features` on the version the request names."""
        async with self.open(request.model, request.version) as view:
            return await view.features(request)

    async def explain(self, request: ExplainRequest) -> ExplainResponse:
        """`VersionView.explain` on the version the request names."""
        async with self.open(request.model, request.version) as view:
            return await view.explain(request)

    async def metadata(self, model: str, version: int | None = None) -> ModelMetadata:
        """A version's metadata (the active one, else the newest, by default): a version not loaded (on demand) is
        loaded first, so that its signature is known; else in any state (see `describe`).

        Raises:
            NotFoundError: unknown model or version.
            NotReadyError: the model has no version at all; and as Reloader.load_on_demand.
        """
        served = self._registry.find(model, version)
        if not (served.is_listed and self._load_on_demand is not None):
            return self.describe(model, version)
        loaded = await self._load_on_demand(model, served.version)
        try:
            return self.describe(model, loaded.version)
        finally:
            loaded.release()

    def describe(self, model: str, version: int | None = None) -> ModelMetadata:
        """A version's metadata (the active one, else the newest, by default), in any state, loading nothing (a
        version not loaded has no signature yet).

        Raises:
            NotFoundError: unknown model or version.
            NotReadyError: the model has no version at all.
        """
        served, entry = self._registry.find(model, version), self._registry.entry(model)
        return ModelMetadata(
            name=served.name,
            version=served.version,
            versions=tuple(entry.ready_versions),
            active_version=entry.active_version,
            pinned_version=entry.pinned,
            version_labels=dict(entry.spec.config.version_labels),
            inputs=served.signature.inputs,
            outputs=served.signature.outputs,
            state=str(served.state),
            reason=served.reason,
            engine=served.engine_name,
            engine_reason=served.engine_reason,
            layer_count=served.layer_count,
            cuts=served.cuts.describe() if served.cuts else [],
            batching=served.batching(),
            description=served.config.description,
            version_policy=served.config.version_policy,
            input=served.input_kind,
            cache=served.config.cache,
            memory=served.memory() if served.is_ready else {},
            last_used=served.last_used_at,
        )

    def model_ready(self, model: str, version: int | None = None) -> bool:
        """Whether a version (the active one by default) serves.

        Raises:
            NotFoundError: unknown model or version.
        """
        return self._registry.find(model, version).is_ready

    def version_status(self, model: str, version: int | None = None) -> list[VersionStatus]:
        """The state of one version, or of every version of a model, newest first.

        Raises:
            NotFoundError: unknown model or version.
        """
        if version is not None:
            versions = [self._registry.find(model, version)]
        else:
            versions = [v for _, v in sorted(self._registry.entry(model).versions.items(), reverse=True)]
        return [VersionStatus(v.version, str(v.state), v.reason) for v in versions]

    def statistics(self, model: str | None = None, version: int | None = None) -> list[StatisticsReport]:
        """The statistics of one version, of every ready version of a model, or of every model's.

        Raises:
            NotFoundError: unknown model or version.
        """
        if model is not None and version is not None:
            versions = [self._registry.find(model, version)]
        else:
            entries = (
                [self._registry.entry(model)]
                if model is not None
                else [e for _, e in sorted(self._registry.models.items())]
            )
            versions = [entry.versions[v] for entry in entries for v in entry.ready_versions]
        return [StatisticsReport(v.name, v.version, v.statistics) for v in versions]

    def index(self) -> list[RepositoryEntry]:
        """Every version of every model with its state and reason (and each model that has none)."""
        return [
            RepositoryEntry(row["name"], int(row["version"]) if row["version"] else None, row["state"], row["reason"])
            for row in self._registry.index()
        ]

    async def stored_feature(
        self, model: str, feature_id: str, version: int | None, layer: str | None
    ) -> StoredFeature:
        """A feature stored by an earlier `features` call (see FeatureStore.get).

        Raises:
            NotFoundError: nothing stored under that id (for that version and layer).
        """
        return await self._store.get(model, feature_id, version, layer)

    async def stored_features(
        self, model: str, ids: list[str], version: int | None, layer: str | None
    ) -> list[StoredFeature | None]:
        """Many stored features at once, None where an id has none (see FeatureStore.get_many)."""
        return await self._store.get_many(model, ids, version, layer)


__all__ = ["DataPlane", "VersionStatus", "VersionView", "answer_outputs"]
