"""The bare baseline of `layerserve bench`: the same HTTP stack (uvicorn, uvloop, httptools, Starlette)
answering every POST with a constant, to show what the stack alone costs."""

from __future__ import annotations

import socket
from multiprocessing.context import SpawnProcess

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

_CONSTANT = b'{"model_name":"bare","model_version":"1","outputs":[]}'


async def _constant(request: Request) -> Response:
    await request.body()
    return Response(_CONSTANT, media_type="application/json")


def bare_app() -> Starlette:
    """Every POST under /v2/models/ answers the same small JSON body after reading the request."""
    return Starlette(routes=[Route("/v2/models/{rest:path}", _constant, methods=["POST"])])


def _serve(port: int) -> None:
    import uvicorn

    uvicorn.run(bare_app(), host="127.0.0.1", port=port, log_level="warning", loop="uvloop", http="httptools",
                access_log=False)  # fmt: skip


def start_bare_server() -> tuple[SpawnProcess, int]:
    """Start the bare server in a fresh process on a free port; returns once it accepts connections."""
    import multiprocessing
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    process = multiprocessing.get_context("spawn").Process(target=_serve, args=(port,), daemon=True)
    process.start()
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process, port
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("the bare baseline server did not start")
