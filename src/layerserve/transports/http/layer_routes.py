"""layerserve's layer table: every layer of a version, in graph order."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from layerserve.transports.http.bodies import JSONResponse
from layerserve.transports.http.services import services
from layerserve.transports.http.v2_routes import parse_version


async def layers(request: Request) -> Response:
    """GET /v2/models/{model}[/versions/{version}]/layers."""
    async with services(request).data.open(request.path_params["model"], parse_version(request)) as view:
        graph = view.graph
        body: dict[str, object] = {
            "model_name": view.model,
            "model_version": str(view.version),
            "layers": [layer.to_dict() for layer in graph.layers],
        }
        if graph.unavailable_reason:
            body["unavailable_reason"] = graph.unavailable_reason
        return JSONResponse(body)


routes = [
    Route("/v2/models/{model}/layers", layers, methods=["GET"]),
    Route("/v2/models/{model}/versions/{version}/layers", layers, methods=["GET"]),
]
