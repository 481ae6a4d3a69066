"""build: Ray Serve's application builder, for `serve deploy` config files and KubeRay's RayService.

    applications:
      - name: layerserve
        import_path: layerserve.transports.ray.app:build
        args: {model_repository: /models, redis_url: "redis://redis:6379/0", replicas: 4, replica_cpus: 2}

`args` holds RayOptions' fields and any setting of `serve`; settings also come from LAYERSERVE_* variables.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from layerserve.errors import ConfigError
from layerserve.settings import Settings, load_settings
from layerserve.transports.ray.deployment import RayOptions, build_app

_OPTIONS: dict[str, type[int] | type[float]] = {
    "replicas": int, "replica_cpus": float, "replica_gpus": float, "max_ongoing_requests": int,
    "max_replicas_per_node": int, "job_cpus": float,
}  # fmt: skip


def build(args: dict[str, Any]) -> Any:
    """The application for `args` (see the module docstring).

    Raises:
        ConfigError: a key that is neither an option nor a setting, or a value that does not fit.
    """
    unknown = sorted(set(args) - set(_OPTIONS) - set(Settings.model_fields))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)}: give RayOptions' fields or settings of serve")
    try:
        given: dict[str, Any] = {key: _OPTIONS[key](value) for key, value in args.items() if key in _OPTIONS}
        options = dataclasses.replace(RayOptions(), **given)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"a Ray option does not fit: {error}") from None
    settings = load_settings({k: v for k, v in args.items() if k in Settings.model_fields})
    return build_app(settings, options)
