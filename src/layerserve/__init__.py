"""layerserve: serve Keras models over standard protocols, with any layer's output on request.

`layerserve.server.Server` is a whole server in Python; `layerserve.blocking.BlockingRuntime` serves models to
synchronous code (see docs/python-api.md).
"""

from __future__ import annotations

__version__ = "0.1.0"
