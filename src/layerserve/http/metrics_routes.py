"""GET /metrics: Prometheus text format."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


async def metrics(request: Request) -> Response:
    """GET /metrics."""
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


routes = [Route("/metrics", metrics, methods=["GET"])]
