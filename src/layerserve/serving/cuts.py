"""CutCache: a version's cuts, built once per (inputs, outputs), in the way that keeps Keras out of the server.

Where the version serves its verified ONNX export and the export holds the cut's layers (see
engines/onnx_subgraph.py), the cut is taken out of the export here, in milliseconds, and then checked against Keras
in the preparer's child. Otherwise the child exports and verifies the cut while the request waits; only where the
version itself runs on Keras in this process does the cut serve on Keras at once while the child exports it.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layerserve.engines.base import Engine, EngineKind
from layerserve.engines.choice import choose_engine
from layerserve.engines.keras import KerasEngine
from layerserve.engines.onnx import OnnxEngine
from layerserve.engines.onnx_subgraph import CutNotExtractableError, TensorPlace, extract_cut
from layerserve.errors import ModelLoadError
from layerserve.lifecycle.prepare import ModelSource, Preparer, read_record
from layerserve.serving.layers import LayerGraph
from layerserve.settings import Settings
from layerserve.tensors import TensorSpec

log = logging.getLogger(__name__)

CutKey = tuple[tuple[str, ...], tuple[str, ...]]
_CHECKING = "ONNX: cut out of the verified export (its layers' tensors matched Keras on the probe batch)"


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


@dataclass(frozen=True)
class ServedExport:
    """The verified ONNX export a version serves, and where its layers' outputs are in it."""

    path: Path
    located: dict[str, TensorPlace] = field(default_factory=dict)

    def holds(self, names: tuple[str, ...]) -> bool:
        """Whether every named tensor is located in the export."""
        return all(name in self.located for name in names)


class CutCache:
    """Bounded LRU of a version's cuts (see the module). `export`: the verified export the version serves (None:
    it serves Keras); `keras_here`: the version's Keras model is loaded in this process."""

    def __init__(
        self, graph: LayerGraph, source: ModelSource, settings: Settings, exporter: Executor, preparer: Preparer,
        export: ServedExport | None = None, keras_here: bool = False,
    ) -> None:  # fmt: skip
        self._graph = graph
        self._source = source
        self._settings = settings
        self._exporter = exporter
        self._preparer = preparer
        self._export = export
        self._keras_here = keras_here
        self._cuts: OrderedDict[CutKey, Cut] = OrderedDict()
        self._pending: set[Future[None]] = set()
        self._lock = threading.Lock()

    def get(self, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> Cut:
        """The cut for these sorted names, built on first use (see the module).

        Raises:
            BadRequestError: an unknown name, or outputs that need a tensor the inputs do not give.
        """
        key = (inputs, outputs)
        with self._lock:
            if key in self._cuts:
                self._cuts.move_to_end(key)
                return self._cuts[key]
        self._graph.check_cut(inputs, outputs)
        specs = tuple(self._graph.spec(name, "input") for name in inputs)
        cut = self._cut_out(inputs, outputs, specs)
        if cut is None:
            build = self._keras_now if self._keras_here else self._exported
            cut = build(inputs, outputs, specs)
        with self._lock:
            self._cuts[key] = cut
            while len(self._cuts) > self._settings.max_cuts_per_version:
                self._cuts.popitem(last=False)
        return cut

    def _cache_file(self, inputs: tuple[str, ...], outputs: tuple[str, ...], kind: str = "") -> Path:
        key = f"{self._source.digest}|{','.join(inputs)}|{','.join(outputs)}"
        name = hashlib.sha256(key.encode()).hexdigest()[:40]
        return self._settings.engine_cache_dir / "cuts" / f"{name}{kind}.onnx"

    def _cut_out(self, inputs: tuple[str, ...], outputs: tuple[str, ...], specs: tuple[TensorSpec, ...]) -> Cut | None:
        """The cut taken out of the served export, checked against Keras in the background; None where the export
        does not hold it (or a check found it wrong before)."""
        export = self._export
        if export is None or not export.holds(inputs + outputs):
            return None
        target = self._cache_file(inputs, outputs, "-extracted")
        record = read_record(target)
        if record is not None and not self._passes(record.get("max_difference")):
            return None
        try:
            if not target.exists():
                extract_cut(
                    export.path, [(spec, export.located[spec.name]) for spec in specs],
                    [(name, export.located[name]) for name in outputs], target,
                )  # fmt: skip
            engine = OnnxEngine(target, specs, self._settings.intra_op_threads)
        except (CutNotExtractableError, ModelLoadError) as error:
            log.info("cut %s -> %s is exported instead: %s", inputs, outputs, error.message)
            return None
        cut = Cut(inputs, outputs, engine, f"{_CHECKING}; being checked against Keras")
        if record is not None:
            cut.engine_reason = f"{_CHECKING}; checked against Keras: max difference {record['max_difference']:.2e}"
        else:
            self._in_background(self._check, cut, target)
        return cut

    def _check(self, cut: Cut, target: Path) -> None:
        """Check a cut taken out of the export against Keras (in the preparer's child); one that fails is dropped,
        so that the next request exports it."""
        try:
            verdict = self._preparer.check_cut(self._source, cut.inputs, cut.outputs, target)
        except Exception:  # fail-soft boundary: the cut serves on, unchecked, and says so.
            log.exception("the check of cut %s -> %s against Keras failed to run", cut.inputs, cut.outputs)
            cut.engine_reason = f"{_CHECKING}; its check against Keras failed to run (see the log)"
            return
        if self._passes(verdict.max_difference):
            cut.engine_reason = f"{_CHECKING}; checked against Keras: max difference {verdict.max_difference:.2e}"
            return
        if verdict.max_difference is None:  # no check could run (the model file is gone, say): it serves on, saying so
            cut.engine_reason = f"{_CHECKING}; not checked against Keras: {verdict.error}"
            return
        log.warning("cut %s -> %s out of the export differs from Keras (%s); exporting it", cut.inputs, cut.outputs,
                    verdict.max_difference)  # fmt: skip
        with self._lock:
            if self._cuts.get((cut.inputs, cut.outputs)) is cut:
                del self._cuts[(cut.inputs, cut.outputs)]

    def _passes(self, difference: float | None) -> bool:
        return difference is not None and difference <= self._settings.verify_atol

    def _exported(self, inputs: tuple[str, ...], outputs: tuple[str, ...], specs: tuple[TensorSpec, ...]) -> Cut:
        """The cut exported and verified by the preparer's child (the request waits); on Keras here if that
        fails."""
        cache_file = self._cache_file(inputs, outputs)
        try:
            verdict = self._preparer.cut(self._source, inputs, outputs, cache_file)
        except ModelLoadError as error:
            log.warning("cut %s -> %s: %s; serving it with the Keras compiled call", inputs, outputs, error.message)
            engine = KerasEngine(self._graph.build_cut(inputs, outputs), specs)
            return Cut(inputs, outputs, engine, f"{error.message}; serving with the Keras compiled call")
        settings = self._settings
        choice = choose_engine(
            verdict, EngineKind.AUTO, cache_file, specs, settings.verify_atol, settings.intra_op_threads,
            keras_engine=lambda: KerasEngine(self._graph.build_cut(inputs, outputs), specs),
        )  # fmt: skip
        return Cut(inputs, outputs, choice.engine, choice.reason)

    def _keras_now(self, inputs: tuple[str, ...], outputs: tuple[str, ...], specs: tuple[TensorSpec, ...]) -> Cut:
        """The cut on Keras at once (the version's Keras model is here), exported in the background."""
        engine = KerasEngine(self._graph.build_cut(inputs, outputs), specs)
        if EngineKind(self._settings.engine) is EngineKind.KERAS:
            return Cut(inputs, outputs, engine, "engine=keras was requested")
        cut = Cut(inputs, outputs, engine, "Keras compiled call while the ONNX export runs")
        self._in_background(self._upgrade, cut, specs, engine)
        return cut

    def _in_background(self, function: Any, *args: Any) -> None:
        future = self._exporter.submit(function, *args)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)

    def _upgrade(self, cut: Cut, specs: tuple[TensorSpec, ...], engine: KerasEngine) -> None:
        """Export and verify the cut (in the preparer's child process); switch it to ONNX when that passes
        (fail-soft: it stays on Keras)."""
        cache_file = self._cache_file(cut.inputs, cut.outputs)
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

    def graph_bytes(self) -> int:
        """The size of the ONNX graphs of the cached cuts (their weights; Keras cuts share the model's)."""
        with self._lock:
            engines = [cut.engine for cut in self._cuts.values()]
        return sum(_file_bytes(engine.path) for engine in engines if isinstance(engine, OnnxEngine))

    def describe(self) -> list[dict[str, Any]]:
        """Every cached cut, least recently used first."""
        with self._lock:
            return [cut.to_dict() for cut in self._cuts.values()]

    def close(self) -> None:
        """Drop the cuts and cancel checks and exports that have not started."""
        for future in list(self._pending):
            future.cancel()
        with self._lock:
            engines = [cut.engine for cut in self._cuts.values()]
            self._cuts.clear()
        for engine in engines:
            engine.close()


def _file_bytes(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
