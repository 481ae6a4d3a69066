"""Scan a model repository: <repo>/<model>/<version>/ folders and each model's config.yaml."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from layerserve.errors import ConfigError
from layerserve.settings import ModelConfig, read_model_config

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"


@dataclass(frozen=True)
class ModelSpec:
    """One model folder: its config (or why it is invalid) and the version folders its policy selects."""

    name: str
    path: Path
    config: ModelConfig
    versions: dict[int, Path] = field(default_factory=dict)
    error: str = ""


def _version_folders(model_dir: Path) -> dict[int, Path]:
    versions: dict[int, Path] = {}
    for child in sorted(model_dir.iterdir()):
        if not child.is_dir() or child.name.startswith("."):
            continue
        if child.name.isdigit() and int(child.name) > 0:
            versions[int(child.name)] = child
        else:
            log.info("ignoring %s: version folders are positive integers", child)
    return versions


def scan(repository: Path) -> list[ModelSpec]:
    """Every model folder of the repository, sorted by name; an invalid config makes a spec with `error`.

    Raises:
        ConfigError: the repository folder does not exist.
    """
    if not repository.is_dir():
        raise ConfigError(f"model repository {repository} is not a folder")
    specs = []
    for model_dir in sorted(p for p in repository.iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            config = read_model_config(model_dir / CONFIG_FILE)
        except ConfigError as error:
            log.error("model %s: %s", model_dir.name, error.message)
            specs.append(ModelSpec(model_dir.name, model_dir, ModelConfig(), error=error.message))
            continue
        present = _version_folders(model_dir)
        selected = config.version_policy.select(list(present))
        specs.append(ModelSpec(model_dir.name, model_dir, config, {v: present[v] for v in selected}))
        if not present:
            log.warning("model %s has no version folders", model_dir.name)
    return specs
