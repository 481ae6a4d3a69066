"""Management routes: the Triton repository extension (index, load, unload) and apply (by version or label)/unpin."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from layerserve.errors import BadRequestError
from layerserve.lifecycle.reloader import Reloader
from layerserve.protocols.v2 import load_json_object
from layerserve.serving.registry import ModelRegistry
from layerserve.transports.http.bodies import JSONResponse, read_body
from layerserve.transports.http.v2_routes import parse_version

_MAX_LOAD_BYTES = 1024 * 1024


def _reloader(request: Request) -> Reloader:
    reloader: Reloader = request.app.state.runtime.reloader
    return reloader


async def index(request: Request) -> Response:
    """POST /v2/repository/index: every version with its state and reason."""
    registry: ModelRegistry = request.app.state.runtime.registry
    return JSONResponse(registry.index())


def load_config(body: bytes) -> dict[str, Any] | None:
    """The config of a Triton load request `{"parameters": {"config": "<JSON object>"}}`, if it has one.

    Raises:
        BadRequestError: not that shape, or another parameter (such as Triton's `file:` overrides).
    """
    parameters = load_json_object(body or b"{}", "the request body").get("parameters") or {}
    if not isinstance(parameters, dict):
        raise BadRequestError("the load request's parameters must be an object")
    unknown = [key for key in parameters if key != "config"]
    if unknown:
        raise BadRequestError(f"load parameter '{unknown[0]}' is not supported; the only parameter is 'config'")
    config = parameters.get("config")
    if config is None or isinstance(config, dict):
        return config
    if not isinstance(config, str):
        raise BadRequestError("load parameter 'config' must be a JSON object, or a string holding one")
    return load_json_object(config.encode(), "load parameter 'config'")


async def load(request: Request) -> Response:
    """POST /v2/repository/models/{model}/load: (re)load from the repository, with `parameters.config`
    replacing config.yaml keys; answers once settled."""
    config = load_config(await read_body(request, _MAX_LOAD_BYTES))
    entry = await _reloader(request).load_model(request.path_params["model"], config)
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
