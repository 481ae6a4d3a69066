"""CutCache: a version's cuts, built once per (inputs, outputs), served on Keras at once, then on ONNX."""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerserve.engines.base import Engine, EngineKind
from layerserve.engines.choice import choose_engine
from layerserve.engines.keras import KerasEngine
from layerserve.lifecycle.prepare import ModelSource, Preparer
from layerserve.serving.layers import LayerGraph
from layerserve.settings import Settings
from layerserve.tensors import TensorSpec

log = logging.getLogger(__name__)

CutKey = tuple[tuple[str, ...], tuple[str, ...]]


@dataclass
class Cut:
    """A sub-graph from named tensors to named outputs, and the engine that runs it now."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    engine: Engine
    engine_reason: str

    def to_dict(self) -> dict[str, Any]:
        """The metadata form."""
        return {
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "engine": self.engine.name,
            "engine_reason": self.engine_reason,
        }


class CutCache:
    """Bounded LRU of a version's cuts; each new cut's ONNX export runs on the shared exporter thread."""

    def __init__(
        self, graph: LayerGraph, source: ModelSource, settings: Settings, exporter: Executor, preparer: Preparer
    ) -> None:
        self._graph = graph
        self._source = source
        self._settings = settings
        self._exporter = exporter
        self._preparer = preparer
        self._cuts: OrderedDict[CutKey, Cut] = OrderedDict()
        self._pending: set[Future[None]] = set()
        self._lock = threading.Lock()

    def get(self, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> Cut:
        """The cut for these sorted names, built on first use (on the Keras compiled call).

        Raises:
            BadRequestError: the outputs need a tensor the inputs do not give.
        """
        key = (inputs, outputs)
        with self._lock:
            if key in self._cuts:
                self._cuts.move_to_end(key)
                return self._cuts[key]
        model = self._graph.build_cut(inputs, outputs)
        specs = tuple(self._graph.spec(name, "input") for name in inputs)
        engine = KerasEngine(model, specs)
        waiting = EngineKind(self._settings.engine) is not EngineKind.KERAS
        cut = Cut(inputs, outputs, engine, "Keras compiled call while the ONNX export runs" if waiting else "")
        with self._lock:
            self._cuts[key] = cut
            while len(self._cuts) > self._settings.max_cuts_per_version:
                self._cuts.popitem(last=False)
        if waiting:
            future = self._exporter.submit(self._upgrade, cut, specs, engine)
            self._pending.add(future)
            future.add_done_callback(self._pending.discard)
        else:
            cut.engine_reason = "engine=keras was requested"
        return cut

    def _cache_file(self, cut: Cut) -> Path:
        key = f"{self._source.digest}|{','.join(cut.inputs)}|{','.join(cut.outputs)}"
        return self._settings.engine_cache_dir / "cuts" / f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.onnx"

    def _upgrade(self, cut: Cut, specs: tuple[TensorSpec, ...], engine: KerasEngine) -> None:
        """Export and verify the cut (in the preparer's child process); switch it to ONNX when that passes
        (fail-soft: it stays on Keras)."""
        cache_file = self._cache_file(cut)
        try:
            verdict = self._preparer.cut(self._source, cut.inputs, cut.outputs, cache_file)
            settings = self._settings
            choice = choose_engine(
                verdict, EngineKind.AUTO, cache_file, specs, settings.verify_atol, settings.intra_op_threads,
                keras_engine=lambda: engine,
            )  # fmt: skip
        except Exception:  # fail-soft boundary: the cut keeps serving on Keras.
            log.exception("ONNX upgrade of cut %s -> %s failed", cut.inputs, cut.outputs)
            cut.engine_reason = "ONNX upgrade failed (see the log); serving with the Keras compiled call"
            return
        cut.engine, cut.engine_reason = choice.engine, choice.reason
        log.info("cut %s -> %s now on %s (%s)", cut.inputs, cut.outputs, choice.engine.name, choice.reason)

    def describe(self) -> list[dict[str, Any]]:
        """Every cached cut, least recently used first."""
        with self._lock:
            return [cut.to_dict() for cut in self._cuts.values()]

    def close(self) -> None:
        """Drop the cuts and cancel exports that have not started."""
        for future in list(self._pending):
            future.cancel()
        with self._lock:
            self._cuts.clear()
