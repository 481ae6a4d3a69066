"""ModelVersion: one loaded version of a model, its engine, batchers and model thread."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import numpy as np

from layerserve.engines.base import Engine, EngineKind, Verdict, onnx_cache_path, probe_batch
from layerserve.engines.choice import choose_engine
from layerserve.engines.keras import KerasEngine
from layerserve.engines.process.pool import EngineProcessPool
from layerserve.errors import (
    BadRequestError,
    EngineProcessError,
    LayerserveError,
    NotReadyError,
)
from layerserve.features.cache import FeatureCache
from layerserve.features.images import ImageDecoder, ImageSpec
from layerserve.features.pooling import pool_features
from layerserve.lifecycle.model import Signature, find_model_file, read_signature
from layerserve.lifecycle.prepare import ModelSource, Preparer
from layerserve.metrics import MODEL_LOAD_SECONDS, set_model_state
from layerserve.serving.batchers import BatcherTable
from layerserve.serving.cuts import CutCache
from layerserve.serving.input_codec import InputCodec
from layerserve.serving.layers import LayerGraph
from layerserve.serving.statistics import VersionStatistics
from layerserve.settings import ModelConfig, Settings
from layerserve.tensors import Array
from layerserve.training.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class VersionState(StrEnum):
    """Where a version is in its life."""

    LOADING = "LOADING"
    READY = "READY"
    FAILED = "FAILED"


@dataclass
class ModelVersion:
    """One version of a model: its Keras model, signature, engine and the thread that runs it."""

    name: str
    version: int
    path: Path
    config: ModelConfig
    fingerprint: tuple[object, ...] = ()
    state: VersionState = VersionState.LOADING
    reason: str = ""
    signature: Signature = field(default_factory=lambda: Signature((), ()))
    graph: LayerGraph = field(default_factory=lambda: LayerGraph(Signature((), ())))
    engine: Engine | None = None
    cuts: CutCache | None = None
    codec: InputCodec | None = None
    cache: FeatureCache | None = None
    _model_digest: str = ""
    engine_reason: str = ""
    layer_count: int = 0
    load_seconds: float = 0.0
    statistics: VersionStatistics = field(default_factory=VersionStatistics)
    _thread: ThreadPoolExecutor | None = None
    _batchers: BatcherTable | None = None
    _max_batch_size: int = 1
    _max_delay_s: float = 0.0
    _max_queue_size: int = 1
    _is_fast: bool = False
    _in_flight: int = 0
    _idle: asyncio.Event = field(default_factory=asyncio.Event)
    _index_ranges: dict[str, tuple[int, str]] = field(default_factory=dict)

    @property
    def is_ready(self) -> bool:
        """Whether the version serves requests."""
        return self.state is VersionState.READY

    def load(self, settings: Settings, exporter: Executor, preparer: Preparer, processes: EngineProcessPool) -> None:
        """Prepare (in the preparer's child process), choose the engine, warm up; on any failure the version
        is FAILED with the reason.

        `exporter` runs the ONNX exports of this version's cuts in the background.
        """
        started = time.perf_counter()
        set_model_state(self.name, self.version, VersionState.LOADING)
        try:
            self._load(settings, exporter, preparer, processes)
        except LayerserveError as error:
            self._fail(error.message)
        except Exception as error:  # fail-soft boundary: one bad version never stops the others.
            self.state, self.reason = VersionState.FAILED, f"unexpected error: {error}"
            log.exception("model %s version %d FAILED", self.name, self.version)
        else:
            self.state = VersionState.READY
            log.info(
                "model %s version %d READY on %s in %.1f s (%s)",
                self.name, self.version, self.engine_name, time.perf_counter() - started, self.engine_reason,
            )  # fmt: skip
        self.load_seconds = time.perf_counter() - started
        MODEL_LOAD_SECONDS.labels(self.name, str(self.version)).set(self.load_seconds)
        set_model_state(self.name, self.version, self.state)

    def _load(self, settings: Settings, exporter: Executor, preparer: Preparer, processes: EngineProcessPool) -> None:
        model_file = find_model_file(self.path)
        source = ModelSource(model_file, processes.digest(model_file), settings.trust_models)
        self._model_digest = source.digest
        cache_file = onnx_cache_path(settings.engine_cache_dir, source.digest)
        engine_choice = self.config.engine or settings.engine
        loaded: KerasEngine | None = None
        if EngineKind(engine_choice) is EngineKind.KERAS:
            verdict = Verdict(None, "engine=keras was requested")
            loaded = self._load_keras(source)
        else:
            prepared = preparer.model(source, cache_file, self.config.warmup_batch_size)
            verdict, self.signature = prepared.verdict, prepared.signature
            self.graph = LayerGraph.from_table(
                self.signature, prepared.layers, prepared.unavailable_reason, source.load
            )
            self.layer_count = prepared.layer_count
        self.codec = InputCodec.read(self.name, self.config, self.graph, self.path)
        choice = choose_engine(
            verdict, engine_choice, cache_file, self.signature.inputs, settings.verify_atol,
            settings.intra_op_threads, keras_engine=lambda: loaded or self._load_keras(source),
            processes=processes,
            warmup_rows=self.config.warmup_batch_size,
        )  # fmt: skip
        self.engine, self.engine_reason = choice.engine, choice.reason
        self._index_ranges = self.graph.index_ranges()
        self._configure_batching(settings)
        self._is_fast = self._warm_up(settings.inline_max_ms / 1000)
        cut_settings = settings.model_copy(update={"engine": engine_choice})
        self.cuts = CutCache(self.graph, source, cut_settings, exporter, preparer)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"model-{self.name}-{self.version}")
        self._batchers = BatcherTable(
            self._run, self._thread, self._max_batch_size, self._max_delay_s, self._max_queue_size,
            settings.request_timeout_ms, (self.name, str(self.version)), self.statistics,
            is_inline=lambda names, wanted: self._is_fast and self.graph.is_full_model(names, wanted),
        )  # fmt: skip

    def _load_keras(self, source: ModelSource) -> KerasEngine:
        """Load the Keras model here (the fallback when ONNX cannot serve it) and compile its call."""
        model = source.load()
        self.signature = read_signature(model)
        self.graph = LayerGraph(self.signature, model)
        self.layer_count = len(getattr(model, "layers", []))
        return KerasEngine(model, self.signature.inputs)

    def _configure_batching(self, settings: Settings) -> None:
        config = self.config
        is_batchable = all(spec.shape and spec.shape[0] == -1 for spec in self.signature.inputs)
        self._max_batch_size = (config.max_batch_size or settings.max_batch_size) if is_batchable else 1
        self._max_delay_s = (settings.max_delay_ms if config.max_delay_ms is None else config.max_delay_ms) / 1000
        self._max_queue_size = config.max_queue_size or settings.max_queue_size

    def _warm_up(self, inline_limit_s: float) -> bool:
        """Run the warm-up batch, then tell whether a full batch takes under `inline_limit_s` (best of three),
        so that batches may run on the event loop.

        One call with one row decides for slow models without three full batches, which on a big model
        would take the cores from the models that serve during a reload.
        """
        assert self.engine is not None
        if not self.engine.in_process:
            return False  # warmed up in its process when opened; its calls wait on it, never on the event loop
        inputs = self.signature.inputs
        self.engine.run(probe_batch(inputs, self.config.warmup_batch_size))
        for rows, tries in ((1, 1), (self._max_batch_size, 3)):
            batch, fastest = probe_batch(inputs, rows), float("inf")  # a full image batch costs ~0.1 s to draw
            for _ in range(tries):
                started = time.perf_counter()
                self.engine.run(batch)
                fastest = min(fastest, time.perf_counter() - started)
            if fastest >= inline_limit_s:
                return False
        return True

    def batching(self) -> dict[str, object]:
        """The batching settings in force, for metadata."""
        return {
            "max_batch_size": self._max_batch_size,
            "max_delay_ms": self._max_delay_s * 1000,
            "max_queue_size": self._max_queue_size,
            "queued": self._batchers.queued if self._batchers else 0,
            "inline": self._is_fast,
        }

    @property
    def image(self) -> ImageSpec | None:
        """The image input's spec (image models)."""
        return self.codec.image if self.codec else None

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer (text models)."""
        return self.codec.tokenizer if self.codec else None

    @property
    def labels(self) -> list[str] | None:
        """The class names of the classify output, if the model has any."""
        return self.codec.labels if self.codec else None

    @property
    def classify_output(self) -> str:
        """The output whose scores /classify ranks."""
        return self.codec.classify_output if self.codec else self.signature.outputs[0].name

    @property
    def encoded_input(self) -> str | None:
        """The input that may come encoded, as BYTES: images for image models, UTF-8 texts for text models."""
        return self.codec.encoded_input if self.codec else None

    def encode_texts(self, texts: list[str]) -> dict[str, Array]:
        """Texts -> the model's token-id input (see InputCodec)."""
        return self._codec().encode_texts(texts)

    async def decode_encoded(self, inputs: dict[str, Array], decoder: ImageDecoder) -> dict[str, Array]:
        """Replace a BYTES input of encoded images or UTF-8 texts with the model's tensor (see InputCodec)."""
        return await self._codec().decode_encoded(inputs, decoder)

    def require_image(self) -> ImageSpec:
        """The image spec of an image model (see InputCodec)."""
        return self._codec().require_image()

    def _codec(self) -> InputCodec:
        if self.codec is None:
            raise NotReadyError(f"model '{self.name}' version {self.version} is not ready")
        return self.codec

    @property
    def engine_name(self) -> str:
        """`onnx` or `keras` once loaded, else empty."""
        return self.engine.name if self.engine else ""

    async def predict(
        self,
        inputs: dict[str, Array],
        outputs: tuple[str, ...] = (),
        timeout_ms: int | None = None,
        use_cache: bool = True,
    ) -> dict[str, Array]:
        """Answer one request: cached rows from the feature cache (when enabled), the rest computed.

        With no `outputs`, the model's outputs are returned.

        Raises:
            NotReadyError: the version is not READY.
            QueueFullError: too many requests wait already (503).
            DeadlineExceededError: not answered within `timeout_ms` (default: the server's) (504).
            BadRequestError: a cut whose outputs need a tensor the request does not give.
        """
        started, is_success = time.perf_counter(), False
        try:
            answer = await self._predict(inputs, outputs, timeout_ms, use_cache)
            is_success = True
            return answer
        finally:
            self.statistics.record_request(is_success, time.perf_counter() - started)

    async def _predict(
        self, inputs: dict[str, Array], outputs: tuple[str, ...], timeout_ms: int | None, use_cache: bool
    ) -> dict[str, Array]:
        self._check_indices(inputs)
        wanted = outputs or tuple(spec.name for spec in self.signature.outputs)
        cache = self.cache if use_cache and self.config.cache else None
        if cache is None:
            return await self._compute(inputs, wanted, timeout_ms)

        async def compute(misses: list[int]) -> list[list[Array]]:
            computed = await self._compute({n: a[misses] for n, a in inputs.items()}, wanted, timeout_ms)
            return [[computed[name][j] for name in wanted] for j in range(len(misses))]

        keys = cache.row_keys(self.name, self.version, self._model_digest, wanted, inputs)
        rows = await self._read_through(cache, keys, len(wanted), compute)
        return {name: np.stack([row[k] for row in rows]) for k, name in enumerate(wanted)}

    async def _read_through(
        self,
        cache: FeatureCache,
        keys: list[str],
        width: int,
        compute: Callable[[list[int]], Awaitable[list[list[Array]]]],
    ) -> list[list[Array]]:
        """The one read-through path of the feature cache: each key's row of `width` arrays, from the cache, or
        computed for the misses (`compute` gets their indices) and stored. Times hits and misses in the
        statistics (a miss: its lookup and its store, not its compute)."""
        started = time.perf_counter()
        found = await cache.lookup(keys, width, self.name)
        misses = [index for index, row in enumerate(found) if row is None]
        if not misses:
            self.statistics.cache_hit.add(time.perf_counter() - started)
            return [row for row in found if row is not None]
        looked_up = time.perf_counter() - started
        fresh = await compute(misses)
        stored_at = time.perf_counter()
        await cache.store([keys[i] for i in misses], fresh, self.name)
        self.statistics.cache_miss.add(looked_up + time.perf_counter() - stored_at)
        rows = dict(zip(misses, fresh, strict=True))
        return [row if row is not None else rows[index] for index, row in enumerate(found)]

    def _check_indices(self, inputs: dict[str, Array]) -> None:
        """Values that index an Embedding must lie in [0, its input_dim): checked before batching, so that one
        bad request never reaches (and fails) a batch shared with others.

        Raises:
            BadRequestError: naming the input, the first bad position and value, and the valid range.
        """
        for name, (size, layer) in self._index_ranges.items():
            array = inputs.get(name)
            if array is None or array.dtype.kind not in "iuf" or array.size == 0:
                continue
            if array.min() >= 0 and array.max() < size:
                continue
            position = tuple(int(i) for i in np.argwhere((array < 0) | (array >= size) | np.isnan(array))[0])
            raise BadRequestError(
                f"input '{name}': value {array[position]} at position {list(position)} is out of range: it indexes "
                f"Embedding '{layer}' of {size} rows, so values must be integers from 0 to {size - 1}"
            )

    async def image_output(
        self, payloads: list[bytes], output: str, decoder: ImageDecoder, use_cache: bool = True, pool: str = ""
    ) -> Array:
        """Encoded images -> one output's rows, pooled per `pool` (see pool_features; "" keeps them); the
        feature cache (when enabled) is keyed by the encoded bytes, so a hit skips decoding and pooling.

        Raises:
            UnsupportedMediaTypeError: the model does not take images.
            UnprocessableImageError, PayloadTooLargeError: a bad image.
        """
        spec = self.require_image()

        async def compute(encoded: list[bytes]) -> Array:
            batch = await decoder.decode_batch(encoded, spec)
            rows = (await self.predict({spec.input_name: batch}, (output,), use_cache=False))[output]
            return pool_features(rows, pool) if pool else rows

        cache = self.cache if use_cache and self.config.cache else None
        if cache is None:
            return await compute(payloads)

        async def compute_missing(misses: list[int]) -> list[list[Array]]:
            return [[row] for row in await compute([payloads[i] for i in misses])]

        salt = f"{self._model_digest}:{self._codec().config_digest}:{pool}"
        keys = cache.encoded_keys(self.name, self.version, salt, output, payloads)
        return np.stack([row[0] for row in await self._read_through(cache, keys, 1, compute_missing)])

    async def _compute(
        self, inputs: dict[str, Array], outputs: tuple[str, ...], timeout_ms: int | None
    ) -> dict[str, Array]:
        """Run one request through its batcher: named tensors in (model inputs or cut layers), named out.

        Raises:
            NotReadyError: the version is not READY.
            QueueFullError: too many requests wait already (503).
            DeadlineExceededError: not answered within `timeout_ms` (default: the server's) (504).
            BadRequestError: a cut whose outputs need a tensor the request does not give.
        """
        if self._batchers is None:
            raise NotReadyError(f"model '{self.name}' version {self.version} is not ready")
        self.hold()
        try:
            return await self._batchers.submit(inputs, outputs, timeout_ms)
        finally:
            self.release()

    def hold(self) -> None:
        """A request uses this version: it is not closed before `release`."""
        self._in_flight += 1
        self._idle.clear()

    def release(self) -> None:
        """The end of a `hold`."""
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    async def drain(self) -> None:
        """Wait until the requests that hold this version have their answers."""
        if self._in_flight:
            await self._idle.wait()

    def _run(self, inputs: dict[str, Array], outputs: tuple[str, ...]) -> dict[str, Array]:
        """On the model thread: the full model's engine, or the cut for these names."""
        assert self.engine is not None and self.cuts is not None
        if self.graph.is_full_model(tuple(inputs), outputs):
            try:
                results = self.engine.run([inputs[spec.name] for spec in self.signature.inputs])
            except EngineProcessError as error:
                self._fail(error.message)
                raise
            by_name = {spec.name: array for spec, array in zip(self.signature.outputs, results, strict=True)}
            return {name: by_name[name] for name in outputs}
        cut = self.cuts.get(tuple(sorted(inputs)), tuple(sorted(set(outputs))))
        results = cut.engine.run([inputs[name] for name in cut.inputs])
        by_name = dict(zip(cut.outputs, results, strict=True))
        return {name: by_name[name] for name in outputs}

    def _fail(self, reason: str) -> None:
        """FAILED with `reason`, loudly: it did not load, or its engine process is gone (until loaded again)."""
        self.state, self.reason = VersionState.FAILED, reason
        set_model_state(self.name, self.version, self.state)
        log.error("model %s version %d FAILED: %s", self.name, self.version, reason)

    def close(self) -> None:
        """Drop the cuts, stop the model thread (after the calls already queued on it) and free the engine
        here, not wherever the last reference happens to go (the event loop, or a garbage collection)."""
        if self.cuts is not None:
            self.cuts.close()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        if self.engine is not None:
            self.engine.close()
        self.engine = None
        if self._batchers is not None:
            self._batchers.clear()
