"""create_app(runtime): the HTTP transport: routes, middleware, the lifespan that starts the runtime, error handlers."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import State
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp

from layerserve.errors import LayerserveError
from layerserve.gpu import apply_settings
from layerserve.lifecycle.worker_board import FOLDER_VARIABLE, WorkerBoard
from layerserve.logs import configure_logging
from layerserve.runtime import Runtime
from layerserve.settings import Settings
from layerserve.transports.grpc.server import GrpcDoor
from layerserve.transports.grpc.servicer import ServingState
from layerserve.transports.http import (
    console_routes,
    image_routes,
    job_routes,
    layer_routes,
    metrics_routes,
    openapi,
    overview,
    repository_routes,
    tfserving_routes,
    triton_routes,
    v2_routes,
)
from layerserve.transports.http.bodies import JSONResponse, error_response
from layerserve.transports.http.boundary import RequestBoundary
from layerserve.transports.http.direct_lane import DirectLane
from layerserve.transports.http.middleware import AuthMiddleware, CompressMiddleware
from layerserve.transports.http.model_lane import ModelLane
from layerserve.transports.http.services import HttpServices

log = logging.getLogger(__name__)

SETTINGS_VARIABLE = "LAYERSERVE_WORKER_SETTINGS"  # the settings of worker processes, as JSON


async def _layerserve_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, LayerserveError)
    return error_response(request, error)


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    message = error.detail
    if error.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif error.status_code == 405:
        allowed = (error.headers or {}).get("Allow", "")
        message = f"method {request.method} is not allowed on {request.url.path}; allowed: {allowed}"
        if request.method == "POST" and request.url.path.startswith("/v1/models/"):  # a verb missing or mistyped
            message += " (TF Serving's POST routes end in :predict, :classify or :regress)"
    return JSONResponse({"error": message}, status_code=error.status_code, headers=error.headers)


def _turn_unready_on_sigterm(draining: threading.Event) -> None:
    """Wrap the server's SIGTERM handler so that readiness turns false as soon as shutdown begins (uvicorn
    then stops accepting connections and lets requests in flight finish)."""
    if threading.current_thread() is not threading.main_thread():
        return  # embedded in a thread (tests): only the main thread may set signal handlers
    previous = signal.getsignal(signal.SIGTERM)

    def handle(number: int, frame: FrameType | None) -> None:
        draining.set()
        if callable(previous):
            previous(number, frame)

    signal.signal(signal.SIGTERM, handle)


def _middleware(settings: Settings) -> list[Middleware]:
    """Outermost first: the request boundary (metrics and access log, cancelling requests whose client left,
    unexpected errors), tokens, compression, and the lane of a model's infer, classify and features requests past the
    router."""
    middleware = [Middleware(RequestBoundary, log_requests=settings.access_log)]
    if settings.admin_token or settings.api_token:
        middleware.append(Middleware(AuthMiddleware, admin_token=settings.admin_token, api_token=settings.api_token))
    if settings.compress_min_bytes:
        middleware.append(Middleware(CompressMiddleware, minimum_size=settings.compress_min_bytes, compresslevel=1))
    middleware.append(Middleware(ModelLane))
    return middleware


@asynccontextmanager
async def _grpc_door(runtime: Runtime) -> AsyncIterator[None]:
    """The gRPC door over the same runtime while the app serves (off when `grpc_port` is 0); it stops with a
    grace of `shutdown_timeout_s` for the calls in flight."""
    settings = runtime.settings
    if not settings.grpc_port:
        yield
        return
    state = ServingState(runtime.data, runtime.control, lambda: runtime.is_ready, settings.max_body_bytes)
    door = GrpcDoor(settings, state, runtime.wait_settled)
    await door.start()
    try:
        yield
    finally:
        await door.stop(settings.shutdown_timeout_s)


class AppState(State):
    """Starlette's app state, whose attributes the normal lookup finds: Starlette's `State` finds them in its
    `__getattr__`, which runs only after the normal lookup has failed and built an `AttributeError` (two of them
    on every infer request)."""

    def __setattr__(self, key: str, value: Any) -> None:
        super().__setattr__(key, value)
        object.__setattr__(self, key, value)

    def __delattr__(self, key: str) -> None:
        super().__delattr__(key)
        object.__delattr__(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        setattr(self, key, value)

    def __delitem__(self, key: str) -> None:
        delattr(self, key)


class LayerserveApp(Starlette):
    """Starlette without its outermost ServerErrorMiddleware: RequestBoundary is the one boundary of unexpected
    errors, so Starlette's (which re-raises after answering) would only add a frame to every request. Its
    `state` is an `AppState`."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.state = AppState()

    def build_middleware_stack(self) -> ASGIApp:
        """Starlette's middleware stack less its first layer."""
        stack = super().build_middleware_stack()
        assert isinstance(stack, ServerErrorMiddleware), "Starlette's outermost middleware changed"
        return stack.app


def app_from_environment() -> Starlette:
    """The app of one worker process of `layerserve serve --workers N` (settings passed as JSON)."""
    settings = Settings.model_validate_json(os.environ[SETTINGS_VARIABLE])
    configure_logging(settings.log_level, settings.log_format, settings.log_file)
    apply_settings(settings)
    return create_app(Runtime(settings, WorkerBoard(Path(os.environ[FOLDER_VARIABLE]), settings.workers)))


def create_app(runtime: Runtime) -> Starlette:
    """The ASGI app over `runtime`: its lifespan starts and closes the runtime.

    Alone, the server answers at once and turns ready once its models have settled. As one of several workers
    (a runtime with a board), it accepts connections only once its own models have settled (uvicorn accepts
    once the lifespan has started), so that no request reaches a worker still loading, and it is ready once
    every worker is.
    """

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        _turn_unready_on_sigterm(runtime.draining)
        await runtime.start()
        try:
            async with _grpc_door(runtime):
                yield
        finally:
            await runtime.close()

    app = LayerserveApp(
        routes=[
            *v2_routes.infer_routes,
            *triton_routes.routes,  # first: `/v2/models/stats` before `/v2/models/{model}`
            *v2_routes.routes,
            *repository_routes.routes,
            *layer_routes.routes,
            *image_routes.routes,
            *job_routes.routes,
            *tfserving_routes.routes,
            *metrics_routes.routes,
            *overview.routes,
            *openapi.routes,
            *console_routes.routes,
        ],
        lifespan=lifespan,
        middleware=_middleware(runtime.settings),
        exception_handlers={
            LayerserveError: _layerserve_error,
            HTTPException: _http_error,
        },
    )
    app.state.runtime = runtime
    app.state.services = HttpServices(
        runtime.data, runtime.control, runtime.settings, lambda: runtime.is_ready, runtime.readiness,
        runtime.exposition, runtime.jobs,
    )  # fmt: skip
    app.state.direct_lane = DirectLane(app, runtime.settings)  # a model's requests, from the server's protocol
    return app
