"""build: Ray Serve's application builder, for `serve deploy` config files and KubeRay's RayService.

    applications:
      - name: layerserve
        import_path: layerserve.transports.ray.app:build
        args: {model_repository: /models, redis_url: "redis://redis:6379/0", replicas: 4, replica_cpus: 2}

`args` holds RayOptions' fields (groups too, as in a config file's `ray:` section) and any setting of `serve`;
settings also come from LAYERSERVE_* variables.
"""

from __future__ import annotations

from typing import Any

from layerserve.errors import ConfigError
from layerserve.settings import Settings, load_settings
from layerserve.transports.ray.deployment import build_app
from layerserve.transports.ray.options import RayOptions, ray_options


def build(args: dict[str, Any]) -> Any:
    """The application for `args` (see the module docstring).

    Raises:
        ConfigError: a key that is neither an option nor a setting, or a value that does not fit.
    """
    unknown = sorted(set(args) - set(RayOptions.model_fields) - set(Settings.model_fields))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)}: give RayOptions' fields or settings of serve")
    options = ray_options({k: v for k, v in args.items() if k in RayOptions.model_fields})
    settings = load_settings({k: v for k, v in args.items() if k in Settings.model_fields})
    return build_app(settings, options)
