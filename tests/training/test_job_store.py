"""Training job records in SQLite (JobStore) and Redis (RedisJobStore, a redis-server of the tests' own): the
same tests for both, then Redis outages and older SQLite tables."""

from __future__ import annotations

import socket
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.client

from layerserve.errors import ConfigError, NotReadyError
from layerserve.training.job_store import Job, JobRecords, JobState, JobStore, RedisJobStore, open_job_store
from tests.live_server import free_port
from tests.redis_server import RedisServer

OpenStore = Callable[[], JobRecords]


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the module's shared-store tests; each test has a key prefix of its own."""
    server = RedisServer()
    server.start()
    yield server
    server.kill()


@pytest.fixture(params=["sqlite", "redis"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OpenStore]:
    """Opens another store object on the same records each call, as another replica would; all closed after."""
    opened: list[JobRecords] = []
    redis_url = request.getfixturevalue("redis_server").url if request.param == "redis" else None
    prefix = f"test-{uuid.uuid4().hex[:8]}:"

    def open_one() -> JobRecords:
        store = open_job_store(tmp_path / "records", redis_url, prefix, 5.0)
        assert isinstance(store, RedisJobStore if redis_url else JobStore)
        opened.append(store)
        return store

    yield open_one
    for store in opened:
        store.close()


def every_field_job(job_id: str = "a1b2c3d4e5f60718", **changes: Any) -> Job:
    """A job with every field set, unicode in its text fields."""
    job = Job(
        id=job_id,
        model="评论-classifier",
        params={"epochs": 3, "rate": 0.1 + 0.2, "labels": ["正面", "负面", "😀"], "nested": {"none": None}},
        apply=True,
        rows=12,
        state=JobState.RUNNING,
        created_at=1_700_000_000.123456789,
        started_at=1_700_000_001.987654321,
        finished_at=1_700_000_002.5,
        progress={"epoch": 2, "loss": 0.123456789012345, "note": "ça va"},
        history=[{"epoch": 1, "loss": 0.5}, {"epoch": 2, "loss": 0.25}],
        version=7,
        error="échec: 失败",
        owner=4242,
        host="节点-01.example",
        pid=4343,
    )
    for name, value in changes.items():
        setattr(job, name, value)
    return job


def test_a_job_comes_back_exactly_as_saved(open_store: OpenStore) -> None:
    store = open_store()
    full = every_field_job()
    sparse = Job("sparse", "m", {}, False, 0, created_at=1.0)  # None and empty values, the defaults
    store.save(full)
    store.save(sparse)
    for reader in (store, open_store()):
        got = reader.get(full.id)
        assert got == full and type(got.state) is JobState
        assert reader.get("sparse") == sparse
        assert (sparse.started_at, sparse.version, sparse.pid, sparse.host) == (None, None, None, socket.gethostname())
    full.state, full.progress = JobState.SUCCEEDED, {"epoch": 3}
    store.save(full)  # an update, not a second record
    assert [job.id for job in store.all()] == ["sparse", full.id] and store.get(full.id) == full


def test_all_is_oldest_first(open_store: OpenStore) -> None:
    store = open_store()
    for job_id, created_at in [("c", 30.0), ("a", 10.0), ("b", 20.0)]:
        store.save(every_field_job(job_id, created_at=created_at))
    assert [job.id for job in store.all()] == ["a", "b", "c"]
    assert open_store().all() == store.all()


def test_unknown_ids(open_store: OpenStore) -> None:
    store = open_store()
    store.save(every_field_job("known"))
    assert store.get("unknown") is None and store.get("") is None and store.get("known:cancel") is None
    store.request_cancel("unknown", mark_cancelled=True)  # nothing to cancel: no error, no record
    assert not store.is_cancel_requested("unknown") and store.get("unknown") is None
    store.save(every_field_job("unknown"))  # a job saved later under that id was never asked to cancel
    assert not store.is_cancel_requested("unknown") and not store.is_cancel_requested("known")


def test_save_does_not_clear_a_cancel_request(open_store: OpenStore) -> None:
    owner, other = open_store(), open_store()
    job = every_field_job()
    owner.save(job)
    other.request_cancel(job.id, mark_cancelled=False)
    assert owner.is_cancel_requested(job.id) and owner.get(job.id) == job  # the record itself is unchanged
    job.progress = {"epoch": 3}
    owner.save(job)
    assert owner.is_cancel_requested(job.id) and other.is_cancel_requested(job.id)
    assert other.get(job.id) == job


def test_request_cancel_marks_a_queued_job_cancelled(open_store: OpenStore) -> None:
    store = open_store()
    job = every_field_job(state=JobState.QUEUED, started_at=None, finished_at=None, error="")
    store.save(job)
    before = time.time()
    open_store().request_cancel(job.id, mark_cancelled=True)
    got = store.get(job.id)
    assert got is not None and store.is_cancel_requested(job.id)
    assert (got.state, got.error) == (JobState.CANCELLED, "cancelled while queued")
    assert got.finished_at is not None and before <= got.finished_at <= time.time()
    assert got == replace(job, state=JobState.CANCELLED, error="cancelled while queued", finished_at=got.finished_at)


def test_two_store_objects_share_records_as_two_replicas_would(open_store: OpenStore) -> None:
    first, second = open_store(), open_store()
    one, two = every_field_job("one", created_at=1.0), every_field_job("two", created_at=2.0, host="other-host")
    first.save(one)
    second.save(two)
    assert first.all() == second.all() == [one, two]
    one.state = JobState.FAILED
    first.save(one)
    assert second.get("one") == one
    second.request_cancel("two", mark_cancelled=False)
    assert first.is_cancel_requested("two") and not first.is_cancel_requested("one")


def test_a_save_during_mark_cancelled_is_kept(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner saving between request_cancel's read and write: the write is done again on the new record."""
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    canceller, owner = RedisJobStore(redis_server.url, prefix, 5.0), RedisJobStore(redis_server.url, prefix, 5.0)
    job = every_field_job(state=JobState.QUEUED, finished_at=None, error="")
    owner.save(job)
    real_hget = redis.client.Pipeline.hget
    reads: list[str] = []

    def hget_then_owner_saves(pipe: redis.client.Pipeline, *args: Any) -> Any:
        value = real_hget(pipe, *args)
        reads.append(args[0])
        if len(reads) == 1:
            owner.save(every_field_job(state=JobState.QUEUED, finished_at=None, error="", progress={"epoch": 9}))
        return value

    monkeypatch.setattr(redis.client.Pipeline, "hget", hget_then_owner_saves)
    try:
        canceller.request_cancel(job.id, mark_cancelled=True)
        monkeypatch.undo()
        got = owner.get(job.id)
        assert len(reads) == 2  # the first EXEC failed on the owner's save and the cancel ran again
        assert got is not None and (got.state, got.progress) == (JobState.CANCELLED, {"epoch": 9})
        assert owner.is_cancel_requested(job.id)
    finally:
        canceller.close()
        owner.close()


def test_redis_outage_is_not_ready_and_the_store_recovers() -> None:
    server = RedisServer()
    server.start()
    try:
        store = RedisJobStore(server.url, "outage:", 1.0)
        job = every_field_job()
        store.save(job)
        server.kill()
        calls: list[tuple[str, Callable[[], object]]] = [
            (f"saving job {job.id}", lambda: store.save(job)),
            ("listing jobs", store.all),
            (f"reading job {job.id}", lambda: store.get(job.id)),
            (f"requesting the cancel of job {job.id}", lambda: store.request_cancel(job.id, mark_cancelled=True)),
            (f"reading the cancel request of job {job.id}", lambda: store.is_cancel_requested(job.id)),
        ]
        for action, call in calls:
            with pytest.raises(NotReadyError) as raised:
                call()
            assert raised.value.status_code == 503 and not isinstance(raised.value, redis.RedisError)
            assert isinstance(raised.value.__cause__, redis.ConnectionError)
            assert raised.value.message.startswith(
                f"training job records are unavailable: Redis at {server.url} did not answer while {action} ("
            ), raised.value.message
        with pytest.raises(NotReadyError, match="did not answer while answering PING"):
            RedisJobStore(server.url, "outage:", 1.0)
        server.start()  # the same port, empty (nothing is kept on disk)
        assert store.get(job.id) is None
        store.save(job)
        assert store.all() == [job] and RedisJobStore(server.url, "outage:", 1.0).get(job.id) == job
        store.close()
    finally:
        server.kill()


def test_messages_leave_the_password_out_and_a_bad_url_is_a_config_error() -> None:
    port = free_port()  # nobody listens there
    url = f"redis://alice:s3cret@127.0.0.1:{port}/2?password=s3cret2&socket_keepalive=true"
    with pytest.raises(NotReadyError) as raised:
        RedisJobStore(url, "x:", 1.0)
    assert "s3cret" not in raised.value.message
    assert f"Redis at redis://alice@127.0.0.1:{port}/2?socket_keepalive=true did not answer" in raised.value.message
    with pytest.raises(NotReadyError) as raised:
        RedisJobStore(f"redis://:s3cret@127.0.0.1:{port}/0", "x:", 1.0)
    assert f"Redis at redis://127.0.0.1:{port}/0 did not answer" in raised.value.message
    with pytest.raises(ConfigError, match="is not a Redis URL"):
        RedisJobStore("http://127.0.0.1:6379/0", "x:", 1.0)


def test_a_sqlite_table_without_the_host_column_still_opens(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    old = sqlite3.connect(path)
    old.execute(
        "CREATE TABLE jobs (id TEXT PRIMARY KEY, model TEXT, params TEXT, apply INTEGER, rows INTEGER, state TEXT, "
        "created_at REAL, started_at REAL, finished_at REAL, progress TEXT, history TEXT, version INTEGER, "
        "error TEXT, owner INTEGER, pid INTEGER, cancel_requested INTEGER DEFAULT 0)"
    )
    old.execute(
        "INSERT INTO jobs VALUES ('old', 'reviews', '{\"epochs\": 2}', 1, 10, 'running', 1.5, 2.5, NULL, '{}', "
        "'[]', NULL, '', 77, 78, 1)"
    )
    old.commit()
    old.close()
    store = JobStore(path)
    try:
        got = store.get("old")
        assert got == Job("old", "reviews", {"epochs": 2}, True, 10, JobState.RUNNING, 1.5, 2.5, owner=77, pid=78)
        assert got.host == socket.gethostname()  # the file is local: its older records are this machine's
        assert store.is_cancel_requested("old")
        new = every_field_job(created_at=3.0)
        store.save(new)
        assert store.all() == [got, new]
    finally:
        store.close()
    JobStore(path).close()  # opening the upgraded table again changes nothing
