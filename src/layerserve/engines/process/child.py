"""The engine process: sessions of several versions, each served by a thread of its own over a connection of its
own; model files hashed at the lowest priority."""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import threading
from collections.abc import Iterator
from multiprocessing import reduction
from multiprocessing.connection import Connection
from pathlib import Path

from layerserve.engines.base import probe_batch
from layerserve.engines.onnx import OnnxEngine, share_arena
from layerserve.engines.process.channel import Channel
from layerserve.engines.process.usage import process_usage
from layerserve.lifecycle.model import file_digest
from layerserve.tensors import Array, TensorSpec


def serve(connection: Connection) -> None:
    """The engine process's control connection: open a session (on the connection that comes with the message,
    served by a thread of its own), hash a file, stop; until told to stop or the server is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal reaches the server, which stops us
    channel = Channel(connection)
    share_arena()
    while True:
        try:
            tag, body = channel.receive(copy=False)
        except EOFError:  # the server is gone
            return
        if tag == "open":
            *opening, lanes = body
            own = [Channel(Connection(reduction.recv_handle(connection))) for _ in range(lanes)]
            threading.Thread(target=_session, args=(own, *opening), name="session", daemon=True).start()
        elif tag == "digest":
            try:
                with _low_priority():
                    channel.send("digest", file_digest(Path(body)))
            except OSError as error:
                channel.send("error", str(error))
        elif tag == "stop":
            usage = resource.getrusage(resource.RUSAGE_SELF)
            channel.send("stopped", usage.ru_utime + usage.ru_stime)
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, 0, 19)  # the exit returns its memory: that too on idle CPU
            return
        else:
            channel.send("error", f"unexpected {tag!r} message")


def _session(channels: list[Channel], path: str, inputs: tuple[TensorSpec, ...], threads: int, rows: int) -> None:
    """One version's session: open and warm it up, answer its batches, free it when released (or when the server
    closes its first connection). Each further connection is a lane served by a thread of its own: its batch is
    read while another lane's runs, and runs as soon as that one ends (one at a time: each uses all the session's
    threads)."""
    first, *others = channels
    engine = _open(first, path, inputs, threads, rows)
    running = threading.Lock()
    lanes = [threading.Thread(target=_lane, args=(lane, engine, running), name="lane", daemon=True)
             for lane in others if engine is not None]  # fmt: skip
    for lane in lanes:
        lane.start()
    while engine is not None:
        try:
            tag, body = first.receive(copy=False)
        except EOFError:
            break
        if tag == "arrays":
            _run(first, engine, body, running)
        elif tag == "release":
            for lane in lanes:  # the server closed the other lanes before it released the session
                lane.join(timeout=10)
            with _low_priority():
                engine = None  # ORT's destructor: joins the session's threads, returns its memory
                _trim_heap()
            first.send("released")
        else:
            first.send("error", f"unexpected {tag!r} message")
        del body
    for channel in channels:
        channel.connection.close()


def _lane(channel: Channel, engine: OnnxEngine, running: threading.Lock) -> None:
    """A further lane of a session: answer its batches until the server closes it."""
    while True:
        try:
            tag, body = channel.receive(copy=False)
        except (EOFError, OSError):
            return
        if tag == "arrays":
            _run(channel, engine, body, running)
        else:
            channel.send("error", f"unexpected {tag!r} message")
        del body


def _run(channel: Channel, engine: OnnxEngine, inputs: list[Array], running: threading.Lock) -> None:
    """Run one batch (once no other lane's runs) and send its outputs, or ORT's message (it raises many kinds) for
    the request."""
    try:
        with running:
            results = engine.run(inputs)
    except Exception as error:
        channel.send("error", _describe(error))
    else:
        channel.send_arrays(results)


def _open(channel: Channel, path: str, inputs: tuple[TensorSpec, ...], threads: int, rows: int) -> OnnxEngine | None:
    """Open and warm up a session (at the lowest priority where it can be restored after); answer ready with the
    resident memory it added to the process, or the error."""
    before = process_usage()[1]
    try:
        with _low_priority():
            engine = OnnxEngine(Path(path), inputs, threads, shared_arena=True)
            engine.run(probe_batch(inputs, rows))
            _trim_heap()  # what parsing the graph took, freed in this thread's malloc arena
    except Exception as error:  # ORT raises many kinds; the version shows the message as its FAILED reason.
        channel.send("error", _describe(error))
        return None
    channel.send("ready", max(0, process_usage()[1] - before))
    return engine


def _trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc keeps them after a session is freed)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@contextlib.contextmanager
def _low_priority() -> Iterator[None]:
    """This thread, and the threads it starts, at the lowest priority, if it can be restored after."""
    lowered = _lower_priority()
    try:
        yield
    finally:
        if lowered:
            _restore_priority()


def _lower_priority() -> bool:
    """Lowest priority for this thread and the session threads it starts, if it can be restored after."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 1)
        os.setpriority(os.PRIO_PROCESS, 0, 0)  # EPERM without CAP_SYS_NICE: then stay at the normal one
        os.setpriority(os.PRIO_PROCESS, 0, 19)
    except OSError:
        return False
    return True


def _restore_priority() -> None:
    """Every thread of this process back to the normal priority."""
    for thread in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError, ValueError):
            os.setpriority(os.PRIO_PROCESS, int(thread.name), 0)


def _describe(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:500] if text else type(error).__name__
