"""InferLane: V2 infer requests straight to their route, past Starlette's router and exception middleware.

Every request of a model takes `POST /v2/models/{model}[/versions/{version}]/infer`; for a fast model, what the
router (a regular expression per route, in order), `request_response` and the exception middleware cost is a
good part of the server's time per request. The lane sits inside the other middleware (metrics, access log,
cancellation, errors, tokens, compression), so that only the routing differs: it calls the same route function
and answers its errors with the same handler. The route stays in the router (OpenAPI, and any path the lane
does not take).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from layerserve.errors import LayerserveError
from layerserve.transports.http.bodies import error_response
from layerserve.transports.http.v2_routes import infer

_PREFIX, _SUFFIX = "/v2/models/", "/infer"


def infer_path_params(path: str) -> dict[str, str] | None:
    """`{"model": m}` or `{"model": m, "version": v}` for an infer path, else None (as the routes match them)."""
    if not (path.startswith(_PREFIX) and path.endswith(_SUFFIX)):
        return None
    parts = path[len(_PREFIX) : -len(_SUFFIX)].split("/")
    if len(parts) == 1 and parts[0]:
        return {"model": parts[0]}
    if len(parts) == 3 and parts[0] and parts[1] == "versions" and parts[2]:
        return {"model": parts[0], "version": parts[2]}
    return None


class InferLane:
    """Takes `POST` infer requests to the infer route directly; passes every other request on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer an infer request, or pass the request on."""
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        path, root = scope["path"], scope.get("root_path", "")
        params = infer_path_params(path[len(root) :] if root and path.startswith(root) else path)
        if params is None:
            await self.app(scope, receive, send)
            return
        scope["path_params"], scope["endpoint"] = params, infer
        request = Request(scope, receive, send)
        try:
            response = await infer(request)
        except LayerserveError as error:
            response = error_response(request, error)
        await response(scope, receive, send)
