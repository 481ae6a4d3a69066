"""The engine process: sessions of several versions, each served by a thread of its own over a connection of its
own; model files hashed at the lowest priority."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import threading
from collections.abc import Iterator
from multiprocessing import reduction
from multiprocessing.connection import Connection
from pathlib import Path

from layerserve.child_process import parent_connection
from layerserve.engines.base import probe_batch
from layerserve.engines.onnx import OnnxEngine, share_arena
from layerserve.engines.process.channel import Channel
from layerserve.engines.process.usage import process_usage, trim_heap
from layerserve.lifecycle.model import file_digest
from layerserve.tensors import Array, TensorSpec


def main() -> None:
    """`python -m layerserve.engines.process.child FD`: serve the server's connection, file descriptor FD."""
    serve(parent_connection())


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
            path, inputs, threads, rows, lanes = body
            own = [Channel(Connection(reduction.recv_handle(connection))) for _ in range(lanes)]
            args = (own[0], own[1:], path, inputs, threads, rows)
            threading.Thread(target=_session, args=args, name="session", daemon=True).start()
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


def _session(
    channel: Channel, lanes: list[Channel], path: str, inputs: tuple[TensorSpec, ...], threads: int, rows: int
) -> None:
    """One version's session: open and warm it up, answer its batches, free it when released (or when the server
    closes its connection). Each of `lanes` answers batches too, at the same time, on a thread of its own."""
    engine = _open(channel, path, inputs, threads, rows)
    helpers = []
    if engine is not None:
        for lane in lanes:
            helper = threading.Thread(target=_lane, args=(lane, engine), name="session-lane", daemon=True)
            helper.start()
            helpers.append(helper)
    while engine is not None:
        try:
            tag, body = channel.receive(copy=False)
        except EOFError:
            break
        if tag == "arrays":
            _run(channel, engine, body)
        elif tag == "release":
            for helper in helpers:  # the server closed their connections first
                helper.join()
            with _low_priority():
                engine = None  # ORT's destructor: joins the session's threads, returns its memory
                trim_heap()
            _SHRINK_ARENA.set()
            channel.send("released")
        else:
            channel.send("error", f"unexpected {tag!r} message")
        del body
    channel.connection.close()


def _lane(channel: Channel, engine: OnnxEngine) -> None:
    """Answer a session's batches on one more connection, until the server closes it."""
    while True:
        try:
            tag, body = channel.receive(copy=False)
        except EOFError:
            break
        try:
            if tag == "arrays":
                _run(channel, engine, body)
            else:
                channel.send("error", f"unexpected {tag!r} message")
        except OSError:  # the server closed the lane without waiting for its batch (see ProcessOnnxEngine.close)
            break
        finally:
            del body
    channel.connection.close()


# A session was freed: the next batch of any session gives the shared arena's free chunks back. The arena keeps what
# the largest batch of every session it served took (~100 MB for EfficientNet-Lite0 at batch 8), which a memory
# budget cannot unload (docs/many-models.md).
_SHRINK_ARENA = threading.Event()


def _run(channel: Channel, engine: OnnxEngine, inputs: list[Array]) -> None:
    """Run one batch and send its outputs, or ORT's message (it raises many kinds) for the request."""
    shrink = _SHRINK_ARENA.is_set()
    if shrink:
        _SHRINK_ARENA.clear()
    try:
        results = engine.run_and_shrink(inputs) if shrink else engine.run(inputs)
    except Exception as error:
        channel.send("error", _describe(error))
    else:
        channel.send_arrays(results)
    if shrink:
        with _low_priority():
            trim_heap()  # what the arena gave back, out of this thread's malloc arena


def _open(channel: Channel, path: str, inputs: tuple[TensorSpec, ...], threads: int, rows: int) -> OnnxEngine | None:
    """Open and warm up a session (at the lowest priority where it can be restored after); answer ready with the
    resident memory it added to the process, or the error."""
    before = process_usage()[1]
    try:
        with _low_priority():
            engine = OnnxEngine(Path(path), inputs, threads, shared_arena=True)
            engine.run(probe_batch(inputs, rows))
            trim_heap()  # what parsing the graph took, freed in this thread's malloc arena
    except Exception as error:  # ORT raises many kinds; the version shows the message as its FAILED reason.
        channel.send("error", _describe(error))
        return None
    channel.send("ready", max(0, process_usage()[1] - before))
    return engine


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


if __name__ == "__main__":
    main()
