"""DirectDoor: an ingress replica's own HTTP server, layerserve's as `serve` runs it, on a port every replica of a
node shares (`direct_port`), so that a request reaches the replica with no Ray Serve proxy or wrapper on its way.

Behind Ray Serve's Python proxy a request pays for the proxy's process and then Ray's replica wrapper; behind its
HAProxy ingress it still pays for the wrapper and for Ray's own uvicorn, which does not take the server's
protocol (server.py) and so not the direct lane of a model's requests. Here Ray places, restarts and scales
nothing but the replica; the replica's server is the one `serve` runs (`uvicorn_options`, `HttpProtocol`), bound
with SO_REUSEPORT so that the kernel spreads a node's connections over its replicas.

What it gives up: a request on this door shares its replica's fate (no proxy sends it again when the replica
dies), and Ray Serve's autoscaler does not see it (options.py refuses autoscaling with a door).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from layerserve.settings import Settings
from layerserve.transports.http.server import uvicorn_options

log = logging.getLogger(__name__)


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` that other processes of this user may bind too (SO_REUSEPORT).

    Raises:
        OSError: the port is held without SO_REUSEPORT, or by another user.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class DirectDoor:
    """Wraps the app Ray Serve runs in a replica: once its lifespan has started (every model loaded), the door's
    server serves the same app on `settings.host`:`port`; when the lifespan shuts down, the door stops taking
    connections and finishes what it holds (`shutdown_timeout_s`) before the runtime closes."""

    def __init__(self, app: ASGIApp, settings: Settings, port: int) -> None:
        self._app = app
        self._settings = settings
        self._port = port
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self._app(scope, receive, send)
            return

        async def receive_stopping_door() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await self.close()
            return message

        async def send_opening_door(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                try:
                    await self.open()
                except OSError as error:
                    message = {"type": "lifespan.startup.failed", "message": f"the direct port: {error}"}
            await send(message)

        await self._app(scope, receive_stopping_door, send_opening_door)

    async def open(self) -> None:
        """Bind the port and serve on this event loop (the runtime's).

        Raises:
            OSError: the port cannot be bound (held by another program).
        """
        sock = reuse_port_socket(self._settings.host, self._port)
        options = {**uvicorn_options(self._settings), "port": self._port, "lifespan": "off", "loop": "none"}
        server = uvicorn.Server(uvicorn.Config(self._app, **options))
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]  # Ray's signals
        self._server, self._task = server, asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        while not server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()  # the server's own failure, raised here
        log.info("direct port %s:%d open", self._settings.host, self._port)

    async def close(self) -> None:
        """Stop taking connections, answer what was taken, then stop."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await self._task
        self._server = self._task = None
