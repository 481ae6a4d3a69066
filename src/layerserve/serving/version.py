"""ModelVersion: one version of a model in its life (LOADING, READY, FAILED): what it serves with (see
load_version), its batchers and model thread, the requests that hold it, and its answers to checked requests."""

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

from layerserve.engines.base import Engine
from layerserve.engines.onnx import start_runtime
from layerserve.engines.process.pool import EngineProcessPool
from layerserve.engines.process.usage import heap_bytes
from layerserve.errors import BudgetFullError, LayerserveError, NotReadyError
from layerserve.features.cache import FeatureCache
from layerserve.features.images import ImageDecoder, ImageSpec
from layerserve.features.pooling import pool_features
from layerserve.lifecycle.model import Signature
from layerserve.lifecycle.prepare import Preparer
from layerserve.metrics import MODEL_LOAD_SECONDS, set_model_state
from layerserve.serving.batchers import BatcherTable, BatchingPlan
from layerserve.serving.cuts import CutCache
from layerserve.serving.input_codec import InputCodec
from layerserve.serving.layers import LayerGraph
from layerserve.serving.loading import load_version
from layerserve.serving.pipeline import Pipeline, StepSource
from layerserve.serving.read_through import read_through
from layerserve.serving.request_checks import RequestChecks
from layerserve.serving.routing import VersionRouter
from layerserve.serving.statistics import VersionStatistics
from layerserve.serving.warmup import WarmupTarget, run_warmup
from layerserve.settings import ModelConfig, Settings
from layerserve.tensors import Array
from layerserve.tracing import span
from layerserve.training.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_WALL_OFFSET_S = time.time() - time.monotonic()  # one offset: a version's last use reads the same every time


class VersionState(StrEnum):
    """Where a version is in its life."""

    UNAVAILABLE = "UNAVAILABLE"  # listed, not loaded: under a memory budget it loads on its first request
    LOADING = "LOADING"
    READY = "READY"
    FAILED = "FAILED"


@dataclass
class ModelVersion:
    """One version of a model: its state, what it serves with once loaded, and the requests that hold it."""

    name: str
    version: int
    path: Path
    config: ModelConfig
    fingerprint: tuple[object, ...] = ()
    state: VersionState = VersionState.LOADING
    reason: str = ""
    signature: Signature = field(default_factory=lambda: Signature((), ()))
    graph: LayerGraph = field(default_factory=lambda: LayerGraph(Signature((), ())))
    cuts: CutCache | None = None
    codec: InputCodec | None = None
    checks: RequestChecks = field(default_factory=lambda: RequestChecks(LayerGraph(Signature((), ()))))
    cache: FeatureCache | None = None
    engine_reason: str = ""
    layer_count: int = 0
    load_seconds: float = 0.0
    statistics: VersionStatistics = field(default_factory=VersionStatistics)
    # The doors' parse state for this version, by kind (templates of requests seen before): kept as long as the
    # version, gone with it.
    parse_states: dict[type, object] = field(default_factory=dict)
    _model_digest: str = ""
    _server_bytes: int = 0
    _plan: BatchingPlan = field(default_factory=BatchingPlan)
    _router: VersionRouter | None = None
    _thread: ThreadPoolExecutor | None = None
    _batchers: BatcherTable | None = None
    _pipeline: Pipeline | None = None
    _in_flight: int = 0
    _idle: asyncio.Event = field(default_factory=asyncio.Event)
    last_used: float = 0.0  # time.monotonic() when a request last held it, or it loaded (least recently used first)

    @classmethod
    def listed(cls, name: str, version: int, path: Path, config: ModelConfig, fingerprint: tuple[object, ...],
               reason: str) -> ModelVersion:  # fmt: skip
        """A version known from the repository and not loaded (UNAVAILABLE, with `reason`): a request loads it."""
        return cls(name, version, path, config, fingerprint, VersionState.UNAVAILABLE, reason)

    @property
    def model_digest(self) -> str:
        """The SHA-256 of the loaded model file (other weights under the same version number differ)."""
        return self._model_digest

    @property
    def is_ready(self) -> bool:
        """Whether the version serves requests."""
        return self.state is VersionState.READY

    @property
    def is_listed(self) -> bool:
        """Whether the version is known and not loaded (UNAVAILABLE): a request for it loads it."""
        return self.state is VersionState.UNAVAILABLE

    @property
    def last_used_at(self) -> float | None:
        """When a request last used it (or it loaded), as a Unix time; None if neither happened."""
        return self.last_used + _WALL_OFFSET_S if self.last_used else None

    @property
    def in_use(self) -> bool:
        """Whether a request holds it now (in flight, or queued in a batcher)."""
        return self._in_flight > 0

    def load(self, settings: Settings, exporter: Executor, preparer: Preparer, processes: EngineProcessPool) -> None:
        """Prepare (in the preparer's child process), choose the engine, warm up (on the version's own warm-up
        requests too, see run_warmup); on any failure the version is FAILED with the reason.

        `exporter` runs the ONNX exports of this version's cuts in the background.
        """
        started = time.perf_counter()
        set_model_state(self.name, self.version, VersionState.LOADING)
        try:
            self._load(settings, exporter, preparer, processes)
        except Exception as error:  # fail-soft boundary: one bad version never stops the others.
            self._settle(started, error)
        else:
            self._settle(started, None)

    async def connect_pipeline(self, source: StepSource, timeout_ms: int) -> None:
        """Load a pipeline's version: find and check its steps (see Pipeline.connect); on any failure the version
        is FAILED with the reason, which names the step.

        Raises:
            BudgetFullError: a step's model had to load and found no room now (the version is listed, UNAVAILABLE).
        """
        started = time.perf_counter()
        set_model_state(self.name, self.version, VersionState.LOADING)
        try:
            pipeline = await Pipeline.connect(self.name, self.config, self.path, source, timeout_ms)
        except BudgetFullError as error:  # a step had no room now: listed again, a later request tries again
            self.state, self.reason = VersionState.UNAVAILABLE, f"not loaded: {error.message}"
            set_model_state(self.name, self.version, self.state)
            raise
        except Exception as error:  # fail-soft boundary, as `load`
            self._settle(started, error)
            return
        self.signature, self.graph, self.codec, self.checks = (
            pipeline.signature, pipeline.graph, pipeline.codec, pipeline.checks
        )  # fmt: skip
        self.engine_reason, self._model_digest, self._pipeline = pipeline.describe(), pipeline.digest, pipeline
        self._plan = BatchingPlan(max_batch_size=pipeline.max_batch_size)  # its first step's
        self.statistics.steps = pipeline.statistics
        self._settle(started, None)

    def _settle(self, started: float, error: Exception | None) -> None:
        """The end of a load: READY, or FAILED with the reason (logged with its traceback when it is a bug)."""
        if isinstance(error, LayerserveError):
            self._fail(error.message)
        elif error is not None:
            self.state, self.reason = VersionState.FAILED, f"unexpected error: {error}"
            log.error("model %s version %d FAILED", self.name, self.version, exc_info=error)
        else:
            self.state = VersionState.READY
            self.last_used = time.monotonic()
            log.info(
                "model %s version %d READY on %s in %.1f s (%s)",
                self.name, self.version, self.engine_name, time.perf_counter() - started, self.engine_reason,
            )  # fmt: skip
        self.load_seconds = time.perf_counter() - started
        MODEL_LOAD_SECONDS.labels(self.name, str(self.version)).set(self.load_seconds)
        set_model_state(self.name, self.version, self.state)

    def _load(self, settings: Settings, exporter: Executor, preparer: Preparer, processes: EngineProcessPool) -> None:
        start_runtime()  # before the measurement: its one-time cost is no version's
        heap_before = heap_bytes()
        loaded = load_version(self.name, self.path, self.config, settings, exporter, preparer, processes)
        self.signature, self.graph, self.layer_count = loaded.signature, loaded.graph, loaded.layer_count
        self.codec, self.checks, self.cuts = loaded.codec, loaded.checks, loaded.cuts
        self.engine_reason, self._model_digest, self._plan = loaded.engine_reason, loaded.model_digest, loaded.plan
        self._router = VersionRouter(loaded.engine, loaded.cuts, loaded.graph, self._fail)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"model-{self.name}-{self.version}")
        router, inline = self._router, loaded.plan.inline
        self._batchers = BatcherTable(
            router.run, self._thread, loaded.plan, settings.request_timeout_ms, (self.name, str(self.version)),
            self.statistics, is_inline=lambda names, wanted: inline and router.is_full_model(names, wanted),
            run_async=(router.run_async, router.sends_from_loop), index_check=loaded.checks.index_check,
            lanes=router.lanes,
        )  # fmt: skip
        try:
            target = WarmupTarget(
                loaded.graph, loaded.checks, loaded.codec, router.run, loaded.plan.max_batch_size,
                settings.max_image_pixels,
            )  # fmt: skip
            run_warmup(self.path, self.name, target)
        except BaseException:
            self.close()  # a FAILED version keeps no engine (which may hold an engine process's session)
            raise
        # What this load allocated here, its batchers and model thread included (at least its graph's size).
        self._server_bytes = max(loaded.server_bytes, heap_bytes() - heap_before)

    @property
    def engine(self) -> Engine | None:
        """The full model's engine once loaded (ONNX Runtime, here or in an engine process, or Keras)."""
        return self._router.engine if self._router else None

    @engine.setter
    def engine(self, engine: Engine) -> None:
        assert self._router is not None, "only a loaded version has an engine"
        self._router.engine = engine

    @property
    def queued(self) -> int:
        """Requests waiting in this version's batcher queues now."""
        return self._batchers.queued if self._batchers else 0

    @property
    def max_batch_size(self) -> int:
        """The most rows one model call takes."""
        return self._plan.max_batch_size

    def batching(self) -> dict[str, object]:
        """The batching settings in force, for metadata."""
        plan = self._plan
        return {
            "max_batch_size": plan.max_batch_size,
            "max_delay_ms": plan.max_delay_s * 1000,
            "max_queue_size": plan.max_queue_size,
            "queued": self.queued,
            "inline": plan.inline,
        }

    def memory(self) -> dict[str, int]:
        """The version's resident memory, in bytes: what it added to the server process while it loaded, its
        session in its engine process, its share of that process's other memory, its cuts' graphs; and the
        total (an estimate: the first two are growths of resident memory, which other work can blur)."""
        session, share = self.engine.resident() if self.engine is not None else (0, 0)
        cuts = self.cuts.graph_bytes() if self.cuts is not None else 0
        parts = {"server_bytes": self._server_bytes, "session_bytes": session, "process_share_bytes": share}
        parts["cuts_bytes"] = cuts
        return {**parts, "total_bytes": sum(parts.values())}

    @property
    def image(self) -> ImageSpec | None:
        """The image input's spec (image models)."""
        return self.codec.image if self.codec else None

    @property
    def input_kind(self) -> str:
        """What `/classify` and `/features` take: `image`, `text` or `tensor` (a pipeline's first step's)."""
        if self.codec is None:
            return self.config.input
        return "image" if self.codec.image else "text" if self.codec.tokenizer else "tensor"

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
        """`onnx` or `keras` once loaded (`pipeline` for a pipeline), else empty."""
        if self._pipeline is not None:
            return "pipeline"
        return self.engine.name if self.engine else ""

    async def predict(
        self,
        inputs: dict[str, Array],
        outputs: tuple[str, ...] = (),
        timeout_ms: int | None = None,
        use_cache: bool = True,
    ) -> dict[str, Array]:
        """Answer one request, checked already (see RequestChecks): cached rows from the feature cache (when
        enabled), the rest computed.

        With no `outputs`, the model's outputs are returned.

        Raises:
            NotReadyError: the version is not READY.
            QueueFullError: too many requests wait already (503).
            DeadlineExceededError: not answered within `timeout_ms` (default: the server's) (504).
            BadRequestError: a cut whose outputs need a tensor the request does not give.
        """
        started, is_success = time.perf_counter(), False
        wanted = outputs or tuple(spec.name for spec in self.signature.outputs)
        cache = self.cache if use_cache and self.config.cache else None
        try:
            if cache is None:
                answer = await self._compute(inputs, wanted, timeout_ms)
            else:
                answer = await self._read_through(cache, inputs, wanted, timeout_ms)
            is_success = True
            return answer
        finally:
            self.statistics.record_request(is_success, time.perf_counter() - started)

    async def _read_through(
        self, cache: FeatureCache, inputs: dict[str, Array], wanted: tuple[str, ...], timeout_ms: int | None
    ) -> dict[str, Array]:
        """`predict` through the feature cache: cached rows read, the rest computed and stored."""

        async def compute(misses: list[int]) -> list[list[Array]]:
            computed = await self._compute({n: a[misses] for n, a in inputs.items()}, wanted, timeout_ms)
            return [[computed[name][j] for name in wanted] for j in range(len(misses))]

        # The batcher checks index ranges on the rows it computes; checked here first, a bad value's position is
        # its place in the request, not among the rows the cache did not have.
        self.checks.check_index_ranges(inputs)
        keys = cache.row_keys(self.name, self.version, self._model_digest, wanted, inputs)
        rows = await read_through(cache, keys, len(wanted), compute, self.statistics, self.name)
        return {name: np.stack([row[k] for row in rows]) for k, name in enumerate(wanted)}

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
            with span("decode"):
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
        rows = await read_through(cache, keys, 1, compute_missing, self.statistics, self.name)
        return np.stack([row[0] for row in rows])

    async def derived(
        self, payload: bytes, what: str, width: int, compute: Callable[[], Awaitable[list[Array]]]
    ) -> list[Array]:
        """`width` arrays derived from one encoded input by `compute` (`what` names the derivation and its
        parameters), kept in the feature cache (Redis when configured) by the payload's digest and the version's
        files, so that another worker or a later request reuses them."""
        if self.cache is None:
            return await compute()

        async def compute_missing(misses: list[int]) -> list[list[Array]]:
            return [await compute()]

        salt = f"{self._model_digest}:{self._codec().config_digest}"
        keys = self.cache.encoded_keys(self.name, self.version, salt, what, [payload])
        return (await read_through(self.cache, keys, width, compute_missing, self.statistics, self.name))[0]

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
        pipeline = self._pipeline
        if self._batchers is None and pipeline is None:
            raise NotReadyError(f"model '{self.name}' version {self.version} is not ready")
        self.hold()
        try:
            if pipeline is not None:
                return await pipeline.run(inputs, outputs, timeout_ms)
            assert self._batchers is not None
            return await self._batchers.submit(inputs, outputs, timeout_ms)
        finally:
            self.release()

    def hold(self) -> None:
        """A request uses this version: it is not closed before `release`."""
        self.last_used = time.monotonic()
        if not self._in_flight:
            self._idle.clear()
        self._in_flight += 1

    def release(self) -> None:
        """The end of a `hold`."""
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    async def drain(self) -> None:
        """Wait until the requests that hold this version have their answers."""
        if self._in_flight:
            await self._idle.wait()

    def _fail(self, reason: str) -> None:
        """FAILED with `reason`, loudly: it did not load, or its engine process is gone (until loaded again)."""
        self.state, self.reason = VersionState.FAILED, reason
        set_model_state(self.name, self.version, self.state)
        log.error("model %s version %d FAILED: %s", self.name, self.version, reason)

    def close(self) -> None:
        """Drop the cuts, stop the model thread (after the calls already queued on it) and free the engine
        here, not wherever the last reference happens to go (the event loop, or a garbage collection)."""
        self._pipeline = None
        if self.cuts is not None:
            self.cuts.close()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        if self._router is not None:
            self._router.engine.close()
        self._router = None
        if self._batchers is not None:
            self._batchers.clear()
            self._batchers = None  # its calls hold the router, which holds this version: no cycle left to collect
