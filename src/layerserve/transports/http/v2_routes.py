"""Open Inference Protocol routes: health, server and model metadata, readiness, infer, repository index."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from layerserve import __version__
from layerserve.protocols import triton, v2
from layerserve.tracing import span
from layerserve.transports.http.bodies import JSONResponse, read_body
from layerserve.transports.http.cycle import header_value
from layerserve.transports.http.services import services

_HEADER_LENGTH = v2.HEADER_LENGTH.encode()


def parse_version(request: Request) -> int | None:
    """The `{version}` path parameter as a positive integer, or None where the path has none.

    Raises:
        BadRequestError: the version is not a positive integer.
    """
    raw = request.path_params.get("version")
    return None if raw is None else v2.parse_version_number(raw)


async def server_metadata(request: Request) -> Response:
    """GET /v2."""
    return JSONResponse({"name": "layerserve", "version": __version__, "extensions": triton.EXTENSIONS})


async def live(request: Request) -> Response:
    """GET /v2/health/live."""
    return JSONResponse({"live": True})


async def ready(request: Request) -> Response:
    """GET /v2/health/ready: 200 once every model has settled (in every worker), else 503 (also once shutdown
    began)."""
    is_ready = await services(request).readiness()
    return JSONResponse({"ready": is_ready}, status_code=200 if is_ready else 503)


async def model_metadata(request: Request) -> Response:
    """GET /v2/models/{model}[/versions/{version}]."""
    data = services(request).data
    return JSONResponse(v2.metadata_json(await data.metadata(request.path_params["model"], parse_version(request))))


async def model_ready(request: Request) -> Response:
    """GET /v2/models/{model}[/versions/{version}]/ready: 200 when ready, else 503."""
    metadata = services(request).data.describe(request.path_params["model"], parse_version(request))
    is_ready = metadata.state == "READY"
    return JSONResponse(
        {"name": metadata.name, "version": str(metadata.version), "ready": is_ready},
        status_code=200 if is_ready else 503,
    )


async def infer(request: Request) -> Response:
    """POST /v2/models/{model}[/versions/{version}]/infer (JSON or binary tensor data)."""
    found = services(request)
    body = await read_body(request, found.settings.max_body_bytes)
    async with found.data.open(request.path_params["model"], parse_version(request)) as view:
        raw_length = header_value(request.scope, _HEADER_LENGTH)
        header_length = None if raw_length is None else raw_length.decode("latin-1")
        with span("decode"):
            templates = view.parse_state(v2.HeaderTemplates)
            parsed = templates.parse(body, header_length, view.model, view.version, view.check_declared)
        answer = await view.infer(parsed)
        with span("encode"):
            content, length = v2.encode_infer_response(parsed, answer)
        if length is None:
            return Response(content, media_type="application/json")
        response = Response(content, media_type="application/octet-stream")
        response.raw_headers.append((_HEADER_LENGTH, str(length).encode()))  # Starlette's `headers` cost 3 us more
        return response


_MODEL = "/v2/models/{model}"
_VERSION = "/v2/models/{model}/versions/{version}"

# Matched first: Starlette tries the routes in order, and inference is the path every request of a model takes.
infer_routes = [Route(f"{prefix}/infer", infer, methods=["POST"]) for prefix in (_MODEL, _VERSION)]

routes = [
    Route("/v2", server_metadata, methods=["GET"]),
    Route("/v2/health/live", live, methods=["GET"]),
    Route("/v2/health/ready", ready, methods=["GET"]),
    *(Route(prefix, model_metadata, methods=["GET"]) for prefix in (_MODEL, _VERSION)),
    *(Route(f"{prefix}/ready", model_ready, methods=["GET"]) for prefix in (_MODEL, _VERSION)),
]
