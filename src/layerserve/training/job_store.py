"""Training job records: Job, its states, JobStore (SQLite, shared by one machine's worker processes) and
RedisJobStore (shared by replicas on several machines); `open_job_store` picks one."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from layerserve.errors import ConfigError, NotReadyError

if TYPE_CHECKING:
    from redis.client import Pipeline


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
    host: str = field(default_factory=socket.gethostname)  # the machine of that server process
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
    "history", "version", "error", "owner", "host", "pid",
)  # fmt: skip
_JSON_COLUMNS = {"params", "progress", "history"}
_SCHEMA = {
    "model": "TEXT", "params": "TEXT", "apply": "INTEGER", "rows": "INTEGER", "state": "TEXT", "created_at": "REAL",
    "started_at": "REAL", "finished_at": "REAL", "progress": "TEXT", "history": "TEXT", "version": "INTEGER",
    "error": "TEXT", "owner": "INTEGER", "host": "TEXT", "pid": "INTEGER", "cancel_requested": "INTEGER DEFAULT 0",
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
                if "host" not in present:
                    # The file is local, so every older record was written by a server on this machine.
                    self._connection.execute("UPDATE jobs SET host = ?", (socket.gethostname(),))
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


class JobRecords(Protocol):
    """What the training jobs need of their records; JobStore and RedisJobStore both provide it."""

    def save(self, job: Job) -> None:
        """Insert or update the record; its cancel request stays as it is."""

    def all(self) -> list[Job]:
        """Every job, oldest first."""

    def get(self, job_id: str) -> Job | None:
        """One job, or None."""

    def request_cancel(self, job_id: str, mark_cancelled: bool) -> None:
        """Ask the job's owner to cancel it; `mark_cancelled` also records it cancelled (a queued job)."""

    def is_cancel_requested(self, job_id: str) -> bool:
        """Whether any server process asked to cancel the job."""

    def close(self) -> None:
        """Let go of the records."""


class RedisJobStore:
    """Job records on a Redis server, shared by server replicas on several machines.

    `{prefix}jobs:{id}` is a hash: field `record` holds the job as JSON and field `cancel` the cancel request,
    which saving the record never touches; `{prefix}jobs` is a sorted set of the ids by created_at. Every Redis
    error comes out as NotReadyError (503), naming the server and what failed.
    """

    def __init__(self, url: str, prefix: str, timeout_s: float) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._url = _without_password(url)
        self._prefix = prefix
        self._index = f"{prefix}jobs"
        try:
            # One immediate retry replaces a connection that died while idle (a restarted Redis), and keeps an
            # outage's answer within two timeouts (the client's default is ten retries with backoff).
            self._client = redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1)
            )
        except ValueError as error:
            raise ConfigError(f"redis_url {self._url!r} is not a Redis URL ({error})") from error
        with self._answering("answering PING"):
            self._client.ping()

    def save(self, job: Job) -> None:
        """Insert or update the record; its cancel request stays as it is."""
        data = {f.name: getattr(job, f.name) for f in fields(Job)}
        data["state"] = job.state.value
        # ASCII escapes: any str, even a lone surrogate, goes into Redis and comes back the same.
        record = json.dumps(data)
        with self._answering(f"saving job {job.id}"), self._client.pipeline(transaction=True) as pipe:
            pipe.hset(self._key(job.id), "record", record)
            pipe.zadd(self._index, {job.id: job.created_at})
            pipe.execute()

    def all(self) -> list[Job]:
        """Every job, oldest first."""
        with self._answering("listing jobs"):
            ids = cast("list[bytes]", self._client.zrange(self._index, 0, -1))  # bytes: no decode_responses
            with self._client.pipeline(transaction=False) as pipe:
                for job_id in ids:
                    pipe.hget(self._key(job_id.decode()), "record")
                records: list[bytes | None] = pipe.execute()
        return [_job_from_json(record) for record in records if record is not None]

    def get(self, job_id: str) -> Job | None:
        """One job, or None."""
        with self._answering(f"reading job {job_id}"):
            record: bytes | str | None = self._client.hget(self._key(job_id), "record")
        return None if record is None else _job_from_json(record)

    def request_cancel(self, job_id: str, mark_cancelled: bool) -> None:
        """Ask the job's owner to cancel it; `mark_cancelled` also records it cancelled (a queued job)."""
        key = self._key(job_id)

        def cancel(pipe: Pipeline) -> None:
            # Runs under WATCH: a save in between makes EXEC fail and redis-py run this again on the new record.
            record: bytes | str | None = pipe.hget(key, "record")
            if record is None:
                return  # an unknown job: nothing to flag, as in JobStore
            pipe.multi()
            pipe.hset(key, "cancel", "1")
            if mark_cancelled:
                data = json.loads(record)
                data.update(state=JobState.CANCELLED.value, error="cancelled while queued", finished_at=time.time())
                pipe.hset(key, "record", json.dumps(data))

        with self._answering(f"requesting the cancel of job {job_id}"):
            self._client.transaction(cancel, key)

    def is_cancel_requested(self, job_id: str) -> bool:
        """Whether any server process asked to cancel the job."""
        with self._answering(f"reading the cancel request of job {job_id}"):
            return bool(self._client.hexists(self._key(job_id), "cancel"))

    def close(self) -> None:
        """Close the connections."""
        with self._answering("closing the connections"):
            self._client.close()

    def _key(self, job_id: str) -> str:
        return f"{self._prefix}jobs:{job_id}"

    @contextmanager
    def _answering(self, action: str) -> Iterator[None]:
        import redis

        try:
            yield
        except redis.RedisError as error:
            failed = "did not answer" if isinstance(error, redis.ConnectionError | redis.TimeoutError) else "failed"
            raise NotReadyError(
                f"training job records are unavailable: Redis at {self._url} {failed} while {action} "
                f"({type(error).__name__}: {error})"
            ) from error


def records_dir(jobs_dir: Path | None, repository: Path) -> Path:
    """Where job records and their data live: `jobs_dir` when set; else `<repository>/.jobs`, unless that cannot
    be written (a read-only repository), then `~/.cache/layerserve/jobs`."""
    if jobs_dir is not None:
        return jobs_dir
    from layerserve.lifecycle.repository import write_problem

    inside = repository / ".jobs"
    if not write_problem(inside if inside.is_dir() else repository):
        return inside
    return Path.home() / ".cache" / "layerserve" / "jobs"


def open_job_store(records_dir: Path, redis_url: str | None, prefix: str, timeout_s: float) -> JobRecords:
    """RedisJobStore on `redis_url` when one is set (replicas on several machines), else JobStore in `records_dir`."""
    if redis_url:
        return RedisJobStore(redis_url, prefix, timeout_s)
    return JobStore(records_dir / "jobs.sqlite3")


_JOB_FIELDS = frozenset(f.name for f in fields(Job))


def _job_from_json(record: bytes | str) -> Job:
    # Fields this layerserve does not know (a newer replica's) are left out rather than failing every read.
    data = {name: value for name, value in json.loads(record).items() if name in _JOB_FIELDS}
    data["state"] = JobState(data["state"])
    return Job(**data)


def _without_password(url: str) -> str:
    """The URL as it can be shown: without a password in the user part or the query."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(an unreadable URL)"
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "password"])
    return urlunsplit(parts._replace(netloc=f"{user}@{hostport}" if user else hostport, query=query))
