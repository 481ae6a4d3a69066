"""GET /metrics: Prometheus text format."""

from __future__ import annotations

import asyncio
import os

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest, multiprocess
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from layerserve.runtime import Runtime


async def exposition(runtime: Runtime) -> bytes:
    """This process's metrics, or with several workers every worker's, summed per metric (on Ray Serve, every
    replica's: see transports/ray/metric_sum.py), freshly sampled."""
    await asyncio.to_thread(runtime.sample_process)
    registry = REGISTRY
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    text = generate_latest(registry)
    if runtime.peers is not None:
        text = await runtime.peers.exposition(text)
    return text


async def metrics(request: Request) -> Response:
    """GET /metrics: every worker's (and replica's) metrics, in Prometheus text format."""
    return Response(await exposition(request.app.state.runtime), media_type=CONTENT_TYPE_LATEST)


routes = [Route("/metrics", metrics, methods=["GET"])]
