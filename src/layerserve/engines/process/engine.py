"""ProcessOnnxEngine: an ONNX Runtime session in an engine process; `run` sends the batch there and waits."""

from __future__ import annotations

import threading
from pathlib import Path

from layerserve.engines.base import EngineKind
from layerserve.engines.process.pool import EngineHost, EngineProcessPool
from layerserve.errors import EngineProcessError, ModelLoadError
from layerserve.tensors import Array, TensorSpec


class ProcessOnnxEngine:
    """An ONNX Runtime session in a process of its own; `run` sends the batch there and waits."""

    name = EngineKind.ONNX
    in_process = False

    def __init__(
        self, pool: EngineProcessPool, path: Path, inputs: tuple[TensorSpec, ...], threads: int, warmup_rows: int
    ) -> None:
        """Open the session in a kept idle process, else in a new one, and run a `warmup_rows` probe batch.

        Raises:
            ModelLoadError: ONNX Runtime could not open the graph, or no process could start.
        """
        self._pool = pool
        self._graph = path.name
        self._lock = threading.Lock()
        self._host: EngineHost | None = pool.take()
        try:
            self._host.channel.send("open", (str(path), inputs, threads, warmup_rows))
            tag, body = self._host.channel.receive(copy=True)
        except (EOFError, OSError):
            raise ModelLoadError(self._host.gone(self._graph)) from None
        if tag != "ready":
            pool.give_back(self._host)
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
            self._pool.give_back(host)
