"""Preparation of a model file in a child process: load it, read its layer table, export and verify ONNX.

Keras' loader and tf2onnx hold the GIL for long stretches; run in the server process, they stall the
requests of every other model. A child process at background priority (a fresh interpreter that runs only
`layerserve.lifecycle.preparer_child`, see ChildProcess) does this once per model file and writes the
result (a `Preparation`) beside the ONNX export, keyed by the file's hash. Loading a version whose file
was prepared before opens an ONNX Runtime session and nothing more. The preparation also locates each layer's
output in the export, so that the server cuts the graph there without Keras (see CutCache); the child exports
(and checks) the cuts it cannot.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from layerserve.child_process import ChildProcess
from layerserve.engines.base import Verdict, graph_name, max_difference, probe_batch
from layerserve.engines.keras import KerasEngine
from layerserve.engines.onnx import OnnxEngine, export_and_verify
from layerserve.engines.onnx_subgraph import TensorPlace, locate_layers
from layerserve.errors import ModelLoadError
from layerserve.lifecycle.model import Signature, file_digest, load_model, read_signature
from layerserve.serving.layers import LayerGraph, LayerInfo
from layerserve.tensors import TensorSpec

log = logging.getLogger(__name__)

_FORMAT = 4  # 2: Embedding layers record their input_dim; 3: where layers' outputs are in the export; 4: folded too
_NICENESS = 10
_KEPT_PREPARATIONS = 64
_LOCATE_ATOL = 1e-4  # a layer's output and its tensor in the export agree this closely on the probe batch
_CHILD_MODULE = "layerserve.lifecycle.preparer_child"
_STOP_TIMEOUT_S = 10.0
_ABANDONED = "the server is stopping: the preparation was abandoned"
T = TypeVar("T")


class ModelFileChangedError(ModelLoadError):
    """The model file of a serving version is gone or was rewritten: what needs it waits for the reload (503)."""

    status_code = 503


@dataclass(frozen=True)
class ModelSource:
    """A version's model file, its hash when the version was loaded, and whether it may hold code."""

    path: Path
    digest: str
    trust: bool

    def load(self) -> Any:
        """The Keras model, if the file still has the digest it had when the version was loaded.

        Raises:
            ModelFileChangedError: the file is gone, or changed since (its new content loads as a new version).
            ModelLoadError: the file cannot load.
        """
        try:
            unchanged = file_digest(self.path) == self.digest
        except OSError as error:
            raise ModelFileChangedError(
                f"{self.path} is gone ({error.strerror}); this version serves its own outputs only until the "
                "repository is fixed"
            ) from None
        if not unchanged:
            raise ModelFileChangedError(f"{self.path} changed since this version was loaded; it is being reloaded")
        return load_model(self.path, trust=self.trust)


@dataclass(frozen=True)
class Preparation:
    """What serving a model file needs without loading it: signature, layer table, ONNX verdict and where the
    layers' outputs are in the export."""

    signature: Signature
    layers: tuple[LayerInfo, ...]
    layer_count: int
    unavailable_reason: str
    verdict: Verdict
    located: dict[str, TensorPlace]

    def to_dict(self) -> dict[str, Any]:
        """The stored form."""
        return {
            "inputs": [spec.to_dict() for spec in self.signature.inputs],
            "outputs": [spec.to_dict() for spec in self.signature.outputs],
            "layers": [layer.to_record() for layer in self.layers],
            "layer_count": self.layer_count,
            "unavailable_reason": self.unavailable_reason,
            "located": {name: place.to_record() for name, place in self.located.items()},
            **self.verdict.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Preparation:
        """Read the stored form."""
        signature = Signature(
            tuple(TensorSpec.from_dict(s) for s in data["inputs"]),
            tuple(TensorSpec.from_dict(s) for s in data["outputs"]),
        )
        layers = tuple(LayerInfo.from_record(layer) for layer in data["layers"])
        unavailable = str(data["unavailable_reason"])
        located = {str(name): TensorPlace.from_record(place) for name, place in data["located"].items()}
        return cls(signature, layers, int(data["layer_count"]), unavailable, Verdict.from_dict(data), located)


def record_path(cache_file: Path) -> Path:
    """Where the preparation of the graph exported to `cache_file` is kept."""
    return cache_file.with_name(cache_file.name + ".json")


def read_record(cache_file: Path) -> dict[str, Any] | None:
    """The stored record for this export, or None (none, unreadable, another format, export gone)."""
    try:
        data = json.loads(record_path(cache_file).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        return None
    if data.get("max_difference") is not None and not cache_file.exists():
        return None
    return data


def _write_record(cache_file: Path, data: dict[str, Any]) -> None:
    """Keep a record (temporary name, then rename); fail-soft: an unwritable cache only costs time later."""
    target = record_path(cache_file)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(json.dumps({"format": _FORMAT, **data}))
        temporary.replace(target)
    except OSError as error:
        log.warning("cannot keep the preparation record %s: %s", target, error)
        with contextlib.suppress(OSError):  # not only missing: its folder may be a file, or gone
            temporary.unlink()


# --- In the child process -------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)  # the child's last model, kept for its cuts
def _model_and_graph(source: ModelSource) -> tuple[Any, LayerGraph]:
    model = source.load()
    return model, LayerGraph(read_signature(model), model)


def prepare_model(source: ModelSource, cache_file: Path, probe_rows: int) -> dict[str, Any]:
    """(child) Load the model, read its layer table, export and verify; the record, also kept on disk.

    A load failure comes back as {"load_error": ...} and is not kept (the file may be fixed).
    """
    try:
        model, graph = _model_and_graph(source)
    except ModelLoadError as error:
        return {"load_error": error.message}
    inputs = graph.signature.inputs
    probe = probe_batch(inputs, max(2, probe_rows))
    verdict = export_and_verify(model, inputs, cache_file, probe)
    located: dict[str, TensorPlace] = {}
    if verdict.max_difference is not None and not graph.unavailable_reason:
        feed = {graph_name(spec.name): array for spec, array in zip(inputs, probe, strict=True)}
        records = locate_layers(cache_file, feed, graph.layer_values(probe), _LOCATE_ATOL)
        located = {name: TensorPlace.from_record(place) for name, place in records.items()}
    layer_count = len(getattr(model, "layers", []))
    unavailable = graph.unavailable_reason
    data = Preparation(graph.signature, tuple(graph.layers), layer_count, unavailable, verdict, located).to_dict()
    if verdict.lasting:  # else the next load tries again: the disk may be fixed by then
        _write_record(cache_file, data)
    return data


def prepare_cut(
    source: ModelSource, inputs: tuple[str, ...], outputs: tuple[str, ...], cache_file: Path
) -> dict[str, Any]:
    """(child) Export and verify one cut of the model; its verdict, also kept on disk."""
    try:
        _, graph = _model_and_graph(source)
        cut = graph.build_cut(inputs, outputs)
    except ModelLoadError as error:
        return Verdict(None, f"cannot load the model for the export: {error.message}").to_dict()
    specs = tuple(graph.spec(name, "input") for name in inputs)
    verdict = export_and_verify(cut, specs, cache_file, probe_batch(specs, 2))
    if verdict.lasting:
        _write_record(cache_file, verdict.to_dict())
    return verdict.to_dict()


def check_cut(source: ModelSource, inputs: tuple[str, ...], outputs: tuple[str, ...], cut_file: Path) -> dict[str, Any]:
    """(child) Compare a cut taken out of the export (`cut_file`) with the same cut in Keras; the verdict, also kept
    on disk."""
    try:
        _, graph = _model_and_graph(source)
        cut = graph.build_cut(inputs, outputs)
    except ModelLoadError as error:
        return Verdict(None, f"cannot load the model for the check: {error.message}").to_dict()
    specs = tuple(graph.spec(name, "input") for name in inputs)
    probe = probe_batch(specs, 2)
    expected = KerasEngine(cut, specs).run(probe)
    data = Verdict(max_difference(expected, OnnxEngine(cut_file, specs, 1).run(probe))).to_dict()
    _write_record(cut_file, data)
    return data


def lower_priority() -> None:
    """Background work (preparing models, training) yields the CPU to serving: this thread and those it
    starts run only when a core would otherwise idle (SCHED_IDLE; niced where that is not available)."""
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _NICENESS)
        except OSError:  # not permitted here: background work keeps the normal priority
            log.warning("could not lower the priority of %s", threading.current_thread().name)


def exit_with_parent(every_s: float = 1.0) -> None:
    """A child process (the preparer, a training job) dies with the server that started it, instead of living
    on as an orphan holding gigabytes of TensorFlow: a daemon thread exits the process once its parent is gone.

    (Not PR_SET_PDEATHSIG: it fires when the *thread* that started the child ends, and children are started from
    threads that come and go.)"""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


# --- In the server process ------------------------------------------------------------------------------


class Preparer:
    """Runs preparations in one child process, started on demand and stopped once `idle_s` passed without work and
    without a `held` stretch (0: as soon as none is pending)."""

    def __init__(self, idle_s: float = 60.0) -> None:
        self._idle_s = idle_s
        self._child: ChildProcess | None = None
        self._reading: ChildProcess | None = None  # the child whose answer a job waits for
        self._busy = 0  # jobs running or waiting, and `held` stretches
        self._last_work = time.monotonic()
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._turn = threading.Lock()  # one job at a time on the child's connection
        self._closed = False
        # Records are immutable per model digest; parsing one holds the GIL for milliseconds per load.
        self._kept: dict[tuple[Path, int, int], Preparation] = {}

    def model(self, source: ModelSource, cache_file: Path, probe_rows: int) -> Preparation:
        """The preparation of a model file: the stored one, else made in the child now.

        Raises:
            ModelLoadError: the file cannot be loaded, or the child died.
        """
        try:
            stat = record_path(cache_file).stat()
            key: tuple[Path, int, int] | None = (cache_file, stat.st_mtime_ns, stat.st_size)
        except OSError:
            key = None
        kept = self._kept.get(key) if key else None
        if kept is not None and (kept.verdict.max_difference is None or cache_file.exists()):
            return kept
        data = read_record(cache_file)
        if data is None or "inputs" not in data:
            data = self._run(prepare_model, source, cache_file, probe_rows)
        if "load_error" in data:
            raise ModelLoadError(data["load_error"])
        preparation = Preparation.from_dict(data)
        if key is not None:
            if len(self._kept) >= _KEPT_PREPARATIONS:
                self._kept.clear()
            self._kept[key] = preparation
        return preparation

    def cut(self, source: ModelSource, inputs: tuple[str, ...], outputs: tuple[str, ...], cache_file: Path) -> Verdict:
        """The verdict on a cut's ONNX export: the stored one, else made in the child now.

        Raises:
            ModelLoadError: the child died.
        """
        return self._verdict(prepare_cut, source, inputs, outputs, onnx_file=cache_file)

    def check_cut(
        self, source: ModelSource, inputs: tuple[str, ...], outputs: tuple[str, ...], cut_file: Path
    ) -> Verdict:
        """The verdict on a cut taken out of the export: the stored one, else made in the child now.

        Raises:
            ModelLoadError: the child died.
        """
        return self._verdict(check_cut, source, inputs, outputs, onnx_file=cut_file)

    def _verdict(self, function: Any, source: ModelSource, *names: tuple[str, ...], onnx_file: Path) -> Verdict:
        data = read_record(onnx_file)
        if data is None:
            data = self._run(function, source, *names, onnx_file)
        return Verdict.from_dict(data)

    def _run(self, function: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
        """`function(*args)` in the child (a function of layerserve's, sent by reference): its result, or its error
        raised here.

        Raises:
            ModelLoadError: the child died, could not start, or was stopped by `close`.
        """
        self._enter()
        try:
            with self._turn:
                child = self._take_child()
                try:
                    child.connection.send((function, args))
                    tag, body = child.connection.recv()
                except (EOFError, OSError):
                    self._forget(child)
                    if self._closed:
                        raise ModelLoadError(_ABANDONED) from None
                    raise ModelLoadError(
                        "the preparation process died (out of memory, or a crash in the exporter)"
                    ) from None
                finally:
                    self._done_reading(child)
        finally:
            self._leave(worked=True)
        if tag == "error":
            raise body
        result: dict[str, Any] = body
        return result

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Keep the child (if one starts) for the whole stretch, however idle it is between jobs: a start's or a
        poll's loads, one after the other, share one child even when `idle_s` is 0."""
        self._enter()
        try:
            yield
        finally:
            self._leave(worked=False)

    def _enter(self) -> None:
        with self._lock:
            self._busy += 1

    def _leave(self, worked: bool) -> None:
        """The end of a job or of a held stretch: once nothing is pending, the child's idle time runs."""
        with self._lock:
            self._busy -= 1
            if worked:
                self._last_work = time.monotonic()
            if self._busy == 0 and self._child is not None and self._timer is None and not self._closed:
                self._start_timer(max(0.0, self._last_work + self._idle_s - time.monotonic()))

    def _start_timer(self, delay_s: float) -> None:
        """Check for idleness in `delay_s` (the caller holds the lock)."""
        self._timer = threading.Timer(delay_s, self._stop_if_idle)
        self._timer.daemon = True
        self._timer.start()

    def _take_child(self) -> ChildProcess:
        """The running child, else a new one; marked as read by the caller until `_done_reading`."""
        with self._lock:
            if self._closed:
                raise ModelLoadError(_ABANDONED)
            if self._child is None:
                try:
                    self._child = ChildProcess(_CHILD_MODULE)
                except OSError as error:
                    raise ModelLoadError(f"could not start the preparation process: {error}") from None
            self._reading = self._child
            return self._child

    def _done_reading(self, child: ChildProcess) -> None:
        """The caller no longer reads the child's connection: closed if the child was stopped meanwhile."""
        with self._lock:
            self._reading = None
            stopped = child is not self._child
        if stopped:
            child.connection.close()

    def _forget(self, child: ChildProcess) -> None:
        """The child died: reap it; the next job starts a new one."""
        with self._lock:
            if self._child is child:
                self._child = None
        child.kill()
        child.wait(_STOP_TIMEOUT_S)

    def _stop_if_idle(self) -> None:
        with self._lock:
            self._timer = None
            if self._busy or self._child is None or self._closed:
                return  # the last job or held stretch to end starts the idle time again
            left_s = self._last_work + self._idle_s - time.monotonic()
            if left_s > 0:  # a job ran since this timer started
                self._start_timer(left_s)
                return
            child, self._child = self._child, None
        child.connection.close()  # no job reads it: the child reads the end of its input and exits
        if child.wait(_STOP_TIMEOUT_S) is None:
            child.kill()
            child.wait(_STOP_TIMEOUT_S)

    def close(self) -> None:
        """Stop the child now, abandoning the job it runs, if any (its caller gets a ModelLoadError): a server that
        is stopping must not wait for an export, which can take minutes. What the job wrote is whole or absent
        (files are written under a temporary name, then renamed), so the next start prepares it again. Jobs asked
        for afterwards get a ModelLoadError."""
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
            child, self._child = self._child, None
            read = child is not None and self._reading is child
        if child is None:
            return
        child.terminate()
        if child.wait(_STOP_TIMEOUT_S) is None:
            child.kill()
            child.wait(_STOP_TIMEOUT_S)
        if not read:  # else the job that waits for its answer reads the end of it, and closes it
            child.connection.close()
