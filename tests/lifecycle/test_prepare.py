"""The preparer's child process dies with the server that started it (a killed worker leaves no orphan), a server
that stops does not wait for the job its child runs, and with `preparer_idle_s` 0 the child exits once a start's
loads are done."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from layerserve.errors import ModelLoadError
from layerserve.lifecycle.prepare import Preparer
from tests.live_server import (
    free_port,
    is_running,
    preparer_children,
    server_log,
    start_server_process,
    wait_process_ready,
    wait_until,
)
from tests.models import build_mlp, build_multi, save_model

_SERVER = """
import os, time
from layerserve.lifecycle.prepare import Preparer
print(Preparer()._run(os.getpid), flush=True)  # starts the child; its pid
time.sleep(600)
"""


def test_the_child_exits_when_its_server_is_killed() -> None:
    with subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True) as server:
        assert server.stdout is not None
        child = int(server.stdout.readline())
        assert child != server.pid and is_running(child)
        os.kill(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
    wait_until(lambda: not is_running(child), "the preparer's child ends with its server", 15)


def test_close_stops_a_busy_child_at_once_and_its_caller_gets_an_error() -> None:
    preparer = Preparer()
    child = preparer._run(os.getpid)
    errors: list[Exception] = []

    def long_job() -> None:  # as a slow export would: a job the server must not wait for when it stops
        try:
            preparer._run(time.sleep, 120)
        except Exception as error:
            errors.append(error)

    caller = threading.Thread(target=long_job)
    caller.start()
    time.sleep(0.5)  # the job has reached the child
    started = time.monotonic()
    preparer.close()
    caller.join(timeout=30)
    assert not caller.is_alive() and time.monotonic() - started < 15
    assert not is_running(child)
    assert len(errors) == 1 and isinstance(errors[0], ModelLoadError), errors


@pytest.mark.slow
def test_a_jobs_error_is_raised_here_and_an_idle_child_stops() -> None:
    preparer = Preparer(idle_s=0.5)
    try:
        with pytest.raises(ValueError, match="invalid literal") as raised:
            preparer._run(int, "not a number")  # the job's own error, as a call here would raise it
        assert any("preparer's child process" in note for note in raised.value.__notes__)
        child = preparer._run(os.getpid)  # the child serves on after a failed job
        assert child != os.getpid() and is_running(child)
        wait_until(lambda: not is_running(child), "the idle child stops", 30)
        assert preparer._run(os.getpid) not in (child, os.getpid())  # the next job starts a new one
    finally:
        preparer.close()


@pytest.mark.slow
def test_a_held_stretch_keeps_one_child_and_idle_0_ends_it_with_the_stretch() -> None:
    preparer = Preparer(idle_s=0)
    try:
        with preparer.held():  # as a start's loads, one after the other
            first = preparer._run(os.getpid)
            assert preparer._run(os.getpid) == first and is_running(first)  # not stopped between the jobs
        wait_until(lambda: not is_running(first), "the child exits once nothing is pending", 30)
    finally:
        preparer.close()


@contextlib.contextmanager
def _serving(repo: Path, cache: Path, *flags: str) -> Iterator[int]:
    """`layerserve serve` in a process, ready; its pid."""
    port = free_port()
    process = start_server_process(repo, cache, port, *flags)
    try:
        wait_process_ready(f"http://127.0.0.1:{port}", process, server_log(repo))
        yield process.pid
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0


@pytest.mark.slow
def test_with_preparer_idle_s_0_the_child_is_gone_after_the_starts_loads(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    save_model(build_mlp(1), repo / "mlp" / "1", "model.keras")
    save_model(build_multi(), repo / "multi" / "1", "model.keras")
    with _serving(repo, tmp_path / "cold", "--preparer-idle-s", "600") as server:
        assert len(list((tmp_path / "cold").glob("*.onnx"))) == 2  # both models were exported at this start
        assert len(preparer_children(server)) == 1  # kept a while for the next load
    with _serving(repo, tmp_path / "cold-too", "--preparer-idle-s", "0") as server:
        assert len(list((tmp_path / "cold-too").glob("*.onnx"))) == 2
        wait_until(lambda: not preparer_children(server), "the preparer's child exits after the start's loads", 60)
