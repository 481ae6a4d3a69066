"""Triton's extensions over the V2 routes: statistics, model configuration, log settings; the trace and
shared-memory routes answer that layerserve does not support them."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from layerserve.errors import BadRequestError
from layerserve.logs import log_settings, update_log_settings
from layerserve.protocols.triton import SHARED_MEMORY_UNSUPPORTED, TRACE_SETTINGS_UNSUPPORTED, model_config
from layerserve.protocols.v2 import load_json_object
from layerserve.transports.http.bodies import JSONResponse, read_body
from layerserve.transports.http.services import services
from layerserve.transports.http.v2_routes import parse_version

_MAX_SETTINGS_BYTES = 64 * 1024


async def statistics(request: Request) -> Response:
    """GET /v2/models[/{model}[/versions/{version}]]/stats: Triton's `model_stats`."""
    reports = services(request).data.statistics(request.path_params.get("model"), parse_version(request))
    stats = [report.statistics.to_dict(report.name, report.version) for report in reports]
    return JSONResponse({"model_stats": stats})


async def config(request: Request) -> Response:
    """GET /v2/models/{model}[/versions/{version}]/config: Triton's model configuration."""
    metadata = await services(request).data.metadata(request.path_params["model"], parse_version(request))
    return JSONResponse(model_config(metadata))


async def logging_settings(request: Request) -> Response:
    """GET /v2/logging: the log settings; POST changes them for this process (Triton's keys)."""
    file = services(request).settings.log_file
    if request.method == "GET":
        return JSONResponse(log_settings(file))
    changes = load_json_object(await read_body(request, _MAX_SETTINGS_BYTES) or b"{}", "the request body")
    return JSONResponse(update_log_settings(changes, file))


async def trace_settings(request: Request) -> Response:
    """GET|POST /v2[/models/{model}]/trace/setting: a 400, Triton's trace settings are not supported."""
    raise BadRequestError(TRACE_SETTINGS_UNSUPPORTED)


async def shared_memory(request: Request) -> Response:
    """The system and CUDA shared-memory routes: a 400, shared memory is not supported."""
    raise BadRequestError(SHARED_MEMORY_UNSUPPORTED)


def _shared_memory_routes(kind: str) -> list[Route]:
    prefix = f"/v2/{kind}sharedmemory"
    return [
        Route(f"{prefix}/status", shared_memory, methods=["GET"]),
        Route(f"{prefix}/region/{{region}}/status", shared_memory, methods=["GET"]),
        Route(f"{prefix}/region/{{region}}/register", shared_memory, methods=["POST"]),
        Route(f"{prefix}/region/{{region}}/unregister", shared_memory, methods=["POST"]),
        Route(f"{prefix}/unregister", shared_memory, methods=["POST"]),
    ]


_MODEL = "/v2/models/{model}"
_VERSION = "/v2/models/{model}/versions/{version}"

# `/v2/models/stats` must come before the V2 metadata route `/v2/models/{model}`.
routes = [
    Route("/v2/models/stats", statistics, methods=["GET"]),
    *(Route(f"{prefix}/stats", statistics, methods=["GET"]) for prefix in (_MODEL, _VERSION)),
    *(Route(f"{prefix}/config", config, methods=["GET"]) for prefix in (_MODEL, _VERSION)),
    Route("/v2/logging", logging_settings, methods=["GET", "POST"]),
    Route("/v2/trace/setting", trace_settings, methods=["GET", "POST"]),
    Route(f"{_MODEL}/trace/setting", trace_settings, methods=["GET", "POST"]),
    *_shared_memory_routes("system"),
    *_shared_memory_routes("cuda"),
]
