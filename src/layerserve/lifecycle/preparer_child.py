"""The preparer's child process, `python -m layerserve.lifecycle.preparer_child FD`: runs the jobs that the server's
Preparer sends over its connection (file descriptor FD), one at a time, each a (function, args) of layerserve's,
and answers each with ("done", result) or ("error", the exception)."""

from __future__ import annotations

import logging
import os
import signal
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from layerserve.child_process import parent_connection
from layerserve.lifecycle.prepare import exit_with_parent, lower_priority
from layerserve.logs import import_tensorflow_quietly


def main() -> None:
    """Run at background priority (set before TensorFlow starts its threads), quiet, dying with the server; serve
    its jobs."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal reaches the server, which stops us
    connection = parent_connection()
    exit_with_parent()
    lower_priority()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s (preparer): %(message)s")
    import_tensorflow_quietly()  # every preparation loads a Keras model
    serve(connection)
    # At once: the interpreter's teardown (TensorFlow's threads and exit handlers) takes seconds at background
    # priority, holding the memory this exit gives back; every record is already whole on disk.
    os._exit(0)


def serve(connection: Connection) -> None:
    """Answer each job, until the server closes the connection."""
    while True:
        try:
            function, args = connection.recv()  # from the server that started this process, over its own socket
        except EOFError:  # the server is gone, or stopped us
            return
        except Exception as error:  # a job that cannot be read here: its caller gets the error
            connection.send(("error", _transferable(error)))
            continue
        try:
            answer: tuple[str, Any] = ("done", function(*args))
        except Exception as error:  # the job's boundary: its caller in the server gets the error, with our traceback
            answer = ("error", _transferable(error))
        connection.send(answer)


def _transferable(error: Exception) -> Exception:
    """The error, noting the traceback in this process, if it survives pickling; else a RuntimeError that names it."""
    error.add_note("in the preparer's child process:\n" + "".join(traceback.format_tb(error.__traceback__)))
    try:
        ForkingPickler.loads(ForkingPickler.dumps(error))
    except Exception:  # some libraries' errors do not pickle (required arguments, unpicklable state)
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


if __name__ == "__main__":
    main()
