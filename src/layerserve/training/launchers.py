"""Where a training job's process runs: here (LocalLauncher, a child process of the server) or anywhere in a Ray
cluster (RayLauncher, a Ray task with its own CPU budget). Either way the process is `python -m
layerserve.training.train_job <job folder>`, its stdout lines are its progress, and it writes its version into
the (shared) repository."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

_TERMINATE_GRACE_S = 5.0
STDERR_TAIL = 2000  # characters of a crashed job's stderr kept as its error


def training_command(job_dir: Path) -> list[str]:
    """The command of a training job's process."""
    return [sys.executable, "-m", "layerserve.training.train_job", str(job_dir)]


class TrainingRun(Protocol):
    """One training process, started."""

    pid: int | None  # a process of this machine, while it runs (None when it runs elsewhere)

    def lines(self) -> AsyncIterator[bytes]:
        """Its stdout, line by line, until it exits."""

    async def wait(self) -> tuple[int, str]:
        """Its exit code (negative: the signal that ended it) and the tail of its stderr."""

    async def terminate(self) -> None:
        """SIGTERM, then SIGKILL after a grace period; returns once it has exited."""


class TrainingLauncher(Protocol):
    """Starts training processes."""

    async def start(self, job_dir: Path) -> TrainingRun:
        """Start the job whose folder (JOB_FILE, and its data: DATA_FILE, or an image job's features) is `job_dir`."""


class _LocalRun:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process
        self.pid: int | None = process.pid
        assert process.stderr is not None
        self._stderr = asyncio.create_task(process.stderr.read())

    async def lines(self) -> AsyncIterator[bytes]:
        assert self._process.stdout is not None
        async for line in self._process.stdout:
            yield line

    async def wait(self) -> tuple[int, str]:
        code = await self._process.wait()
        self.pid = None
        return code, (await self._stderr).decode("utf-8", "replace")[-STDERR_TAIL:]

    async def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._process.terminate()
        try:
            await asyncio.wait_for(self._process.wait(), _TERMINATE_GRACE_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
            await self._process.wait()


class LocalLauncher:
    """A child process of this server per job (the default)."""

    async def start(self, job_dir: Path) -> TrainingRun:
        """Start `python -m layerserve.training.train_job job_dir` here."""
        process = await asyncio.create_subprocess_exec(
            *training_command(job_dir), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        return _LocalRun(process)


def _run_on_node(files: dict[str, bytes]) -> Any:
    """The body of the Ray task (a generator): the job's folder (its files by name) written on its node, its process
    run there; yields each stdout line, then `{"exit": code, "stderr": tail}`. Cancelled, it stops the process."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="layerserve-job-") as folder, tempfile.TemporaryFile() as stderr:
        job_dir = Path(folder)
        for name, content in files.items():
            (job_dir / name).write_bytes(content)
        process = subprocess.Popen(training_command(job_dir), stdout=subprocess.PIPE, stderr=stderr)
        try:
            assert process.stdout is not None
            for line in process.stdout:  # noqa: UP028 - not `yield from`: Ray drives the generator with send()
                yield line
            code = process.wait()
            stderr.seek(0)
            yield {"exit": code, "stderr": stderr.read().decode("utf-8", "replace")[-STDERR_TAIL:]}
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(_TERMINATE_GRACE_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


class _RayRun:
    pid: int | None = None

    def __init__(self, generator: Any) -> None:
        self._generator = generator
        self._end: dict[str, Any] | None = None
        self._cancelled = False

    async def lines(self) -> AsyncIterator[bytes]:
        try:
            async for reference in self._generator:
                item = await reference
                if isinstance(item, dict):
                    self._end = item
                    return
                yield item
        except Exception as error:  # the task failed: its node died, or it was cancelled
            self._end = {"exit": -15 if self._cancelled else 1, "stderr": f"the Ray task ended: {error!r}"}

    async def wait(self) -> tuple[int, str]:
        end = self._end or {"exit": 1, "stderr": "the Ray task ended without an exit code"}
        return int(end["exit"]), str(end["stderr"])

    async def terminate(self) -> None:
        import ray

        self._cancelled = True
        ray.cancel(self._generator)


class RayLauncher:
    """A Ray task per job, reserving `cpus` on whichever node has them; the job folder travels with the task,
    the version it writes goes into the shared repository."""

    def __init__(self, cpus: float) -> None:
        self._cpus = cpus

    async def start(self, job_dir: Path) -> TrainingRun:
        """Submit the job as a Ray task (a generator of its stdout lines)."""
        import ray

        task = ray.remote(num_cpus=self._cpus, num_returns="streaming", max_retries=0)(_run_on_node)
        generator = task.remote({path.name: path.read_bytes() for path in job_dir.iterdir() if path.is_file()})
        return _RayRun(generator)
