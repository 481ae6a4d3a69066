"""ProcessOnnxEngine: an ONNX Runtime session in an engine process; `run` sends the batch there and waits."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

from layerserve.engines.base import EngineKind
from layerserve.engines.process.pool import EngineHost, EngineProcessPool
from layerserve.errors import EngineProcessError, ModelLoadError
from layerserve.tensors import Array, TensorSpec

_RELEASE_TIMEOUT_S = 10.0


class ProcessOnnxEngine:
    """An ONNX Runtime session in an engine process (shared with other sessions, each on a connection of its
    own); `run` sends the batch there and waits."""

    name = EngineKind.ONNX
    in_process = False
    lanes = 2  # a full batch crosses to the process while the one before it runs

    def __init__(
        self, pool: EngineProcessPool, path: Path, inputs: tuple[TensorSpec, ...], threads: int, warmup_rows: int
    ) -> None:
        """Open the session in an engine process of the pool and run a `warmup_rows` probe batch.

        Raises:
            ModelLoadError: ONNX Runtime could not open the graph, or no process could start.
        """
        self._pool = pool
        self._graph = path.name
        host = pool.take()
        try:
            channels = host.open_session(path, inputs, threads, warmup_rows, self.lanes)
        except (EOFError, OSError):
            pool.session_closed(host)
            raise ModelLoadError(host.gone(self._graph)) from None
        try:
            tag, body = channels[0].receive(copy=True)
        except (EOFError, OSError):
            tag, body = "gone", None
        if tag != "ready":
            for channel in channels:
                channel.connection.close()
            pool.session_closed(host)
            if tag == "gone":
                raise ModelLoadError(host.gone(self._graph))
            raise ModelLoadError(f"ONNX Runtime could not open {path.name}: {body}")
        self._host: EngineHost | None = host
        # One lock per lane: a batch holds its lane's channel (and shared memory) until its answer is read.
        self._lanes = [(threading.Lock(), channel) for channel in channels]
        self.session_bytes = int(body)
        host.session_bytes += self.session_bytes

    @property
    def pid(self) -> int | None:
        """The process the session is in (None once closed)."""
        return self._host.process.pid if self._host else None

    def resident(self) -> tuple[int, int]:
        """(What opening its session added to its engine process, its share of the rest of that process's
        memory: the process's own and its shared arena, split evenly between its sessions); (0, 0) once closed."""
        host = self._host
        if host is None or host.sessions <= 0:
            return 0, 0
        rest = max(0, host.resident_bytes() - host.session_bytes)
        return self.session_bytes, rest // host.sessions

    def run(self, inputs: list[Array]) -> list[Array]:
        """Compute the outputs for one batch, in the engine's process, on a free lane (the first, if none is).

        Raises:
            EngineProcessError: the process is gone (killed, out of memory, crashed), or the engine closed.
            RuntimeError: ONNX Runtime refused the batch (its message).
        """
        lock, channel = next(((lock, c) for lock, c in self._lanes if lock.acquire(blocking=False)), (None, None))
        if lock is None or channel is None:
            lock, channel = self._lanes[0]
            lock.acquire()
        try:
            host = self._host
            if host is None:
                raise EngineProcessError(f"the engine of {self._graph} is closed")
            try:
                channel.send_arrays(inputs)
                tag, body = channel.receive(copy=True)
            except (EOFError, OSError):
                raise EngineProcessError(host.gone(self._graph)) from None
        finally:
            lock.release()
        if tag == "error":
            raise RuntimeError(body)
        results: list[Array] = body
        return results

    def close(self) -> None:
        """Free the session in its process (after the batches it runs); a process left without sessions is kept
        for the next one or stopped, and a stopped process returns all its memory."""
        for lock, _ in self._lanes:
            lock.acquire()
        try:
            host, self._host = self._host, None
            if host is None:
                return
            (_, first), *others = self._lanes
            for _, channel in others:  # the process's lane threads end, then the session is released
                channel.connection.close()
            with contextlib.suppress(EOFError, OSError):
                first.send("release")
                if first.connection.poll(_RELEASE_TIMEOUT_S):
                    first.receive(copy=True)
            first.connection.close()
        finally:
            for lock, _ in self._lanes:
                lock.release()
        host.session_bytes -= self.session_bytes
        self._pool.session_closed(host)
