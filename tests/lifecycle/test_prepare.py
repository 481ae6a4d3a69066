"""The preparer's child process dies with the server that started it (a killed worker leaves no orphan)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

_SERVER = """
import os, time
from layerserve.lifecycle.prepare import Preparer
print(Preparer()._run(os.getpid), flush=True)  # starts the child; its pid
time.sleep(600)
"""


def _is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_child_exits_when_its_server_is_killed() -> None:
    with subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True) as server:
        assert server.stdout is not None
        child = int(server.stdout.readline())
        assert child != server.pid and _is_running(child)
        os.kill(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
    deadline = time.monotonic() + 15
    while _is_running(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _is_running(child), "the preparer's child outlived the server"
