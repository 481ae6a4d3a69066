"""Which engine a version runs on: the verified ONNX export (in this process or an engine process), else Keras."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from layerserve.engines.base import Engine, EngineChoice, EngineKind, Verdict
from layerserve.engines.onnx import OnnxEngine
from layerserve.engines.process.engine import ProcessOnnxEngine
from layerserve.engines.process.pool import EngineProcessPool
from layerserve.errors import ModelLoadError
from layerserve.tensors import TensorSpec

log = logging.getLogger(__name__)


def open_onnx(
    path: Path, inputs: tuple[TensorSpec, ...], threads: int, processes: EngineProcessPool | None, warmup_rows: int
) -> Engine:
    """A session over the graph at `path`: in an engine process of `processes`, warmed up there with
    `warmup_rows`, when the pool takes a graph of that size; else in this process."""
    if processes is not None and processes.takes(path):
        return ProcessOnnxEngine(processes, path, inputs, threads, warmup_rows)
    return OnnxEngine(path, inputs, threads)


def onnx_refusal(verdict: Verdict, atol: float) -> str:
    """Why the verified export may not serve (its error, or a difference from Keras over `atol`); "" when it may."""
    difference = verdict.max_difference
    if difference is not None and difference <= atol:
        return ""
    return verdict.error or f"ONNX verification failed: max difference {difference:.2e} > {atol:.0e}"


def choose_engine(
    verdict: Verdict,
    choice: str,
    cache_file: Path,
    inputs: tuple[TensorSpec, ...],
    atol: float,
    threads: int,
    keras_engine: Callable[[], Engine],
    processes: EngineProcessPool | None = None,
    warmup_rows: int = 1,
) -> EngineChoice:
    """The engine per `choice` (auto/onnx/keras): the verified ONNX export (see `open_onnx` for where it
    runs), else `keras_engine()`.

    Raises:
        ModelLoadError: `choice` is onnx and the export failed or differs from Keras by more than `atol`.
    """
    kind = EngineKind(choice)
    if kind is EngineKind.KERAS:
        return EngineChoice(keras_engine(), "engine=keras was requested")
    reason = onnx_refusal(verdict, atol)
    if not reason:
        engine = open_onnx(cache_file, inputs, threads, processes, warmup_rows)
        where = "" if engine.in_process else f"; runs in engine process {getattr(engine, 'pid', '?')}"
        return EngineChoice(engine, f"ONNX verified against Keras: max difference {verdict.max_difference:.2e}{where}")
    if kind is EngineKind.ONNX:
        raise ModelLoadError(reason)
    log.warning("%s; serving with the Keras compiled call", reason)
    return EngineChoice(keras_engine(), reason + "; serving with the Keras compiled call")
