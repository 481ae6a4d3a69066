"""Management routes: the Triton repository extension (index, load, unload) and apply (by version or label)/unpin."""

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
    """POST /v2/models/{model}/versions/{version}/apply pins a version, POST /v2/models/{model}/labels/{label}/apply
    (or /v2/models/{model}/apply with {"label": "<label>"}) the version a label names; POST /v2/models/{model}/apply
    with {"version": "latest"} unpins. Each answers once the active version is in place."""
    name, number, reloader = request.path_params["model"], parse_version(request), _reloader(request)
    if number is not None:
        version = await reloader.apply(name, number)
    else:
        label = request.path_params.get("label") or await _label_or_unpin(request)
        if label is None:
            entry = await reloader.unpin(name)
            return JSONResponse({"name": name, "active_version": str(entry.active_version or ""), "pinned": False})
        version = await reloader.apply_label(name, label)
    return JSONResponse({"name": name, "active_version": str(version.version), "pinned": True})


async def _label_or_unpin(request: Request) -> str | None:
    """The body of POST /v2/models/{model}/apply: `{"label": "<label>"}` (returned), or `{"version": "latest"}` (None).

    Raises:
        BadRequestError: any other body.
    """
    body = load_json_object(await read_body(request, 4096) or b"{}", "the request body")
    if set(body) == {"label"} and isinstance(body["label"], str):
        return body["label"]
    if body == {"version": "latest"}:
        return None
    raise BadRequestError(
        'send {"version": "latest"} to unpin, or {"label": "<label>"} to pin the version a label names; '
        "to pin a version, POST .../versions/{v}/apply"
    )


routes = [
    Route("/v2/repository/index", index, methods=["POST"]),
    Route("/v2/repository/models/{model}/load", load, methods=["POST"]),
    Route("/v2/repository/models/{model}/unload", unload, methods=["POST"]),
    Route("/v2/models/{model}/apply", apply, methods=["POST"]),
    Route("/v2/models/{model}/versions/{version}/apply", apply, methods=["POST"]),
    Route("/v2/models/{model}/labels/{label}/apply", apply, methods=["POST"]),
]
