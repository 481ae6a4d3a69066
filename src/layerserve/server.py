"""Server(settings): the composition root. It builds the runtime (models, data and control planes, caches, jobs),
the request policy, the HTTP app and door and the gRPC door, and starts and stops them in order. The CLI, each
worker of `--workers N`, each Ray Serve replica (and its direct port), the tests' live server and the Python API
(BlockingRuntime) all build one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import uvloop

from layerserve.lifecycle.peers import Peers
from layerserve.lifecycle.worker_board import WorkerBoard
from layerserve.runtime import Runtime
from layerserve.settings import Settings
from layerserve.tracing import Tracing
from layerserve.training.launchers import TrainingLauncher
from layerserve.transports.grpc.server import GrpcDoor
from layerserve.transports.grpc.servicer import InferenceServicer, ServingState
from layerserve.transports.http.app import create_app
from layerserve.transports.http.door import HttpDoor
from layerserve.transports.http.services import HttpServices
from layerserve.transports.policy import RequestPolicy
from layerserve.transports.ports import address, reuse_port_socket
from layerserve.transports.tls import server_tls

log = logging.getLogger(__name__)

AppWrapper = Callable[[Any], Any]  # an ASGI app around the server's own (a Ray ingress's group router)


class Server:
    """One server process (see the module). `serve()` runs it with its doors; `start()` and `stop()` run it without
    them (the Python API), and `app` is its ASGI app for a host that runs it itself (Ray Serve), whose lifespan
    starts and stops it (and opens the HTTP door on `direct_port`, when given).

    Alone, a server opens its doors at once and turns ready once its models have settled. With a worker `board` (or
    `settle_first`), it loads first: no connection reaches a worker still loading (the workers share the ports).
    """

    def __init__(
        self, settings: Settings, *, board: WorkerBoard | None = None, peers: Peers | None = None,
        launcher: TrainingLauncher | None = None, settle_first: bool = False,
        answer_headers: tuple[tuple[bytes, bytes], ...] = (), wrap_app: AppWrapper | None = None, direct_port: int = 0,
    ) -> None:  # fmt: skip
        self.settings = settings
        http_tls = server_tls(settings, "http")  # first: wrong TLS files stop a server before it loads anything
        grpc_tls = server_tls(settings, "grpc") if settings.grpc_port else None
        self.runtime = runtime = Runtime(settings, board, settle_first, peers, launcher)
        self.data, self.control = runtime.data, runtime.control
        self.tracing = Tracing.of(settings)  # None: traces are off
        self.policy = RequestPolicy(settings, self.tracing)
        # Compressed bodies and messages of both doors inflate here, one at a time: a gzip bomb costs this thread's
        # time, not the event loop's, nor the default executor's, which the engine processes' calls use.
        self.inflater = ThreadPoolExecutor(1, thread_name_prefix="inflate")
        services = HttpServices(
            runtime.data, runtime.control, settings, lambda: runtime.is_ready, runtime.readiness, runtime.exposition,
            runtime.jobs, self.inflater,
        )  # fmt: skip
        app = create_app(services, self.policy, self._lifespan, answer_headers)
        self.app = app if wrap_app is None else wrap_app(app)
        self.http = HttpDoor(self.app, self.policy, settings, answer_headers, http_tls)
        self.servicer = InferenceServicer(
            ServingState(runtime.data, runtime.control, lambda: runtime.is_ready, self.policy)
        )
        self.grpc = (
            GrpcDoor(settings, self.servicer, runtime.wait_settled, grpc_tls, self.inflater)
            if settings.grpc_port
            else None
        )
        self._settle_first = settle_first or board is not None
        self._direct_port = direct_port
        self._doors_open = False
        self._exit: asyncio.Event | None = None

    async def start(self) -> None:
        """Start the runtime: load the models (in the background; with `settle_first` or a board, before this
        returns), poll the repository, open the job runner."""
        await self.runtime.start()

    async def open_doors(
        self, http_sockets: list[socket.socket] | None = None, grpc_sockets: list[socket.socket] | None = None
    ) -> None:
        """Take HTTP connections (on `http_sockets`, else on `host:port`) and gRPC calls (on `grpc_sockets`, else
        on `host:grpc_port`, unless it is 0).

        Raises:
            OSError: a port cannot be bound.
        """
        self._doors_open = True
        await self.http.start(http_sockets)
        if self.grpc is not None:
            await self.grpc.start(grpc_sockets)

    async def stop(self) -> None:
        """Turn unready, stop taking connections and calls on both doors at once, let what is in flight finish
        within `shutdown_timeout_s`, then stop the runtime."""
        self.runtime.draining.set()
        if self._doors_open:
            self._doors_open = False
            grace = self.settings.shutdown_timeout_s
            log.info("stopping: no new connections; requests in flight have %g s to finish", grace)
            doors = [self.http.stop(grace), *([self.grpc.stop(grace)] if self.grpc is not None else [])]
            await asyncio.gather(*doors)
        await self.runtime.close()
        self.inflater.shutdown(wait=False, cancel_futures=True)
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.close)  # the last spans go out (a few seconds at most)
        log.info("stopped")

    async def serve(
        self, http_sockets: list[socket.socket] | None = None, grpc_sockets: list[socket.socket] | None = None
    ) -> None:
        """Start, open the doors, serve until `request_exit`, then stop."""
        self._exit = asyncio.Event()
        if self._settle_first:
            await self.start()
            await self.open_doors(http_sockets, grpc_sockets)
        else:
            await self.open_doors(http_sockets, grpc_sockets)
            await self.start()
        try:
            await self._exit.wait()
        finally:
            await self.stop()

    def request_exit(self) -> None:
        """Stop serving (from the server's event loop: a signal handler, a test)."""
        self.runtime.draining.set()
        if self._exit is not None:
            self._exit.set()

    def run(
        self, http_sockets: list[socket.socket] | None = None, grpc_sockets: list[socket.socket] | None = None
    ) -> None:
        """`serve` on a uvloop event loop of its own, until SIGTERM or SIGINT (then a graceful stop)."""

        async def main() -> None:
            loop = asyncio.get_running_loop()
            for number in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(number, self.request_exit)
            await self.serve(http_sockets, grpc_sockets)

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main())

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Any) -> AsyncIterator[None]:
        """The app's lifespan, for a host that runs the app (Ray Serve): start (the models loaded first, with
        `settle_first`), open the HTTP door on `direct_port` if given, and stop at the end."""
        await self.start()
        try:
            if self._direct_port:
                try:
                    sock = reuse_port_socket(self.settings.host, self._direct_port)
                except OSError as error:
                    where = address(self.settings.host, self._direct_port)
                    raise RuntimeError(f"the direct port: {error} ({where})") from None
                self._doors_open = True
                await self.http.start([sock])
            yield
        finally:
            await self.stop()
