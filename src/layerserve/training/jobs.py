"""JobRunner: each training job run in its own process, one at a time per model, with progress and cancel,
and the new version applied or left to the version policy (records: layerserve.training.job_store; where the
process runs: layerserve.training.launchers)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from layerserve.errors import LayerserveError, NotFoundError
from layerserve.lifecycle.worker_board import is_process_alive
from layerserve.tracing import CURRENT
from layerserve.training.job_store import Job, JobRecords, JobState, JobStore
from layerserve.training.launchers import LocalLauncher, TrainingLauncher, TrainingRun
from layerserve.training.train_job import DATA_FILE, JOB_FILE

log = logging.getLogger(__name__)

_TERMINATE_GRACE_S = 5.0
_CANCEL_POLL_S = 0.5


OnVersion = Callable[[Job], Awaitable[None]]
Report = Callable[[dict[str, Any]], None]


class JobData(Protocol):
    """What a job trains on: written into its folder when it is submitted, and (for images) prepared in the server
    once it starts, before its process does."""

    recipe: str  # the training process's recipe: "text" or "image"
    rows: int  # texts or photos

    def write(self, job_dir: Path) -> dict[str, Any]:
        """Write the data's files into the job's folder; what job.json adds for the process."""

    async def prepare(self, job_dir: Path, report: Report) -> dict[str, Any]:
        """What the job's process needs from the server (the features of photos), written into its folder, with
        progress to `report`; what the job's progress keeps of it (e.g. {"features": {...}}).

        Raises:
            LayerserveError: it cannot be done (the job fails with the message).
        """


class TextData:
    """Texts and their labels (data.jsonl); nothing to prepare."""

    recipe = "text"

    def __init__(self, texts: list[str], labels: list[str]) -> None:
        self.texts, self.labels, self.rows = texts, labels, len(texts)

    def write(self, job_dir: Path) -> dict[str, Any]:
        """One JSON line a text: {"text", "label"}."""
        with (job_dir / DATA_FILE).open("w", encoding="utf-8") as data:
            for text, label in zip(self.texts, self.labels, strict=True):
                data.write(json.dumps({"text": text, "label": label}, ensure_ascii=False) + "\n")
        return {"recipe": self.recipe}

    async def prepare(self, job_dir: Path, report: Report) -> dict[str, Any]:
        """Nothing: the process reads the texts."""
        return {}


class JobRunner:
    """Queues and runs training jobs: one process per job, one job at a time per model."""

    def __init__(
        self, jobs_dir: Path, threads: int, repository: Path, on_version: OnVersion, store: JobRecords | None = None,
        launcher: TrainingLauncher | None = None,
    ) -> None:  # fmt: skip
        self._dir = jobs_dir
        self._threads = threads
        self._repository = repository
        self._on_version = on_version
        self._store = store or JobStore(jobs_dir / "jobs.sqlite3")
        self._launcher = launcher or LocalLauncher()
        self._jobs: dict[str, Job] = {}  # this process's own jobs
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._processes: dict[str, TrainingRun] = {}
        self._data: dict[str, JobData] = {}  # a job's data until its process starts
        host = socket.gethostname()
        for job in self._store.all():  # a job of a server process of this machine that stopped meanwhile
            if not job.is_finished and job.host == host and not is_process_alive(job.owner):
                self._finish(job, JobState.FAILED, f"interrupted: the server stopped while the job was {job.state}")
                self._remove_leftovers(job)

    def jobs(self) -> list[Job]:
        """Every job of every worker, oldest first."""
        return self._store.all()

    def get(self, job_id: str) -> Job:
        """A job by id (this worker's, or another's from the shared records).

        Raises:
            NotFoundError: no such job.
        """
        job = self._jobs.get(job_id) or self._store.get(job_id)
        if job is None:
            raise NotFoundError(f"no job {job_id!r}; GET /v2/jobs lists them")
        return job

    def submit(self, model: str, data: JobData, params: dict[str, Any], apply: bool) -> Job:
        """Record a job, write its data, and queue it behind the model's other jobs.

        Raises:
            NotReadyError: its record cannot be written (Redis gone); nothing is left of it.
        """
        job = Job(uuid.uuid4().hex[:16], model, params, apply, data.rows)
        self._store.save(job)  # first: a job that cannot be recorded is not started
        job_dir = self._dir / job.id
        job_dir.mkdir(parents=True)
        spec = {"model_dir": str(self._repository / model), "params": job.params, "tag": job.id, **data.write(job_dir)}
        request = CURRENT.get()  # a traced request submits it: the job's process continues that trace
        if request is not None:
            spec["trace"] = request.tracing.job_trace(request)
        (job_dir / JOB_FILE).write_text(json.dumps({**spec, "threads": self._threads}), encoding="utf-8")
        self._jobs[job.id] = job
        self._data[job.id] = data
        self._tasks[job.id] = asyncio.create_task(self._run(job), name=f"job-{job.id}")
        return job

    async def cancel(self, job_id: str) -> Job:
        """Cancel a queued or running job (a running one's process is terminated); a finished one is left.

        Raises:
            NotFoundError: no such job.
        """
        job = self.get(job_id)
        if job.is_finished:
            return job
        if job_id not in self._jobs:
            return await self._cancel_elsewhere(job)
        process, task = self._processes.get(job_id), self._tasks.get(job_id)
        if process is None:  # queued, or preparing its data in this server (an image job's features)
            how = "preparing its data" if job.state == JobState.RUNNING else "queued"
            self._finish(job, JobState.CANCELLED, f"cancelled while {how}")
            if task is not None:
                task.cancel()
            self._remove_leftovers(job)
            return job
        job.error = "cancelled while running"  # _execute sees it when the process ends
        await process.terminate()
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        return job

    async def _cancel_elsewhere(self, job: Job) -> Job:
        """Cancel a job another server process (a worker, a replica) owns: through the shared records, which its
        owner watches, and a signal to its training process if that runs on this machine; its owner records the
        end."""
        self._store.request_cancel(job.id, mark_cancelled=job.state == JobState.QUEUED)
        if job.state == JobState.RUNNING and job.pid is not None and job.host == socket.gethostname():
            with contextlib.suppress(ProcessLookupError):
                os.kill(job.pid, signal.SIGTERM)
        # The owner is another process: the shared records are the only thing to wait on (bounded).
        deadline = time.monotonic() + _TERMINATE_GRACE_S * 2
        while time.monotonic() < deadline:
            current = self._store.get(job.id)
            if current is None or current.is_finished:
                return current or job
            await asyncio.sleep(0.1)
        return self.get(job.id)

    async def close(self) -> None:
        """Stop every job: running ones are terminated, and all are recorded as cancelled."""
        for job_id in list(self._tasks):
            job = self._jobs[job_id]
            if not job.is_finished:
                job.error = "cancelled: the server shut down"
                if job_id in self._processes:
                    await self._processes[job_id].terminate()
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        for job in self._jobs.values():
            if not job.is_finished:
                self._finish(job, JobState.CANCELLED, job.error or "cancelled: the server shut down")
                self._remove_leftovers(job)
        self._store.close()

    async def _run(self, job: Job) -> None:
        lock = self._locks.setdefault(job.model, asyncio.Lock())
        try:
            async with lock:
                if not job.is_finished and self._cancel_requested(job.id):
                    self._finish(job, JobState.CANCELLED, "cancelled while queued")
                if job.is_finished:
                    return
                await self._execute(job)
        except asyncio.CancelledError:
            if not job.is_finished:
                self._finish(job, JobState.CANCELLED, job.error or "cancelled")
                self._remove_leftovers(job)
            raise
        finally:
            self._tasks.pop(job.id, None)
            self._data.pop(job.id, None)

    async def _execute(self, job: Job) -> None:
        job.state, job.started_at = JobState.RUNNING, time.time()
        self._record(job)
        prepared = await self._prepare(job)
        if prepared is None:
            return
        process = await self._launcher.start(self._dir / job.id)
        self._processes[job.id] = process
        job.pid = process.pid
        self._record(job)
        watching = asyncio.create_task(self._watch_cancel(job, process))
        reported_error = ""
        try:
            async for line in process.lines():
                message = _parse_line(line)
                if "progress" in message:
                    job.progress = {**message["progress"], **prepared}
                    if "loss" in message["progress"]:
                        job.history.append(message["progress"])
                    self._record(job)
                elif "summary" in message:  # training ended: which epoch's weights are kept
                    job.progress = {**job.progress, **message["summary"]}
                    self._record(job)
                elif "version" in message:
                    job.version = int(message["version"])
                elif "error" in message:
                    reported_error = str(message["error"])
            code, errors = await process.wait()
        finally:
            watching.cancel()
            self._processes.pop(job.id, None)
            job.pid = None
        if job.version is not None:
            await self._serve(job)
        elif job.error.startswith("cancelled") or self._cancel_requested(job.id):
            self._finish(job, JobState.CANCELLED, job.error or "cancelled while running")
        else:
            why = reported_error or _crash_reason(code, errors)
            self._finish(job, JobState.FAILED, why)
        if job.version is None:
            self._remove_leftovers(job)
        shutil.rmtree(self._dir / job.id, ignore_errors=True)

    async def _prepare(self, job: Job) -> dict[str, Any] | None:
        """The job's data prepared in this server (see JobData.prepare): what its progress keeps of it, or None
        when that failed (the job is then FAILED, its folder gone)."""
        data = self._data.pop(job.id)

        def report(progress: dict[str, Any]) -> None:
            job.progress = progress
            self._record(job)
            if self._cancel_requested(job.id):  # another worker asked: there is no process to signal yet
                job.error = "cancelled while preparing its data"
                task = asyncio.current_task()
                if task is not None:
                    task.cancel()

        try:
            return await data.prepare(self._dir / job.id, report)
        except Exception as error:  # whatever it was, the job fails with it and the server goes on
            why = error.message if isinstance(error, LayerserveError) else f"{type(error).__name__}: {error}"
            if not isinstance(error, LayerserveError):
                log.exception("job %s: preparing its data failed", job.id)
            self._finish(job, JobState.FAILED, f"preparing its data failed: {why}")
            self._remove_leftovers(job)
            return None

    async def _watch_cancel(self, job: Job, process: TrainingRun) -> None:
        """Stop the job's process once another server process asks to cancel it (in the shared records)."""
        while not await asyncio.to_thread(self._cancel_requested, job.id):
            await asyncio.sleep(_CANCEL_POLL_S)
        job.error = "cancelled while running"
        await process.terminate()

    async def _serve(self, job: Job) -> None:
        """Make the new version serve (pinned with apply, else per the version policy); the job succeeds
        once it does."""
        try:
            await self._on_version(job)
        except LayerserveError as error:
            self._finish(job, JobState.FAILED, f"version {job.version} was written but does not serve: {error.message}")
        else:
            self._finish(job, JobState.SUCCEEDED, "")

    def _finish(self, job: Job, state: JobState, error: str) -> None:
        job.state, job.error, job.finished_at = state, error, time.time()
        self._record(job)
        log.log(logging.ERROR if state == JobState.FAILED else logging.INFO, "job %s %s %s", job.id, state, error)

    def _record(self, job: Job) -> None:
        """Save a running job's record; records that cannot be written (Redis gone) do not stop the job."""
        try:
            self._store.save(job)
        except LayerserveError as error:
            log.error("job %s: its record is not saved: %s", job.id, error.message)

    def _cancel_requested(self, job_id: str) -> bool:
        try:
            return self._store.is_cancel_requested(job_id)
        except LayerserveError as error:
            log.error("job %s: its cancel requests cannot be read: %s", job_id, error.message)
            return False

    def _remove_leftovers(self, job: Job) -> None:
        """A job that did not finish leaves no staging folder and no data behind."""
        for parent in (self._repository / job.model, self._repository):
            for staging in parent.glob(f".staging-{job.id}-*") if parent.is_dir() else ():
                shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(self._dir / job.id, ignore_errors=True)


def _parse_line(line: bytes) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except ValueError:
        return {}
    return message if isinstance(message, dict) else {}


def _crash_reason(code: int, stderr: str) -> str:
    if code < 0:
        name = signal.Signals(-code).name if -code in {int(s) for s in signal.valid_signals()} else str(-code)
        head = f"the training process was killed by {name}"
    else:
        head = f"the training process exited with code {code}"
    tail = stderr.strip()
    return f"{head}: {tail}" if tail else head
