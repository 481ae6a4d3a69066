"""create_app: the HTTP transport as an ASGI app (Starlette): every route, the request policy's middleware,
compression and the lane, over the services the composition root gives it (see layerserve.server)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import State
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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
from layerserve.transports.http.bodies import JSONResponse
from layerserve.transports.http.compression import CompressMiddleware
from layerserve.transports.http.lane import ModelLane
from layerserve.transports.http.policy_middleware import PolicyMiddleware
from layerserve.transports.http.services import HttpServices
from layerserve.transports.policy import RequestPolicy

Lifespan = Callable[[Starlette], AbstractAsyncContextManager[None]]


async def _http_error(request: Request, error: Exception) -> Response:
    """Starlette's own errors (no route, a method not allowed) as `{"error": ...}` naming what was expected."""
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


class AppState(State):
    """Starlette's app state, whose attributes the normal lookup finds: Starlette's `State` finds them in its
    `__getattr__`, which runs only after the normal lookup has failed and built an `AttributeError` (on every
    request that reads the services)."""

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


class AnswerHeaders:
    """Adds fixed headers to every HTTP answer (a Ray replica's name)."""

    def __init__(self, app: ASGIApp, headers: tuple[tuple[bytes, bytes], ...]) -> None:
        self.app = app
        self._headers = list(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer, with the headers added."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self._headers]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def create_app(
    services: HttpServices, policy: RequestPolicy, lifespan: Lifespan | None = None,
    answer_headers: tuple[tuple[bytes, bytes], ...] = (),
) -> Starlette:  # fmt: skip
    """The ASGI app: every route over `services`, under `policy`; `lifespan` (the composition root's) starts and
    stops the server when a host runs the app's lifespan (a Ray replica)."""
    settings = services.settings
    middleware = [Middleware(PolicyMiddleware, policy=policy)]
    if answer_headers:
        middleware.insert(0, Middleware(AnswerHeaders, headers=answer_headers))
    if settings.compress_min_bytes:
        middleware.append(Middleware(CompressMiddleware, minimum_size=settings.compress_min_bytes))
    middleware.append(Middleware(ModelLane))
    app = Starlette(
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
        middleware=middleware,
        exception_handlers={HTTPException: _http_error},
    )
    app.state = AppState()
    app.state.services = services
    return app
