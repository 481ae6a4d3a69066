"""Management routes: the Triton repository extension (index, load, unload) and apply (by version or label)/unpin."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from layerserve.errors import BadRequestError
from layerserve.protocols import v2
from layerserve.protocols.v2 import load_json_object
from layerserve.transports.http.bodies import JSONResponse, read_body
from layerserve.transports.http.services import services
from layerserve.transports.http.v2_routes import parse_version

_MAX_LOAD_BYTES = 1024 * 1024


async def index(request: Request) -> Response:
    """POST /v2/repository/index: every version with its state and reason."""
    return JSONResponse(v2.index_json(services(request).data.index()))


async def load(request: Request) -> Response:
    """POST /v2/repository/models/{model}/load: (re)load from the repository, with `parameters.config`
    replacing config.yaml keys; answers once settled."""
    config = v2.parse_load_request(await read_body(request, _MAX_LOAD_BYTES))
    name = request.path_params["model"]
    versions = await services(request).control.load(name, config)
    return JSONResponse({"name": name, "versions": [str(v) for v in versions]})


async def unload(request: Request) -> Response:
    """POST /v2/repository/models/{model}/unload: unload every version (they finish their requests first)."""
    await services(request).control.unload(request.path_params["model"])
    return JSONResponse({"name": request.path_params["model"], "versions": []})


async def apply(request: Request) -> Response:
    """POST /v2/models/{model}/versions/{version}/apply pins a version, POST /v2/models/{model}/labels/{label}/apply
    (or /v2/models/{model}/apply with {"label": "<label>"}) the version a label names; POST /v2/models/{model}/apply
    with {"version": "latest"} unpins. Each answers once the active version is in place."""
    name, number = request.path_params["model"], parse_version(request)
    label = None if number is not None else request.path_params.get("label") or await _label_or_unpin(request)
    active = await services(request).control.apply(name, number, label)
    pinned = number is not None or label is not None
    return JSONResponse({"name": name, "active_version": str(active or ""), "pinned": pinned})


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
