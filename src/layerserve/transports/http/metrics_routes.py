"""GET /metrics: Prometheus text format."""

from __future__ import annotations

import asyncio
import os

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest, multiprocess
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


async def metrics(request: Request) -> Response:
    """GET /metrics: this process's metrics, or with several workers every worker's, summed per metric."""
    await asyncio.to_thread(request.app.state.runtime.sample_process)
    registry = REGISTRY
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


routes = [Route("/metrics", metrics, methods=["GET"])]
