"""A model's POST infer, classify and features requests straight to their route, past Starlette's router and
exception middleware: `lane_target` finds them, `answer` runs the route, and `ModelLane` is the ASGI middleware
that takes them there.

Every request of a model takes `POST /v2/models/{model}[/versions/{version}]/infer` (or `/classify`, `/features`);
for a fast model, what the router (a regular expression per route, in order), `request_response` and the exception
middleware cost is a good part of the server's time per request. The server's own protocol answers these requests
below ASGI (direct_lane.py); `ModelLane` takes them under any other ASGI server (a Ray replica's) and when the direct
lane leaves them to the app (a compressed answer). It sits inside the other middleware (the request boundary,
tokens, compression), so that only the routing differs: it calls the same route function and answers its errors
with the same handler. The routes stay in the router (OpenAPI, and any path the lane does not take).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from layerserve.errors import LayerserveError
from layerserve.transports.http import image_routes, v2_routes
from layerserve.transports.http.bodies import error_response

Endpoint = Callable[[Request], Awaitable[Response]]

_PREFIX = "/v2/models/"
_ENDPOINTS: dict[str, Endpoint] = {
    "infer": v2_routes.infer, "classify": image_routes.classify, "features": image_routes.features,
}  # fmt: skip


def model_route(path: str) -> tuple[str, dict[str, str]] | None:
    """The action (`infer`, `classify` or `features`) and `{"model": m[, "version": v]}` of a model's lane path,
    as the router's routes would match them; else None."""
    if not path.startswith(_PREFIX):
        return None
    parts = path[len(_PREFIX) :].split("/")
    action = parts[-1]
    if action not in _ENDPOINTS:
        return None
    if len(parts) == 2 and parts[0]:
        return action, {"model": parts[0]}
    if len(parts) == 4 and parts[0] and parts[1] == "versions" and parts[2]:
        return action, {"model": parts[0], "version": parts[2]}
    return None


def lane_target(scope: Scope) -> tuple[Endpoint, dict[str, str]] | None:
    """The route function and path parameters of a lane request (a model's POST infer, classify or features);
    else None."""
    if scope["method"] != "POST":
        return None
    path, root = scope["path"], scope.get("root_path", "")
    found = model_route(path[len(root) :] if root and path.startswith(root) else path)
    if found is None:
        return None
    action, params = found
    return _ENDPOINTS[action], params


async def answer(endpoint: Endpoint, request: Request) -> Response:
    """The route's answer, or the answer to its error (as the app's handler of LayerserveError gives it)."""
    try:
        return await endpoint(request)
    except LayerserveError as error:
        return error_response(request, error)


class ModelLane:
    """Takes a model's `POST` infer, classify and features requests to their route directly; passes every other
    request on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer a lane request, or pass the request on."""
        target = lane_target(scope) if scope["type"] == "http" else None
        if target is None:
            await self.app(scope, receive, send)
            return
        endpoint, scope["path_params"] = target
        scope["endpoint"] = endpoint
        response = await answer(endpoint, Request(scope, receive, send))
        await response(scope, receive, send)
