"""load_version: a version's folder -> its signature, layer graph, input codec, checks, engine, cuts and batching.

The preparer's child loads the model, exports and verifies it (the server never loads Keras for that); the
engine is chosen from its verdict (verified ONNX here or in an engine process, else Keras, see choose_engine)
and warmed up, which also tells whether a full batch is fast enough to run on the event loop.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

from layerserve.engines.base import Engine, EngineKind, Verdict, onnx_cache_path, probe_batch
from layerserve.engines.choice import choose_engine
from layerserve.engines.keras import KerasEngine
from layerserve.engines.onnx import OnnxEngine, start_runtime
from layerserve.engines.onnx_subgraph import TensorPlace
from layerserve.engines.process.pool import EngineProcessPool
from layerserve.engines.process.usage import heap_bytes
from layerserve.lifecycle.model import Signature, find_model_file, read_signature
from layerserve.lifecycle.prepare import ModelSource, Preparer
from layerserve.serving.batchers import BatchingPlan
from layerserve.serving.cuts import CutCache, ServedExport
from layerserve.serving.input_codec import InputCodec
from layerserve.serving.layers import LayerGraph
from layerserve.serving.request_checks import RequestChecks
from layerserve.settings import ModelConfig, Settings


@dataclass(frozen=True)
class LoadedVersion:
    """What a loaded version serves with."""

    signature: Signature
    graph: LayerGraph
    layer_count: int
    codec: InputCodec
    checks: RequestChecks
    engine: Engine
    engine_reason: str
    model_digest: str
    cuts: CutCache
    plan: BatchingPlan
    server_bytes: int  # how much this process's C heap grew while the version loaded (an estimate)


@dataclass
class _Model:
    """The model's description, from the preparer's record or from Keras loaded here."""

    signature: Signature
    graph: LayerGraph
    layer_count: int
    verdict: Verdict
    keras: KerasEngine | None = None
    located: dict[str, TensorPlace] = dataclasses.field(default_factory=dict)  # layers' outputs in the export


def _load_keras(source: ModelSource) -> _Model:
    """Load the Keras model here (the fallback when ONNX cannot serve it) and compile its call."""
    model = source.load()
    signature = read_signature(model)
    engine = KerasEngine(model, signature.inputs)
    verdict = Verdict(None, "engine=keras was requested")
    return _Model(signature, LayerGraph(signature, model), len(getattr(model, "layers", [])), verdict, engine)


def load_version(
    name: str,
    folder: Path,
    config: ModelConfig,
    settings: Settings,
    exporter: Executor,
    preparer: Preparer,
    processes: EngineProcessPool,
) -> LoadedVersion:
    """Prepare, choose the engine, warm it up (see the module docstring).

    `exporter` runs the ONNX exports of the version's cuts in the background.

    Raises:
        LayerserveError: the version cannot be served (the message says why); any other error is a bug.
    """
    start_runtime()  # before the measurement: its one-time cost is no version's
    heap_before = heap_bytes()
    model_file = find_model_file(folder)
    source = ModelSource(model_file, processes.digest(model_file), settings.trust_models)
    cache_file = onnx_cache_path(settings.engine_cache_dir, source.digest)
    engine_choice = config.engine or settings.engine
    if EngineKind(engine_choice) is EngineKind.KERAS:
        model = _load_keras(source)
    else:
        prepared = preparer.model(source, cache_file, config.warmup_batch_size)
        graph = LayerGraph.from_table(prepared.signature, prepared.layers, prepared.unavailable_reason, source.load)
        model = _Model(prepared.signature, graph, prepared.layer_count, prepared.verdict, located=prepared.located)
    codec = InputCodec.read(name, config, model.graph, folder)

    def keras_engine() -> KerasEngine:
        if model.keras is None:
            fallback = _load_keras(source)
            model.signature, model.graph, model.layer_count = fallback.signature, fallback.graph, fallback.layer_count
            model.keras = fallback.keras
        assert model.keras is not None
        return model.keras

    choice = choose_engine(
        model.verdict, engine_choice, cache_file, model.signature.inputs, settings.verify_atol,
        settings.intra_op_threads, keras_engine=keras_engine, processes=processes,
        warmup_rows=config.warmup_batch_size,
    )  # fmt: skip
    plan = BatchingPlan.of(config, settings, model.signature)
    try:  # from here on the engine is ours to close if anything fails (it may be a process)
        plan = dataclasses.replace(plan, inline=_is_fast(choice.engine, model.signature, config, plan, settings))
        if plan.inline and not settings.intra_op_threads and isinstance(choice.engine, OnnxEngine):
            # On the event loop's thread, a model this fast loses more to waking ORT's other threads for each
            # call than it gains from them, and they take the core that the HTTP stack and other models need.
            threaded = choice.engine
            threaded.close()  # first: two sessions of one graph at once would double the load's peak memory
            choice = dataclasses.replace(choice, engine=threaded.with_threads(1))
        export = ServedExport(cache_file, model.located) if choice.engine.name is EngineKind.ONNX else None
        cuts = CutCache(
            model.graph, source, settings.model_copy(update={"engine": engine_choice}), exporter, preparer, export,
            keras_here=model.keras is not None,
        )  # fmt: skip
        checks = RequestChecks(model.graph, codec.encoded_input, codec.image is not None)
    except BaseException:
        choice.engine.close()
        raise
    return LoadedVersion(
        model.signature, model.graph, model.layer_count, codec, checks, choice.engine, choice.reason, source.digest,
        cuts, plan, _server_bytes(heap_bytes() - heap_before, choice.engine, cache_file),
    )  # fmt: skip


def _server_bytes(heap_growth: int, engine: Engine, cache_file: Path) -> int:
    """What the version takes in this process: its heap's growth while loading, and at least its ONNX graph's size
    for a session here (it holds those weights; frees by other threads can hide them from the heap's growth)."""
    if engine.in_process and engine.name is EngineKind.ONNX:
        try:
            return max(heap_growth, cache_file.stat().st_size)
        except OSError:
            pass
    return max(0, heap_growth)


def _is_fast(engine: Engine, signature: Signature, config: ModelConfig, plan: BatchingPlan, settings: Settings) -> bool:
    """Run the warm-up batch, then tell whether a full batch takes under `inline_max_ms` (best of three), so
    that batches may run on the event loop.

    One call with one row decides for slow models without three full batches, which on a big model would take
    the cores from the models that serve during a reload.
    """
    if not engine.in_process:
        return False  # warmed up in its process when opened; its calls wait on it, never on the event loop
    limit_s = settings.inline_max_ms / 1000
    engine.run(probe_batch(signature.inputs, config.warmup_batch_size))
    for rows, tries in ((1, 1), (plan.max_batch_size, 3)):
        batch, fastest = probe_batch(signature.inputs, rows), float("inf")  # a full image batch costs ~0.1 s to draw
        for _ in range(tries):
            started = time.perf_counter()
            engine.run(batch)
            fastest = min(fastest, time.perf_counter() - started)
        if fastest >= limit_s:
            return False
    return True
