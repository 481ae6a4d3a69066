"""BlockingRuntime: a Server without doors on an event loop of its own thread, called from synchronous code (a Flask
view)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from layerserve.errors import NotReadyError
from layerserve.messages import (
    ClassifyRequest,
    ClassifyResponse,
    FeaturesRequest,
    FeaturesResponse,
    InferRequest,
    InferResponse,
)
from layerserve.server import Server
from layerserve.settings import Settings

T = TypeVar("T")


class BlockingRuntime:
    """A started Server (no doors: its data plane only) whose calls block until answered; any number of threads may
    call it at once.

    Build one per process (models load once, here); requests from many threads are batched together as the
    server's are. `close()` (or leaving a `with` block) stops it.
    """

    def __init__(self, settings: Settings, ready_timeout_s: float = 600.0) -> None:
        """Start the runtime and return once every model has settled.

        Raises:
            NotReadyError: the models did not settle within `ready_timeout_s`.
        """
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="layerserve-runtime", daemon=True)
        self._thread.start()
        self.server: Server = self._call(self._start(settings), ready_timeout_s)

    async def _start(self, settings: Settings) -> Server:
        server = Server(settings, settle_first=True)
        await server.start()
        return server

    def _call(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise NotReadyError(f"no answer within {timeout_s} s") from None

    def infer(self, request: InferRequest) -> InferResponse:
        """`DataPlane.infer`, blocking."""
        return self._call(self.server.data.infer(request))

    def classify(self, request: ClassifyRequest) -> ClassifyResponse:
        """`DataPlane.classify`, blocking."""
        return self._call(self.server.data.classify(request))

    def features(self, request: FeaturesRequest) -> FeaturesResponse:
        """`DataPlane.features` (a layer's output per image or text), blocking."""
        return self._call(self.server.data.features(request))

    def close(self) -> None:
        """Stop the server and its thread."""
        if self._thread.is_alive():
            self._call(self.server.stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> BlockingRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
