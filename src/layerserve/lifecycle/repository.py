"""Scan a model repository: <repo>/<model>/<version>/ folders and each model's config.yaml."""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layerserve.errors import BadRequestError, ConfigError, LayerserveError, NotReadyError
from layerserve.settings import ModelConfig, read_model_config

log = logging.getLogger(__name__)


def check_model_name(name: str) -> None:
    """A model name is one plain folder name of the repository.

    Raises:
        BadRequestError: empty, hidden, `..`, or holding a path separator or NUL.
    """
    if not name or name.startswith(".") or any(c in name for c in "/\\\0"):
        raise BadRequestError(f"invalid model name {name!r}: expected a folder name of the repository")


CONFIG_FILE = "config.yaml"
PIN_FILE = ".pinned_version"

Fingerprint = tuple[tuple[str, int, int], ...]


class RepositoryWriteError(LayerserveError):
    """The repository could not be written (the pin); nothing was half-written."""

    status_code = 503


class ReadOnlyRepositoryError(RepositoryWriteError):
    """The repository cannot be written at all (a read-only mount, or no permission): a change that writes into it
    (training, apply, unpin) is refused before it starts."""

    status_code = 409


_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def write_problem(folder: Path) -> str:
    """Why no file can be created in `folder` (as the OS says: a read-only mount, no permission); "" when one can.
    A real write, not permission bits or `os.access`: root passes those, and only a write tells what a mount allows."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as error:
        return error.strerror or str(error)
    return ""


def check_writable(folder: Path, change: str) -> None:
    """Refuse `change` (e.g. "train model 'reviews'") when the repository folder it writes into is read-only.

    Raises:
        ReadOnlyRepositoryError: no file can be created in `folder`.
    """
    problem = write_problem(folder)
    if problem:
        raise ReadOnlyRepositoryError(_read_only_message(folder, change, problem))


def _read_only_message(folder: Path, change: str, problem: str) -> str:
    return (
        f"cannot {change}: the model repository folder {folder} cannot be written ({problem}); the server serves a "
        "read-only repository, but changes to it need it mounted read-write (or make the change in a writable copy, "
        "e.g. `layerserve train`, and copy the version folder in)"
    )


@dataclass(frozen=True)
class ModelSpec:
    """One model folder: its config (or why it is invalid), its version folders, the pin, and the
    versions to serve (those its policy selects, plus the pinned one)."""

    name: str
    path: Path
    config: ModelConfig
    versions: dict[int, Path] = field(default_factory=dict)
    error: str = ""
    present: dict[int, Path] = field(default_factory=dict)
    pinned: int | None = None


def _version_folders(model_dir: Path) -> dict[int, Path]:
    versions: dict[int, Path] = {}
    for child in sorted(model_dir.iterdir()):
        if not child.is_dir() or child.name.startswith("."):
            continue
        if (child.name.isascii() and child.name.isdigit()) and int(child.name) > 0:
            versions[int(child.name)] = child
        else:
            log.info("ignoring %s: version folders are positive integers", child)
    return versions


def model_folders(repository: Path) -> list[Path]:
    """The model folders of the repository, sorted by name (hidden folders are skipped).

    Raises:
        ConfigError: the repository folder does not exist.
    """
    if not repository.is_dir():
        raise ConfigError(f"model repository {repository} is not a folder")
    return sorted(p for p in repository.iterdir() if p.is_dir() and not p.name.startswith("."))


def scan_model(model_dir: Path, override: Mapping[str, Any] | None = None) -> ModelSpec:
    """One model folder (with `override` replacing keys of its config.yaml); an invalid config makes a spec
    with `error` and no versions."""
    try:
        config = read_model_config(model_dir / CONFIG_FILE, override)
    except ConfigError as error:
        return ModelSpec(model_dir.name, model_dir, ModelConfig(), error=error.message)
    present = _version_folders(model_dir) if model_dir.is_dir() else {}
    if config.pipeline is not None and not present:
        present = {1: model_dir / "1"}  # a pipeline needs no version folder: it is version 1 of its config.yaml
    pinned = read_pin(model_dir)
    selected = set(config.version_policy.select(list(present)))
    if pinned in present:
        selected.add(pinned)
    return ModelSpec(model_dir.name, model_dir, config, {v: present[v] for v in sorted(selected)}, "", present, pinned)


def label_version(spec: ModelSpec, label: str) -> int:
    """The version a label of the model's `version_labels` names.

    Raises:
        NotFoundError: no such label (the message lists the known ones).
        NotReadyError: the model's config.yaml is invalid, so its labels are unknown.
    """
    if spec.error:
        raise NotReadyError(f"model '{spec.name}' has no version labels while its config.yaml is invalid: {spec.error}")
    return spec.config.version_for_label(spec.name, label)


def scan(repository: Path) -> list[ModelSpec]:
    """Every model folder of the repository, sorted by name.

    Raises:
        ConfigError: the repository folder does not exist.
    """
    specs = [scan_model(model_dir) for model_dir in model_folders(repository)]
    for spec in specs:
        report_problems(spec, None)
    return specs


def report_problems(spec: ModelSpec, previous: ModelSpec | None) -> None:
    """Log what is wrong with a model folder (an invalid config.yaml, no version folders) once: only when it
    differs from what the `previous` scan of the same folder showed, so that polling does not repeat it."""
    name = spec.name
    if spec.error and (previous is None or previous.error != spec.error):
        log.error("model %s: %s", name, spec.error)
    elif not spec.error and previous is not None and previous.error:
        log.info("model %s: its config.yaml is valid again", name)
    if not spec.error and not spec.present and (previous is None or previous.error or previous.present):
        log.warning("model %s has no version folders", name)


def fingerprint(version_dir: Path) -> Fingerprint:
    """Names, sizes and modification times of a version's files and of its model's own files (config,
    labels): a change means the version must be reloaded; equal over one poll means copying is done."""
    model_dir = version_dir.parent
    files = [p for p in model_dir.iterdir() if p.is_file() and p.name != PIN_FILE]
    files += [p for p in version_dir.rglob("*") if p.is_file()]
    rows = []
    for file in sorted(files):
        try:
            stat = file.stat()
        except FileNotFoundError:  # deleted while we looked: the next poll sees the change
            continue
        rows.append((str(file.relative_to(model_dir)), stat.st_size, stat.st_mtime_ns))
    return tuple(rows)


def read_pin(model_dir: Path) -> int | None:
    """The version pinned by apply, if any (an unreadable pin file counts as none, with a log line)."""
    try:
        text = (model_dir / PIN_FILE).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except OSError as error:
        log.error("model %s: cannot read %s: %s", model_dir.name, PIN_FILE, error)
        return None
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        log.error("model %s: ignoring %s holding %r", model_dir.name, PIN_FILE, text[:40])
        return None
    return int(text)


def write_pin(model_dir: Path, version: int | None) -> None:
    """Persist (or clear, with None) the pin atomically: a temporary file renamed over the old one.

    Raises:
        ReadOnlyRepositoryError: the model folder is read-only (409).
        RepositoryWriteError: it could not be written otherwise (503).
    """
    target = model_dir / PIN_FILE
    try:
        if version is None:
            target.unlink(missing_ok=True)
            return
        handle, temporary = tempfile.mkstemp(prefix=".pin-", dir=model_dir)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as file:
                file.write(f"{version}\n")
                file.flush()
                os.fsync(file.fileno())
            Path(temporary).replace(target)
        finally:
            Path(temporary).unlink(missing_ok=True)
    except OSError as error:
        if error.errno in _NOT_WRITABLE:
            change = f"{'unpin' if version is None else 'apply'} a version of model '{model_dir.name}'"
            raise ReadOnlyRepositoryError(_read_only_message(model_dir, change, str(error.strerror))) from None
        raise RepositoryWriteError(f"cannot write the pin of model {model_dir.name}: {error.strerror}") from None
