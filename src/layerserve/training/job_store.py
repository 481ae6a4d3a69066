"""Training job records: Job, its states, and JobStore (SQLite, shared by the server's worker processes)."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any


class JobState(StrEnum):
    """Where a job is in its life."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


_FINISHED = {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}


@dataclass
class Job:
    """One training job and what is known of it."""

    id: str
    model: str
    params: dict[str, Any]
    apply: bool
    rows: int
    state: JobState = JobState.QUEUED
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    progress: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    version: int | None = None
    error: str = ""
    owner: int = field(default_factory=os.getpid)  # the server process that runs it
    pid: int | None = None  # its training process, while it runs

    @property
    def is_finished(self) -> bool:
        """Whether the job has ended (succeeded, failed or cancelled)."""
        return self.state in _FINISHED

    def to_dict(self) -> dict[str, Any]:
        """The `/v2/jobs/{id}` form."""
        return {
            "id": self.id,
            "model_name": self.model,
            "state": self.state.value,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "rows": self.rows,
            "params": self.params,
            "apply": self.apply,
            "progress": self.progress,
            "history": self.history,
            "model_version": None if self.version is None else str(self.version),
            "error": self.error,
        }


_COLUMNS = (
    "id", "model", "params", "apply", "rows", "state", "created_at", "started_at", "finished_at", "progress",
    "history", "version", "error", "owner", "pid",
)  # fmt: skip
_JSON_COLUMNS = {"params", "progress", "history"}
_SCHEMA = {
    "model": "TEXT", "params": "TEXT", "apply": "INTEGER", "rows": "INTEGER", "state": "TEXT", "created_at": "REAL",
    "started_at": "REAL", "finished_at": "REAL", "progress": "TEXT", "history": "TEXT", "version": "INTEGER",
    "error": "TEXT", "owner": "INTEGER", "pid": "INTEGER", "cancel_requested": "INTEGER DEFAULT 0",
}  # fmt: skip


class JobStore:
    """Job records in one SQLite file, shared by the server's worker processes; every change is committed at
    once. A cancel request is a column of its own, which saving a record never overwrites."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._connection = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
        self._lock = threading.Lock()
        with self._lock:
            # One writer at a time: workers starting together would otherwise both see a column missing and
            # the second ALTER would fail ("duplicate column name"), leaving that worker without jobs.
            self._connection.execute("BEGIN IMMEDIATE")
            try:
                self._connection.execute("CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY)")
                present = {row[1] for row in self._connection.execute("PRAGMA table_info(jobs)")}
                for column, kind in _SCHEMA.items():  # adds what an older layerserve's table lacks
                    if column not in present:
                        self._connection.execute(f"ALTER TABLE jobs ADD COLUMN {column} {kind}")
            except BaseException:
                self._connection.execute("ROLLBACK")
                raise
            self._connection.execute("COMMIT")

    def save(self, job: Job) -> None:
        """Insert or update the record."""
        values = [
            json.dumps(getattr(job, c), ensure_ascii=False) if c in _JSON_COLUMNS else getattr(job, c) for c in _COLUMNS
        ]
        values[_COLUMNS.index("state")] = job.state.value
        updates = ", ".join(f"{c} = excluded.{c}" for c in _COLUMNS[1:])
        with self._lock:
            self._connection.execute(
                f"INSERT INTO jobs ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))}) "
                f"ON CONFLICT(id) DO UPDATE SET {updates}",
                values,
            )

    def all(self) -> list[Job]:
        """Every job, oldest first."""
        return self._select("ORDER BY created_at", ())

    def get(self, job_id: str) -> Job | None:
        """One job, or None."""
        found = self._select("WHERE id = ?", (job_id,))
        return found[0] if found else None

    def request_cancel(self, job_id: str, mark_cancelled: bool) -> None:
        """Ask the job's owner to cancel it; `mark_cancelled` also records it cancelled (a queued job)."""
        with self._lock:
            self._connection.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = ?", (job_id,))
            if mark_cancelled:
                self._connection.execute(
                    "UPDATE jobs SET state = ?, error = ?, finished_at = ? WHERE id = ?",
                    (JobState.CANCELLED.value, "cancelled while queued", time.time(), job_id),
                )

    def is_cancel_requested(self, job_id: str) -> bool:
        """Whether any server process asked to cancel the job."""
        with self._lock:
            row = self._connection.execute("SELECT cancel_requested FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return bool(row and row[0])

    def _select(self, where: str, parameters: tuple[object, ...]) -> list[Job]:
        with self._lock:
            rows = self._connection.execute(f"SELECT {', '.join(_COLUMNS)} FROM jobs {where}", parameters).fetchall()
        jobs = []
        for row in rows:
            data = {c: json.loads(v) if c in _JSON_COLUMNS else v for c, v in zip(_COLUMNS, row, strict=True)}
            data["state"], data["apply"] = JobState(data["state"]), bool(data["apply"])
            jobs.append(Job(**data))
        return jobs

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self._connection.close()
