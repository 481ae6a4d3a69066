"""Management routes: the Triton repository extension (index, load, unload) and apply/unpin."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from layerserve.errors import BadRequestError
from layerserve.http.bodies import JSONResponse, read_body
from layerserve.http.v2_routes import parse_version
from layerserve.protocols.v2 import load_json_object
from layerserve.registry import ModelRegistry
from layerserve.reloader import Reloader


def _reloader(request: Request) -> Reloader:
    reloader: Reloader = request.app.state.reloader
    return reloader


async def index(request: Request) -> Response:
    """POST /v2/repository/index: every version with its state and reason."""
    registry: ModelRegistry = request.app.state.registry
    return JSONResponse(registry.index())


async def load(request: Request) -> Response:
    """POST /v2/repository/models/{model}/load: (re)load from the repository; answers once settled."""
    entry = await _reloader(request).load_model(request.path_params["model"])
    return JSONResponse({"name": entry.spec.name, "versions": [str(v) for v in entry.ready_versions]})


async def unload(request: Request) -> Response:
    """POST /v2/repository/models/{model}/unload: unload every version (they finish their requests first)."""
    await _reloader(request).unload_model(request.path_params["model"])
    return JSONResponse({"name": request.path_params["model"], "versions": []})


async def apply(request: Request) -> Response:
    """POST /v2/models/{model}/versions/{version}/apply pins a version; POST /v2/models/{model}/apply
    with {"version": "latest"} unpins. Both answer once the active version is in place."""
    name, number = request.path_params["model"], parse_version(request)
    if number is None:
        body = load_json_object(await read_body(request, 4096) or b"{}", "the request body")
        if body.get("version") != "latest":
            raise BadRequestError('to unpin, send {"version": "latest"}; to pin, POST .../versions/{v}/apply')
        entry = await _reloader(request).unpin(name)
        return JSONResponse({"name": name, "active_version": str(entry.active_version or ""), "pinned": False})
    version = await _reloader(request).apply(name, number)
    return JSONResponse({"name": name, "active_version": str(version.version), "pinned": True})


routes = [
    Route("/v2/repository/index", index, methods=["POST"]),
    Route("/v2/repository/models/{model}/load", load, methods=["POST"]),
    Route("/v2/repository/models/{model}/unload", unload, methods=["POST"]),
    Route("/v2/models/{model}/apply", apply, methods=["POST"]),
    Route("/v2/models/{model}/versions/{version}/apply", apply, methods=["POST"]),
]
