"""layerserve: serve Keras models over standard protocols, with any layer's output on request."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from layerserve.settings import Settings
    from layerserve.transports.http.app import create_app


def __getattr__(name: str) -> Any:
    # Lazy, so that `layerserve --help` does not import the web stack.
    if name == "create_app":
        from layerserve.transports.http.app import create_app

        return create_app
    if name == "Settings":
        from layerserve.settings import Settings

        return Settings
    raise AttributeError(name)


__all__ = ["Settings", "__version__", "create_app"]
