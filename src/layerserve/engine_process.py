"""ONNX Runtime sessions of big graphs, each in a process of its own.

Opening, warming up and freeing a session costs the process that does it. ORT's destructor runs under
the GIL and takes 2-6 ms for EfficientNet-lite0 (it frees the arena and thousands of small blocks, and
joins the session's threads), and the warm-up keeps both cores busy. In the server process, each reload
of a big model stalled the event loop that answers every other model. Here a session is opened, warmed
up and freed in its own process; the server hands each batch over through shared memory and waits with
the GIL released. The processes are forked from multiprocessing's fork server, which has imported ONNX
Runtime once, and a process whose session was closed is kept for the next one (up to `_KEPT_IDLE`): a
reload then opens a session in a process that already runs, rather than forking one and tearing another
down. Where the process may raise its priority back (CAP_SYS_NICE, or a RLIMIT_NICE that allows it), it
opens, warms up and frees sessions, and hashes big model files, at the lowest priority, and serves at the
normal one, so that a reload takes only idle CPU from the models that serve meanwhile.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
import multiprocessing
import os
import resource
import signal
import threading
from collections.abc import Iterator
from multiprocessing import reduction
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from layerserve.engine import OnnxEngine, probe_batch
from layerserve.errors import EngineProcessError, ModelLoadError
from layerserve.model import file_digest
from layerserve.tensors import Array, TensorSpec

log = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 10.0
_KEPT_IDLE = 2  # processes kept without a session (~11 MB private memory each), for the next versions
_hosts_lock = threading.Lock()
_idle: list[_Host] = []
_live: set[_Host] = set()
_stopped_cpu_seconds = 0.0


class ProcessOnnxEngine:
    """An ONNX Runtime session in a process of its own; `run` sends the batch there and waits."""

    name = "onnx"
    in_process = False

    def __init__(self, path: Path, inputs: tuple[TensorSpec, ...], threads: int, warmup_rows: int) -> None:
        """Open the session in a kept idle process, else in a new one, and run a `warmup_rows` probe batch.

        Raises:
            ModelLoadError: ONNX Runtime could not open the graph, or no process could start.
        """
        self._graph = path.name
        self._lock = threading.Lock()
        self._host: _Host | None = _take_host()
        try:
            self._host.channel.send("open", (str(path), inputs, threads, warmup_rows))
            tag, body = self._host.channel.receive(copy=True)
        except (EOFError, OSError):
            raise ModelLoadError(self._host.gone(self._graph)) from None
        if tag != "ready":
            _give_back(self._host)
            raise ModelLoadError(f"ONNX Runtime could not open {path.name}: {body}")

    @property
    def pid(self) -> int | None:
        """The process the session is in (None once closed)."""
        return self._host.process.pid if self._host else None

    def run(self, inputs: list[Array]) -> list[Array]:
        """Compute the outputs for one batch, in the engine's process.

        Raises:
            EngineProcessError: the process is gone (killed, out of memory, crashed), or the engine closed.
            RuntimeError: ONNX Runtime refused the batch (its message).
        """
        with self._lock:
            host = self._host
            if host is None:
                raise EngineProcessError(f"the engine of {self._graph} is closed")
            try:
                host.channel.send_arrays(inputs)
                tag, body = host.channel.receive(copy=True)
            except (EOFError, OSError):
                raise EngineProcessError(host.gone(self._graph)) from None
        if tag == "error":
            raise RuntimeError(body)
        results: list[Array] = body
        return results

    def close(self) -> None:
        """Free the session in its process (after the batch it runs), and keep the process for the next one
        or stop it; a stopped process returns all its memory."""
        with self._lock:
            host, self._host = self._host, None
        if host is not None:
            _give_back(host)


class _Host:
    """A process that opens one session at a time and runs batches on it."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["onnxruntime", __name__])
        connection, theirs = context.Pipe()
        self.channel = _Channel(connection)
        self.process = context.Process(target=_serve, args=(theirs,), name="layerserve-engine", daemon=True)
        try:
            self.process.start()
        finally:
            theirs.close()

    def release(self) -> bool:
        """Free its session; False if the process did not answer (it is stopped then)."""
        try:
            self.channel.send("release")
            if self.channel.connection.poll(_STOP_TIMEOUT_S):
                return self.channel.receive(copy=True)[0] == "released"
        except (EOFError, OSError):
            pass
        self.stop()
        return False

    def stop(self) -> None:
        """End the process (its memory goes back to the system with it)."""
        global _stopped_cpu_seconds
        with contextlib.suppress(EOFError, OSError):
            self.channel.send("stop")
            if self.channel.connection.poll(_STOP_TIMEOUT_S):
                tag, cpu_seconds = self.channel.receive(copy=True)
                if tag == "stopped":
                    with _hosts_lock:
                        _stopped_cpu_seconds += cpu_seconds
        self.channel.connection.close()
        self.process.join(_STOP_TIMEOUT_S)
        if self.process.is_alive():
            log.warning("engine process %d did not stop; killing it", self.process.pid)
            self.process.kill()
            self.process.join(_STOP_TIMEOUT_S)
        with _hosts_lock:
            _live.discard(self)

    def gone(self, graph: str) -> str:
        """Why the process stopped answering (it is reaped here), for the version's FAILED reason."""
        self.process.join(1.0)
        code = self.process.exitcode
        if code is None:
            how = "stopped answering"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with status {code}"
        self.stop()
        return f"the engine process of {graph} {how}; load the model again to start a new one"


def _take_host() -> _Host:
    """A kept idle process, else a new one.

    Raises:
        ModelLoadError: the process could not start.
    """
    with _hosts_lock:
        while _idle:
            host = _idle.pop()
            if host.process.is_alive():
                return host
            _live.discard(host)
    try:
        host = _Host()
    except OSError as error:
        raise ModelLoadError(f"could not start an engine process: {error}") from None
    with _hosts_lock:
        _live.add(host)
    return host


def _give_back(host: _Host) -> None:
    """Free the host's session; keep it idle for the next engine, or stop it if enough are kept."""
    if host.release():
        _keep_or_stop(host)


def _keep_or_stop(host: _Host) -> None:
    """Keep a host without a session idle for the next engine, or stop it if enough are kept."""
    with _hosts_lock:
        if len(_idle) < _KEPT_IDLE:
            _idle.append(host)
            return
    host.stop()


def model_file_digest(path: Path, process_min_bytes: int | None) -> str:
    """`file_digest(path)`: for a file of at least `process_min_bytes`, computed in an engine process at the
    lowest priority (hashing 19 MB takes a core for ~15 ms, beside the serving threads and their GIL).

    Raises:
        OSError: the file cannot be read (hashed here).
        ModelLoadError: the file cannot be read, or the process died (hashed in an engine process).
    """
    if process_min_bytes is None or not path.is_file() or path.stat().st_size < process_min_bytes:
        return file_digest(path)
    host = _take_host()
    try:
        host.channel.send("digest", str(path))
        tag, body = host.channel.receive(copy=True)
    except (EOFError, OSError):
        raise ModelLoadError(host.gone(path.name)) from None
    _keep_or_stop(host)
    if tag != "digest":
        raise ModelLoadError(f"could not read {path}: {body}")
    digest: str = body
    return digest


def stop_idle_processes() -> None:
    """Stop the kept idle processes (at shutdown, and in tests)."""
    with _hosts_lock:
        idle = list(_idle)
        _idle.clear()
    for host in idle:
        host.stop()


def engine_processes_usage() -> tuple[float, int]:
    """CPU seconds (the stopped processes' included) and resident bytes of the engine processes."""
    with _hosts_lock:
        cpu_seconds, hosts = _stopped_cpu_seconds, list(_live)
    resident = 0
    ticks, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
    for host in hosts:
        with contextlib.suppress(OSError, ValueError, IndexError, TypeError):
            fields = Path(f"/proc/{host.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu_seconds += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
            resident += int(Path(f"/proc/{host.process.pid}/statm").read_text().split()[1]) * page
    return cpu_seconds, resident


def _serve(connection: Connection) -> None:
    """The engine process: open a session, answer batches, free it, and so on, until told to stop or the
    server is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal reaches the server, which stops us
    channel = _Channel(connection)
    engine: OnnxEngine | None = None
    while True:
        try:
            tag, body = channel.receive(copy=False)
        except EOFError:  # the server is gone
            return
        if tag == "arrays" and engine is not None:
            _run(channel, engine, body)
        elif tag == "open":
            engine = _open(channel, *body)
        elif tag == "digest":
            try:
                with _low_priority():
                    channel.send("digest", file_digest(Path(body)))
            except OSError as error:
                channel.send("error", str(error))
        elif tag == "release":
            with _low_priority():
                engine = None  # ORT's destructor: joins the session's threads, returns its memory
                _trim_heap()
            channel.send("released")
        elif tag == "stop":
            usage = resource.getrusage(resource.RUSAGE_SELF)
            channel.send("stopped", usage.ru_utime + usage.ru_stime)
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, 0, 19)  # the exit returns its memory: that too on idle CPU
            return
        else:
            channel.send("error", f"unexpected {tag!r} message")
        del body


def _run(channel: _Channel, engine: OnnxEngine, inputs: list[Array]) -> None:
    """Run one batch and send its outputs, or ORT's message (it raises many kinds) for the request."""
    try:
        results = engine.run(inputs)
    except Exception as error:
        channel.send("error", _describe(error))
    else:
        channel.send_arrays(results)


def _open(channel: _Channel, path: str, inputs: tuple[TensorSpec, ...], threads: int, rows: int) -> OnnxEngine | None:
    """Open and warm up a session (at the lowest priority where it can be restored after); answer ready or
    the error."""
    try:
        with _low_priority():
            engine = OnnxEngine(Path(path), inputs, threads)
            engine.run(probe_batch(inputs, rows))
    except Exception as error:  # ORT raises many kinds; the version shows the message as its FAILED reason.
        channel.send("error", _describe(error))
        return None
    channel.send("ready")
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


_INLINE_BYTES = 64 << 10  # smaller arrays travel inside the message


class _Channel:
    """Arrays over a connection: small ones inside the message, larger ones through a shared memory buffer
    that the sending side owns and grows (its file descriptor crosses the socket once per growth).

    A 19 MB batch there and back took 64 ms through the socket alone, 9.5 ms through shared memory.
    """

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._outgoing: mmap.mmap | None = None
        self._incoming: mmap.mmap | None = None

    def send(self, tag: str, body: Any = None) -> None:
        """Send a message without arrays."""
        self.connection.send((tag, body))

    def send_arrays(self, arrays: list[Array]) -> None:
        """Send arrays (the receiver reads them before this side sends again)."""
        large = [not a.dtype.hasobject and a.nbytes > _INLINE_BYTES for a in arrays]
        needed = sum(_aligned(a.nbytes) for a, is_large in zip(arrays, large, strict=True) if is_large)
        if needed > (len(self._outgoing) if self._outgoing is not None else 0):
            self._grow(needed)
        layout: list[Any] = []
        offset = 0
        for array, is_large in zip(arrays, large, strict=True):
            if not is_large:
                layout.append(array)
                continue
            assert self._outgoing is not None
            np.frombuffer(self._outgoing, array.dtype, array.size, offset).reshape(array.shape)[...] = array
            layout.append((array.dtype.str, array.shape, offset))
            offset += _aligned(array.nbytes)
        self.send("arrays", layout)

    def _grow(self, needed: int) -> None:
        size = max(needed, 2 * len(self._outgoing) if self._outgoing is not None else 0)
        handle = os.memfd_create("layerserve-engine", os.MFD_CLOEXEC)
        try:
            os.ftruncate(handle, size)
            self._outgoing = mmap.mmap(handle, size)
            self.send("buffer", size)
            reduction.send_handle(self.connection, handle, 0)
        finally:
            os.close(handle)

    def receive(self, copy: bool) -> tuple[str, Any]:
        """The next message as (tag, body); arrays in shared memory are copied out when `copy`, else views
        valid until this side sends again."""
        while True:
            tag, body = self.connection.recv()
            if tag == "buffer":
                handle = reduction.recv_handle(self.connection)
                try:
                    self._incoming = mmap.mmap(handle, body)
                finally:
                    os.close(handle)
                continue
            if tag != "arrays":
                return tag, body
            arrays = []
            for item in body:
                if isinstance(item, tuple):
                    dtype, shape, offset = item
                    assert self._incoming is not None, "arrays in a buffer that never came"
                    view = np.frombuffer(self._incoming, np.dtype(dtype), math.prod(shape), offset).reshape(shape)
                    arrays.append(view.copy() if copy else view)
                else:
                    arrays.append(item)
            return tag, arrays


def _aligned(size: int) -> int:
    return -(-size // 64) * 64
