"""ChildProcess: a process of layerserve's own (an engine process, the preparer's child), a fresh interpreter that
runs one of layerserve's modules, `python -m <module> FD`, and a connection to it.

Not multiprocessing's spawn or fork server: their children import the parent's `__main__` module again, so a
user's script without a `__main__` guard (an app.py that builds a BlockingRuntime) ran once more in every child of
layerserve, loading every model there. The connection is a Unix socket, so that file descriptors cross it
(`multiprocessing.reduction.send_handle`); the child's end is its file descriptor FD.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from multiprocessing.connection import Connection


class ChildProcess:
    """`python -m module FD`, started now, with a connection to it; its stdout and stderr are this process's."""

    def __init__(self, module: str) -> None:
        """Start the child.

        Raises:
            OSError: it could not start.
        """
        ours, theirs = socket.socketpair()
        with theirs:
            try:
                self._popen = subprocess.Popen(
                    [sys.executable, "-m", module, str(theirs.fileno())],
                    stdin=subprocess.DEVNULL,
                    pass_fds=(theirs.fileno(),),
                )
            except BaseException:
                ours.close()
                raise
        self.connection = Connection(ours.detach())
        self.pid = self._popen.pid

    def is_alive(self) -> bool:
        """Whether it still runs (it is reaped once it has ended)."""
        return self._popen.poll() is None

    def wait(self, timeout_s: float) -> int | None:
        """Its exit status once it has ended (negative: the signal that ended it), None if it still runs after
        `timeout_s`."""
        try:
            return self._popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def terminate(self) -> None:
        """SIGTERM (nothing once it has ended)."""
        self._popen.terminate()

    def kill(self) -> None:
        """SIGKILL (nothing once it has ended)."""
        self._popen.kill()


def parent_connection() -> Connection:
    """(In the child) the connection to the process that started it."""
    return Connection(int(sys.argv[-1]))
