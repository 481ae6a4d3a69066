"""The preparer's child process dies with the server that started it (a killed worker leaves no orphan), and a
server that stops does not wait for the job its child runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from layerserve.errors import ModelLoadError
from layerserve.lifecycle.prepare import Preparer
from tests.live_server import is_running, wait_until

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
