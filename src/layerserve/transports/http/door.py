"""HttpDoor: the HTTP/1.1 server of one process: the door's own connections (protocol.py) on asyncio's server, over
the ASGI app and its lane; started and stopped by the composition root (layerserve.server)."""

from __future__ import annotations

import asyncio
import email.utils
import logging
import socket
from typing import Any

from layerserve.settings import Settings
from layerserve.transports.http.lane import DirectLane
from layerserve.transports.http.protocol import DoorState, HttpLimits, HttpProtocol
from layerserve.transports.policy import RequestPolicy
from layerserve.transports.ports import address
from layerserve.transports.tls import ServerTls, listen_options

log = logging.getLogger(__name__)

BACKLOG = 2048


def limits_of(settings: Settings) -> HttpLimits:
    """The connections' limits in `settings`."""
    return HttpLimits(
        settings.max_header_bytes, settings.header_timeout_s, settings.body_timeout_s, settings.max_body_bytes,
        settings.keep_alive_timeout_s,
    )  # fmt: skip


class HttpDoor:
    """Serves `app` (and its lane: a model's requests answered from the connection, under `policy`) on the sockets
    it is given, or on `host:port`."""

    def __init__(
        self, app: Any, policy: RequestPolicy, settings: Settings, answer_headers: tuple[tuple[bytes, bytes], ...] = (),
        tls: ServerTls | None = None,
    ) -> None:  # fmt: skip
        lane = DirectLane(app, policy, bool(settings.compress_min_bytes), settings.serves_model, answer_headers)
        self._state = DoorState(app, lane, limits_of(settings))
        self._settings = settings
        self._tls = tls
        self._servers: list[asyncio.Server] = []
        self._clock: asyncio.TimerHandle | None = None

    @property
    def state(self) -> DoorState:
        """What the door's connections share (their set, the request tasks)."""
        return self._state

    async def start(self, sockets: list[socket.socket] | None = None) -> None:
        """Take connections on `sockets` (bound already: several workers share them), or else on `host:port`.

        Raises:
            OSError: `host:port` cannot be bound.
        """
        loop = asyncio.get_running_loop()
        state = self._state

        def connection() -> HttpProtocol:
            return HttpProtocol(state, loop)

        settings, tls = self._settings, self._tls
        # A client silent through the TLS handshake is dropped as one silent through its head.
        options: dict[str, Any] = {"backlog": BACKLOG, **listen_options(tls, settings.header_timeout_s)}
        self._tick()
        if sockets is not None:
            for sock in sockets:
                self._servers.append(await loop.create_server(connection, sock=sock, **options))
        else:
            self._servers.append(await loop.create_server(connection, settings.host, settings.port, **options))
        scheme = "https" if tls else "http"
        where = ", ".join(f"{scheme}://{address(*sock.getsockname()[:2])}" for s in self._servers for sock in s.sockets)
        log.info("HTTP service on %s (the console at /)", where)

    def _tick(self) -> None:
        """Refresh the `date` header every answer begins with, once a second."""
        date = email.utils.formatdate(usegmt=True).encode()
        self._state.default_headers[:] = [(b"server", b"layerserve"), (b"date", date)]
        self._clock = asyncio.get_running_loop().call_later(1.0, self._tick)

    def stop_accepting(self) -> None:
        """Take no new connection; each open one closes once its answer in flight is out (or now, when idle)."""
        for server in self._servers:
            server.close()
        for connection in list(self._state.connections):
            connection.shutdown()

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, let the requests in flight finish and their answers leave within `grace_s`, then cancel
        what is left and drop every connection."""
        self.stop_accepting()
        state = self._state
        deadline = asyncio.get_running_loop().time() + grace_s
        if state.tasks:
            _, late = await asyncio.wait(list(state.tasks), timeout=grace_s)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=1.0)
        for connection in list(state.connections):
            connection.transport.close()  # (sends what it holds first)
        left = max(0.0, deadline - asyncio.get_running_loop().time())
        try:
            await asyncio.wait_for(state.all_closed(), max(left, 1.0))
        except TimeoutError:
            for connection in list(state.connections):
                connection.transport.abort()
        if self._clock is not None:
            self._clock.cancel()
            self._clock = None
        self._servers = []
