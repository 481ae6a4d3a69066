"""Supervisor: `layerserve serve --workers N`. It binds the ports, starts N worker processes that serve on them (each
a fresh interpreter running `python -m layerserve.workers`, a Server of its own), starts a worker again when one
dies, and stops them all on SIGTERM or SIGINT.

The workers share the listening sockets, and the kernel hands a connection only to a process that accepts on it: a
worker opens its doors once its models have settled, so no request reaches a worker still loading. Their metrics
are files in a folder the supervisor makes (`PROMETHEUS_MULTIPROC_DIR`, summed by /metrics), their readiness posts
in another (WorkerBoard).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path

from layerserve.lifecycle.worker_board import FOLDER_VARIABLE, WorkerBoard
from layerserve.settings import Settings
from layerserve.transports.ports import listening_socket

log = logging.getLogger(__name__)

SETTINGS_VARIABLE = "LAYERSERVE_WORKER_SETTINGS"  # a worker's settings, as JSON (they may hold tokens: not argv)
SOCKETS_VARIABLE = "LAYERSERVE_WORKER_SOCKETS"  # its inherited sockets' descriptors: HTTP, then gRPC (or -1)
STARTUP_FAILURE = 3  # a worker's exit status when it could not start: starting it again would fail the same way
_STOP_MARGIN_S = 10.0  # past the graceful shutdown, before a worker that has not stopped is killed


class Supervisor:
    """See the module."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings

    def run(self) -> int:
        """Serve until SIGTERM or SIGINT; the exit status (1 when a worker could not start).

        Raises:
            OSError: a port cannot be bound.
        """
        settings = self._settings
        sockets = [listening_socket(settings.host, settings.port)]
        if settings.grpc_port:
            sockets.append(listening_socket(settings.host, settings.grpc_port))
        metrics_dir = tempfile.mkdtemp(prefix="layerserve-metrics-")
        board_dir = tempfile.mkdtemp(prefix="layerserve-workers-")
        descriptors = [sock.fileno() for sock in sockets]
        environment = {
            **os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir, FOLDER_VARIABLE: board_dir,
            SETTINGS_VARIABLE: settings.model_dump_json(),
            SOCKETS_VARIABLE: ",".join(str(fd) for fd in descriptors) + ("" if settings.grpc_port else ",-1"),
        }  # fmt: skip
        try:
            return asyncio.run(self._supervise(environment, descriptors))
        finally:
            for sock in sockets:
                sock.close()
            shutil.rmtree(metrics_dir, ignore_errors=True)
            shutil.rmtree(board_dir, ignore_errors=True)

    async def _supervise(self, environment: dict[str, str], descriptors: list[int]) -> int:
        """Start the workers; start a worker that dies again, until told to stop (then 0) or until one cannot start
        (then 1); then stop them all."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for number in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(number, stop.set)

        async def start() -> asyncio.subprocess.Process:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "layerserve.workers", env=environment, pass_fds=descriptors
            )
            log.info("worker %d started", process.pid)
            return process

        processes = [await start() for _ in range(self._settings.workers)]
        exits = {asyncio.ensure_future(process.wait()): index for index, process in enumerate(processes)}
        stopping = asyncio.ensure_future(stop.wait())
        status = 0
        try:
            while status == 0:
                done, _ = await asyncio.wait({*exits, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if stopping in done:
                    break
                for ended in done:
                    index = exits.pop(ended)
                    code, pid = ended.result(), processes[index].pid
                    if code == STARTUP_FAILURE:
                        log.error("worker %d could not start: stopping", pid)
                        status = 1
                        break
                    log.warning("worker %d died (exit status %d): starting another", pid, code)
                    processes[index] = await start()
                    exits[asyncio.ensure_future(processes[index].wait())] = index
        finally:
            stopping.cancel()
            await self._stop_all(processes)
        return status

    async def _stop_all(self, processes: list[asyncio.subprocess.Process]) -> None:
        """SIGTERM every worker (each drains and stops), then wait; kill one that has not stopped in time."""
        for process in processes:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                await asyncio.wait_for(process.wait(), self._settings.shutdown_timeout_s + _STOP_MARGIN_S)
            except TimeoutError:
                log.error("worker %d did not stop: killing it", process.pid)
                process.kill()
                await process.wait()


def run_worker() -> int:
    """One worker: its settings and sockets from the supervisor; serve until SIGTERM."""
    from layerserve.gpu import apply_settings
    from layerserve.logs import configure_logging
    from layerserve.server import Server

    settings = Settings.model_validate_json(os.environ[SETTINGS_VARIABLE])
    configure_logging(settings.log_level, settings.log_format, settings.log_file)
    apply_settings(settings)
    fds = [int(fd) for fd in os.environ[SOCKETS_VARIABLE].split(",")]
    sockets = [socket.socket(fileno=fd) if fd >= 0 else None for fd in fds]
    try:
        server = Server(settings, board=WorkerBoard(Path(os.environ[FOLDER_VARIABLE]), settings.workers))
    except Exception:
        log.exception("the worker could not start")
        return STARTUP_FAILURE
    http, grpc = sockets[0], sockets[1]
    server.run([http] if http is not None else None, [grpc] if grpc is not None else None)
    return 0


if __name__ == "__main__":
    sys.exit(run_worker())
