"""DataPlane: infer, classify and features as typed requests and answers (see messages.py), for every transport.

Each call leases its version for as long as it runs, checks the request against that version once (see
RequestChecks) and goes through the feature cache, the batcher and the engine. The HTTP routes, the gRPC
servicer and programs that keep their own web app (Flask, Tornado, ...) all call these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from layerserve.errors import BadRequestError
from layerserve.features.feature_store import FeatureStore, StoredFeature, check_ids
from layerserve.features.images import ImageDecoder
from layerserve.features.labels import classification_strings, top_k
from layerserve.features.pooling import check_pool, pool_features
from layerserve.lifecycle.peers import ControlOp, Peers
from layerserve.lifecycle.reloader import Reloader
from layerserve.messages import (
    ClassifyRequest,
    ClassifyResponse,
    FeaturesRequest,
    FeaturesResponse,
    InferRequest,
    InferResponse,
    ModelMetadata,
    RepositoryEntry,
    RequestedOutput,
    StatisticsReport,
)
from layerserve.serving.registry import ModelRegistry, ModelVersion
from layerserve.tensors import Array


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


class DataPlane:
    """The transport-neutral calls over a registry of models (see the module's docstring)."""

    def __init__(self, registry: ModelRegistry, reloader: Reloader, decoder: ImageDecoder, store: FeatureStore) -> None:
        self._registry = registry
        self._reloader = reloader
        self._decoder = decoder
        self._store = store
        self.peers: Peers | None = None  # the other replicas of a deployment (Ray Serve), told of every load

    def metadata(self, model: str, version: int | None = None) -> ModelMetadata:
        """A version's metadata (the active one, else the newest, by default), in any state.

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
            input=served.config.input,
            cache=served.config.cache,
            memory=served.memory() if served.is_ready else {},
        )

    def model_ready(self, model: str, version: int | None = None) -> bool:
        """Whether a version (the active one by default) serves.

        Raises:
            NotFoundError: unknown model or version.
        """
        return self._registry.find(model, version).is_ready

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

    async def load(self, model: str, config: dict[str, Any] | None = None) -> tuple[int, ...]:
        """(Re)load a model from the repository, `config` replacing config.yaml keys; its ready versions once
        settled (with peers, once every replica has loaded it).

        Raises:
            NotFoundError: no such model folder. BadRequestError: a bad config key. ConflictError: it failed.
        """
        entry = await self._reloader.load_model(model, config)
        await self._tell(ControlOp("load", model, config=config))
        return tuple(entry.ready_versions)

    async def unload(self, model: str) -> None:
        """Unload every version of a model (they finish their requests first), on every replica."""
        await self._reloader.unload_model(model)
        await self._tell(ControlOp("unload", model))

    async def apply(self, model: str, version: int | None = None, label: str | None = None) -> int | None:
        """Pin `version` (or the one `label` names) as the active version, or, with neither, unpin; the active
        version once in place (with peers, once every replica serves it)."""
        if version is None and label is None:
            active = (await self._reloader.unpin(model)).active_version
            await self._tell(ControlOp("unpin", model))
            return active
        if version is not None:
            pinned = (await self._reloader.apply(model, version)).version
        else:
            assert label is not None
            pinned = (await self._reloader.apply_label(model, label)).version
        await self._tell(ControlOp("apply", model, version=pinned))
        return pinned

    async def make(self, op: ControlOp) -> None:
        """Make a change another replica was asked for (told to no one further).

        Raises:
            LayerserveError: it failed here (as `load`, `unload` and `apply` say).
        """
        if not self._registry.settings.serves_model(op.model):  # another group's model
            return
        if op.kind == "load":
            await self._reloader.load_model(op.model, op.config)
        elif op.kind == "unload":
            await self._reloader.unload_model(op.model)
        elif op.kind == "apply":
            assert op.version is not None
            await self._reloader.apply(op.model, op.version)
        else:
            await self._reloader.unpin(op.model)

    async def _tell(self, op: ControlOp) -> None:
        if self.peers is not None:
            await self.peers.tell(op)

    async def infer(self, request: InferRequest) -> InferResponse:
        """Named arrays in (model inputs, or layers to cut at), named outputs (model outputs or any layer) out.

        Raises:
            NotFoundError: unknown model or version (404 over HTTP).
            NotReadyError, QueueFullError: the version cannot take it now (503).
            DeadlineExceededError: not answered within the request's `timeout_ms` (504).
            BadRequestError: inputs or outputs that do not fit the version (400).
        """
        async with self._registry.lease(request.model, request.version) as served:
            return await self.infer_on(served, request)

    async def infer_on(self, served: ModelVersion, request: InferRequest) -> InferResponse:
        """`infer` on a version the caller leased (a transport that reads the version to translate its wire)."""
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
        async with self._registry.lease(request.model, request.version) as served:
            return await self.classify_on(served, request)

    async def classify_on(self, served: ModelVersion, request: ClassifyRequest) -> ClassifyResponse:
        """`classify` on a version the caller leased."""
        if type(request.top_k) is not int or request.top_k < 1:
            raise BadRequestError(f"top_k must be a positive integer, got {request.top_k!r}")
        scores = await self._rows(served, request.items, served.classify_output, "", request.use_cache)
        return ClassifyResponse(served.name, served.version, top_k(scores, served.labels, request.top_k))

    async def features(self, request: FeaturesRequest) -> FeaturesResponse:
        """Encoded images or texts in; one layer's output per item (pooled), stored under the request's ids.

        Raises:
            BadRequestError: an unknown layer or pool, ids that are not one distinct id per item.
        """
        async with self._registry.lease(request.model, request.version) as served:
            return await self.features_on(served, request)

    async def features_on(self, served: ModelVersion, request: FeaturesRequest) -> FeaturesResponse:
        """`features` on a version the caller leased."""
        check_pool(request.pool)
        served.graph.spec(request.layer, "output")
        rows = await self._rows(served, request.items, request.layer, request.pool, request.use_cache)
        if request.ids:
            ids = list(request.ids)
            check_ids(ids, len(rows))
            stored = [StoredFeature(i, served.version, request.layer, row) for i, row in zip(ids, rows, strict=True)]
            await self._store.put_many(served.name, stored)
        return FeaturesResponse(served.name, served.version, request.layer, rows)

    async def _rows(
        self, served: ModelVersion, items: Sequence[bytes | str], output: str, pool: str, use_cache: bool
    ) -> Array:
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
