"""GET /metrics: Prometheus text format."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from layerserve.transports.http.services import services


async def metrics(request: Request) -> Response:
    """GET /metrics: every worker's (and replica's) metrics, in Prometheus text format."""
    return Response(await services(request).exposition(), media_type=CONTENT_TYPE_LATEST)


routes = [Route("/metrics", metrics, methods=["GET"])]
