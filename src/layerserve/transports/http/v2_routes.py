"""Open Inference Protocol routes: health, server and model metadata, readiness, infer, repository index."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from layerserve import __version__
from layerserve.protocols import v2
from layerserve.serving.registry import ModelEntry, ModelRegistry, ModelVersion
from layerserve.transports.http.bodies import JSONResponse, read_body

EXTENSIONS = [
    "binary_tensor_data",
    "classification",
    "model_repository",
    "statistics",
    "model_configuration",
    "logging",
    "layer_outputs",
]


def _registry(request: Request) -> ModelRegistry:
    registry: ModelRegistry = request.app.state.runtime.registry
    return registry


def parse_version(request: Request) -> int | None:
    """The `{version}` path parameter as a positive integer, or None where the path has none.

    Raises:
        BadRequestError: the version is not a positive integer.
    """
    raw = request.path_params.get("version")
    return None if raw is None else v2.parse_version_number(raw)


async def server_metadata(request: Request) -> Response:
    """GET /v2."""
    return JSONResponse({"name": "layerserve", "version": __version__, "extensions": EXTENSIONS})


async def live(request: Request) -> Response:
    """GET /v2/health/live."""
    return JSONResponse({"live": True})


async def ready(request: Request) -> Response:
    """GET /v2/health/ready: 200 once every model has settled (in every worker), else 503 (also once shutdown
    began)."""
    is_ready = request.app.state.runtime.is_ready
    return JSONResponse({"ready": is_ready}, status_code=200 if is_ready else 503)


def version_metadata(version: ModelVersion, entry: ModelEntry) -> dict[str, object]:
    """The V2 model metadata of one version, with layerserve's state, engine and version fields."""
    return {
        "name": version.name,
        "versions": [str(v) for v in entry.ready_versions],
        "active_version": str(entry.active_version or ""),
        "pinned_version": str(entry.pinned or ""),
        "version_labels": {label: str(number) for label, number in entry.spec.config.version_labels.items()},
        "platform": "keras_tensorflow",
        "inputs": [spec.to_dict() for spec in version.signature.inputs],
        "outputs": [spec.to_dict() for spec in version.signature.outputs],
        "version": str(version.version),
        "state": version.state,
        "reason": version.reason,
        "engine": version.engine_name,
        "engine_reason": version.engine_reason,
        "layer_count": version.layer_count,
        "cuts": version.cuts.describe() if version.cuts else [],
        "batching": version.batching(),
        "description": version.config.description,
    }


async def model_metadata(request: Request) -> Response:
    """GET /v2/models/{model}[/versions/{version}]."""
    registry = _registry(request)
    name = request.path_params["model"]
    version = registry.find(name, parse_version(request))
    return JSONResponse(version_metadata(version, registry.entry(name)))


async def model_ready(request: Request) -> Response:
    """GET /v2/models/{model}[/versions/{version}]/ready: 200 when ready, else 503."""
    version = _registry(request).find(request.path_params["model"], parse_version(request))
    return JSONResponse(
        {"name": version.name, "version": str(version.version), "ready": version.is_ready},
        status_code=200 if version.is_ready else 503,
    )


async def infer(request: Request) -> Response:
    """POST /v2/models/{model}[/versions/{version}]/infer (JSON or binary tensor data)."""
    runtime = request.app.state.runtime
    body = await read_body(request, runtime.settings.max_body_bytes)
    async with runtime.registry.lease(request.path_params["model"], parse_version(request)) as version:
        header_length = request.headers.get(v2.HEADER_LENGTH)
        parsed = v2.parse_infer_request(body, header_length, version.name, version.version, version.checks.declared)
        content, length = v2.encode_infer_response(parsed, await runtime.data.infer_on(version, parsed))
        if length is None:
            return Response(content, media_type="application/json")
        headers = {"Inference-Header-Content-Length": str(length)}
        return Response(content, media_type="application/octet-stream", headers=headers)


_MODEL = "/v2/models/{model}"
_VERSION = "/v2/models/{model}/versions/{version}"

routes = [
    Route("/v2", server_metadata, methods=["GET"]),
    Route("/v2/health/live", live, methods=["GET"]),
    Route("/v2/health/ready", ready, methods=["GET"]),
    *(Route(prefix, model_metadata, methods=["GET"]) for prefix in (_MODEL, _VERSION)),
    *(Route(f"{prefix}/ready", model_ready, methods=["GET"]) for prefix in (_MODEL, _VERSION)),
    *(Route(f"{prefix}/infer", infer, methods=["POST"]) for prefix in (_MODEL, _VERSION)),
]
