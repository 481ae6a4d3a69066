"""Filling the export cache ahead of a server's start (`layerserve export`, in an image build or an init container).

Each version a server would load is prepared as its first load prepares it: in the preparer's child process, keyed
by the model file's hash, with the model's warm-up batch as the probe (see lifecycle/prepare.py). A server started
later on the same `engine_cache_dir` reads those records and opens ONNX Runtime sessions: no export, no preparer
child, no TensorFlow at its start.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from layerserve.engines.base import cache_problem, onnx_cache_path
from layerserve.engines.choice import onnx_refusal
from layerserve.errors import ConfigError, ModelLoadError
from layerserve.lifecycle.model import file_digest, find_model_file
from layerserve.lifecycle.prepare import ModelSource, Preparer, read_record
from layerserve.lifecycle.repository import ModelSpec, model_folders, scan_model
from layerserve.settings import ModelConfig, Settings

State = Literal["exported", "cached", "keras", "skipped", "failed"]
STATES: tuple[State, ...] = ("exported", "cached", "keras", "skipped", "failed")


@dataclass(frozen=True)
class Outcome:
    """What became of one version (or of a model folder without versions)."""

    model: str
    version: int | None
    state: State
    detail: str

    def line(self) -> str:
        """One line of the command's report."""
        where = self.model if self.version is None else f"{self.model} version {self.version}"
        word = {"keras": "on Keras", "failed": "FAILED"}.get(self.state, self.state)
        return f"{where}: {word}: {self.detail}"


def export_repository(settings: Settings, report: Callable[[Outcome], None]) -> list[Outcome]:
    """Prepare every version that a server with these settings loads at start; `report` gets each outcome as it
    comes.

    Raises:
        ConfigError: the repository is not a folder, or the export cache cannot be written.
    """
    problem = cache_problem(settings.engine_cache_dir)
    if problem:
        raise ConfigError(
            f"the engine cache {settings.engine_cache_dir} cannot be written ({problem}): set --engine-cache-dir "
            "(engine_cache_dir) to a writable folder, the one the server will use"
        )
    folders = [folder for folder in model_folders(settings.model_repository) if settings.serves_model(folder.name)]
    outcomes: list[Outcome] = []
    preparer = Preparer(idle_s=0)
    try:
        with preparer.held():  # one child for every model
            for folder in folders:
                for outcome in _export_model(scan_model(folder), settings, preparer):
                    report(outcome)
                    outcomes.append(outcome)
    finally:
        preparer.close()
    return outcomes


def summary(outcomes: list[Outcome], settings: Settings) -> str:
    """The report's last line: models, versions, and how many of them each state has."""
    models = len({outcome.model for outcome in outcomes})
    versions = sum(1 for outcome in outcomes if outcome.version is not None)
    counts = ", ".join(
        f"{sum(1 for o in outcomes if o.state == state)} {'on Keras' if state == 'keras' else state}"
        for state in STATES
    )
    return f"{models} models, {versions} versions into {settings.engine_cache_dir}: {counts}"


def _export_model(spec: ModelSpec, settings: Settings, preparer: Preparer) -> list[Outcome]:
    if spec.error:
        return [Outcome(spec.name, None, "failed", f"invalid config.yaml: {spec.error}")]
    if not spec.versions:
        return [Outcome(spec.name, None, "skipped", "no version folder to serve")]
    if spec.config.pipeline is not None:
        steps = ", ".join(step.model for step in spec.config.pipeline)
        return [Outcome(spec.name, None, "skipped", f"a pipeline: nothing to export (its steps are {steps})")]
    return [
        _export_version(spec.name, number, path, spec.config, settings, preparer)
        for number, path in spec.versions.items()
    ]


def _export_version(
    name: str, number: int, folder: Path, config: ModelConfig, settings: Settings, preparer: Preparer
) -> Outcome:
    """Prepare one version as `load_version` would (same cache file, same probe rows); its outcome."""
    engine = config.engine or settings.engine
    if engine == "keras":
        return Outcome(name, number, "skipped", "engine: keras, nothing to export (it serves on Keras)")
    started = time.perf_counter()
    try:
        model_file = find_model_file(folder)
        digest = file_digest(model_file)
        cache_file = onnx_cache_path(settings.engine_cache_dir, digest)
        record = read_record(cache_file)
        was_cached = record is not None and "inputs" in record
        verdict = preparer.model(ModelSource(model_file, digest, settings.trust_models), cache_file,
                                 config.warmup_batch_size).verdict  # fmt: skip
    except ModelLoadError as error:
        return Outcome(name, number, "failed", error.message)
    except OSError as error:
        return Outcome(name, number, "failed", f"cannot read {folder}: {error.strerror or error}")
    if read_record(cache_file) is None:
        return Outcome(name, number, "failed", f"its preparation could not be kept in {settings.engine_cache_dir}")
    reason = onnx_refusal(verdict, settings.verify_atol)
    if not reason:
        took = "" if was_cached else f" in {time.perf_counter() - started:.1f} s"
        detail = f"ONNX verified against Keras (max difference {verdict.max_difference:.2e}){took}"
        return Outcome(name, number, "cached" if was_cached else "exported", detail)
    if engine == "onnx":
        return Outcome(name, number, "failed", f"{reason} (with engine: onnx the server fails this version)")
    return Outcome(name, number, "keras", f"{reason}; the server loads it with Keras (TensorFlow in its process)")
