"""WorkerBoard: which worker processes of one server have loaded their models, in a folder they share."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

FOLDER_VARIABLE = "LAYERSERVE_WORKER_BOARD"  # the board's folder, set by `serve --workers N` for its workers


def is_process_alive(pid: int | None) -> bool:
    """Whether a process of this id runs (on this machine)."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class WorkerBoard:
    """With `--workers N`, every worker posts a file named by its pid once its models have settled, and takes it
    down when it shuts down; the server is ready when N live workers have posted. A worker killed outright
    leaves its file behind: a dead pid does not count, and its file and its live metrics are cleared."""

    def __init__(self, folder: Path, workers: int) -> None:
        self.folder = folder
        self.workers = workers
        self._own = folder / f"ready-{os.getpid()}"

    def mark_ready(self) -> None:
        """This worker has loaded its models and takes traffic."""
        self._own.touch()

    def withdraw(self) -> None:
        """This worker stops taking traffic (shutdown)."""
        self._own.unlink(missing_ok=True)

    def ready_count(self) -> int:
        """How many live workers have posted; clears what dead ones left."""
        count = 0
        for path in self.folder.glob("ready-*"):
            pid = int(path.name.removeprefix("ready-"))
            if is_process_alive(pid):
                count += 1
                continue
            path.unlink(missing_ok=True)
            self._forget_metrics(pid)
        return count

    def is_ready(self) -> bool:
        """Whether every worker has loaded its models."""
        return self.ready_count() >= self.workers

    @staticmethod
    def _forget_metrics(pid: int) -> None:
        """Drop the live gauges (in flight, process CPU and memory) of a worker that died without cleaning up."""
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            return
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
        log.warning("worker %d is gone: readiness waits for its replacement to load its models", pid)
