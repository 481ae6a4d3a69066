"""create_app(settings): wiring, lifespan (load models in the background), and one error handler."""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import signal
import sqlite3
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from types import FrameType

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response

from layerserve.cache import CacheBackend, FeatureCache, InProcessBackend, RedisBackend, wait_closed
from layerserve.errors import LayerserveError
from layerserve.feature_store import FeatureStore
from layerserve.gpu import apply_settings
from layerserve.grpc.server import GrpcDoor
from layerserve.grpc.servicer import ServingState
from layerserve.http import (
    image_routes,
    job_routes,
    layer_routes,
    metrics_routes,
    openapi,
    repository_routes,
    tfserving_routes,
    triton_routes,
    v2_routes,
)
from layerserve.http.bodies import JSONResponse
from layerserve.http.disconnect import CancelOnDisconnectMiddleware
from layerserve.http.middleware import (
    AuthMiddleware,
    CompressMiddleware,
    InternalErrorMiddleware,
    ObserveMiddleware,
    log_internal_error,
)
from layerserve.images import ImageDecoder
from layerserve.job_store import Job
from layerserve.jobs import JobRunner, OnVersion
from layerserve.logs import configure_logging
from layerserve.metrics import sample_process
from layerserve.registry import ModelRegistry
from layerserve.reloader import Reloader
from layerserve.settings import Settings
from layerserve.worker_board import FOLDER_VARIABLE, WorkerBoard

log = logging.getLogger(__name__)

SETTINGS_VARIABLE = "LAYERSERVE_WORKER_SETTINGS"  # the settings of worker processes, as JSON


async def _layerserve_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, LayerserveError)
    if error.status_code == 500:  # ours, but not the client's fault: a bug, answered like any other
        return JSONResponse({"error": log_internal_error(request.scope, error)}, status_code=500)
    headers = {"Retry-After": "1"} if error.status_code == 503 else None
    return JSONResponse({"error": error.message}, status_code=error.status_code, headers=headers)


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    message = error.detail
    if error.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif error.status_code == 405:
        allowed = (error.headers or {}).get("Allow", "")
        message = f"method {request.method} is not allowed on {request.url.path}; allowed: {allowed}"
    return JSONResponse({"error": message}, status_code=error.status_code, headers=error.headers)


def _open_jobs(settings: Settings, on_version: OnVersion) -> tuple[JobRunner | None, str]:
    """The job runner, or None and why (fail-soft: serving goes on without training jobs)."""
    try:
        runner = JobRunner(settings.job_records_dir, settings.training_threads, settings.model_repository, on_version)
    except (OSError, sqlite3.Error) as error:
        reason = f"training jobs are unavailable: {settings.job_records_dir}: {error}"
        log.error("%s", reason)
        return None, reason
    return runner, ""


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


async def _sample_process_forever(every_s: float = 1.0, gpu_every: int = 5) -> None:
    """Keep this process's CPU and memory gauges (and, less often, GPU memory) fresh; with several workers
    /metrics sums every worker's last sample."""
    for count in itertools.count():
        await asyncio.to_thread(sample_process, count % gpu_every == 0)
        await asyncio.sleep(every_s)


def _middleware(settings: Settings) -> list[Middleware]:
    """Outermost first: metrics and access log, cancelling requests whose client left, the boundary of unexpected
    errors, tokens, compression."""
    middleware = [
        Middleware(ObserveMiddleware, log_requests=settings.access_log),
        Middleware(CancelOnDisconnectMiddleware),
        Middleware(InternalErrorMiddleware),
    ]
    if settings.admin_token or settings.api_token:
        middleware.append(Middleware(AuthMiddleware, admin_token=settings.admin_token, api_token=settings.api_token))
    if settings.compress_min_bytes:
        middleware.append(Middleware(CompressMiddleware, minimum_size=settings.compress_min_bytes, compresslevel=1))
    return middleware


@asynccontextmanager
async def _grpc_door(settings: Settings, app: Starlette) -> AsyncIterator[None]:
    """The gRPC door over the app's registry while the app serves (off when `grpc_port` is 0); it stops with a
    grace of `shutdown_timeout_s` for the calls in flight."""
    if not settings.grpc_port:
        yield
        return
    state, board = app.state, app.state.board

    def is_ready() -> bool:
        return state.registry.is_ready and not state.draining.is_set() and (board is None or board.is_ready())

    door = GrpcDoor(
        settings, ServingState(state.registry, state.reloader, state.decoder, is_ready, settings.max_body_bytes)
    )
    await door.start()
    try:
        yield
    finally:
        await door.stop(settings.shutdown_timeout_s)


def app_from_environment() -> Starlette:
    """The app of one worker process of `layerserve serve --workers N` (settings passed as JSON)."""
    settings = Settings.model_validate_json(os.environ[SETTINGS_VARIABLE])
    configure_logging(settings.log_level, settings.log_format, settings.log_file)
    apply_settings(settings)
    return create_app(settings, WorkerBoard(Path(os.environ[FOLDER_VARIABLE]), settings.workers))


def create_app(settings: Settings, board: WorkerBoard | None = None) -> Starlette:
    """The ASGI app serving `settings.model_repository`; models load in the background at start-up.

    Alone, the server answers at once and turns ready once its models have settled. As one of several workers
    (`board`), it accepts connections only once its own models have settled, so that no request reaches a
    worker still loading, and it is ready once every worker is.
    """
    cache_backend: CacheBackend = (
        RedisBackend(settings.redis_url, settings.redis_timeout_ms / 1000)
        if settings.redis_url
        else InProcessBackend(settings.cache_max_bytes)
    )
    store_backend = cache_backend if settings.redis_url else InProcessBackend(settings.feature_store_bytes)
    registry = ModelRegistry(settings, FeatureCache(cache_backend, settings.cache_ttl_s, settings.cache_key_prefix))
    decode_pool = ThreadPoolExecutor(settings.decode_threads or os.cpu_count(), thread_name_prefix="image-decoder")

    reloader = Reloader(registry)

    async def keep_in_sync() -> None:
        await reloader.start()
        # TensorFlow and Keras leave millions of long-lived objects; a full garbage collection walks them
        # all (about 0.2 s holding the GIL). Freezing what start-up made keeps collections short after.
        gc.collect()
        gc.freeze()
        if settings.reload_interval_s > 0:
            await reloader.run(settings.reload_interval_s)

    async def serve_new_version(job: Job) -> None:
        assert job.version is not None
        if job.apply:
            await reloader.apply(job.model, job.version)
        else:
            await reloader.load_model(job.model)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        _turn_unready_on_sigterm(app.state.draining)
        syncing = asyncio.create_task(keep_in_sync())
        sampling = asyncio.create_task(_sample_process_forever())
        app.state.jobs, app.state.jobs_error = _open_jobs(settings, serve_new_version)
        if board is not None:  # uvicorn starts accepting connections once the lifespan has started
            await registry.wait_settled()
            board.mark_ready()
        try:
            async with _grpc_door(settings, app):
                yield
        finally:
            if board is not None:
                board.withdraw()
            if app.state.jobs is not None:
                await app.state.jobs.close()
            syncing.cancel()
            sampling.cancel()
            await asyncio.gather(syncing, sampling, return_exceptions=True)
            registry.close()
            decode_pool.shutdown(wait=False, cancel_futures=True)
            await wait_closed(cache_backend)

    middleware = _middleware(settings)
    app = Starlette(
        routes=[
            *triton_routes.routes,  # first: `/v2/models/stats` before `/v2/models/{model}`
            *v2_routes.routes,
            *repository_routes.routes,
            *layer_routes.routes,
            *image_routes.routes,
            *job_routes.routes,
            *tfserving_routes.routes,
            *metrics_routes.routes,
            *openapi.routes,
        ],
        lifespan=lifespan,
        middleware=middleware,
        exception_handlers={
            LayerserveError: _layerserve_error,
            HTTPException: _http_error,
        },
    )
    app.state.settings = settings
    app.state.draining = threading.Event()
    app.state.registry = registry
    app.state.board = board
    app.state.reloader = reloader
    app.state.decoder = ImageDecoder(decode_pool, settings.max_image_pixels)
    app.state.features = FeatureStore(store_backend, settings.cache_key_prefix)
    return app
