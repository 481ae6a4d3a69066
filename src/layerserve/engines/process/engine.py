"""ProcessOnnxEngine: an ONNX Runtime session in an engine process; `run` sends the batch there and waits, and
`run_async` does the same from the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from layerserve.engines.base import EngineKind
from layerserve.engines.process.channel import Channel, Message
from layerserve.engines.process.pool import EngineHost, EngineProcessPool
from layerserve.errors import EngineProcessError, ModelLoadError
from layerserve.tensors import Array, TensorSpec

_RELEASE_TIMEOUT_S = 10.0


@dataclass
class Lane:
    """A connection to the session, with a thread of its own in the engine process; busy while a call holds it."""

    channel: Channel
    busy: bool = False


class ProcessOnnxEngine:
    """An ONNX Runtime session in an engine process (shared with other sessions, each on connections of its
    own); `run` sends the batch there and waits. Up to `lanes` batches (the pool's) run there at once."""

    name = EngineKind.ONNX
    in_process = False

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
            channels = host.open_session(path, inputs, threads, warmup_rows, pool.lanes)
        except (EOFError, OSError):
            pool.session_closed(host)
            raise ModelLoadError(host.gone(self._graph)) from None
        channel = channels[0]
        try:
            tag, body = channel.receive(copy=True)
        except (EOFError, OSError):
            tag, body = "gone", None
        if tag != "ready":
            for each in channels:
                each.connection.close()
            pool.session_closed(host)
            if tag == "gone":
                raise ModelLoadError(host.gone(self._graph)) from None
            raise ModelLoadError(f"ONNX Runtime could not open {path.name}: {body}")
        self._host: EngineHost | None = host
        # Each lane a connection to the session with a thread of its own in the process: its batches run at the
        # same time as the other lanes' (ONNX Runtime's `run` may be called from several threads at once).
        self._lanes = [Lane(each) for each in channels]
        self._lane_freed = threading.Condition()
        self.lanes = len(channels)
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
        """Compute the outputs for one batch, in the engine's process (on a free lane, else the first to free).

        Raises:
            EngineProcessError: the process is gone (killed, out of memory, crashed), or the engine closed.
            RuntimeError: ONNX Runtime refused the batch (its message).
        """
        lane = self._take_lane(wait=True)
        assert lane is not None
        try:
            host = self._host
            if host is None:
                raise EngineProcessError(f"the engine of {self._graph} is closed")
            try:
                lane.channel.send_arrays(inputs)
                received = lane.channel.receive(copy=True)
            except (EOFError, OSError):
                raise EngineProcessError(host.gone(self._graph)) from None
        finally:
            self._give_back(lane)
        return _outputs(received)

    async def run_async(self, inputs: list[Array]) -> list[Array]:
        """`run` from the event loop: the batch is sent from the loop on a free lane and its answer wakes the loop,
        instead of two more hops through a model thread. While every lane is busy, `run` on the loop's executor.

        The answer is read even when the caller is cancelled, so the next call gets its own.

        Raises:
            EngineProcessError, RuntimeError: as `run`.
        """
        loop = asyncio.get_running_loop()
        lane = self._take_lane(wait=False)
        if lane is None:
            return await loop.run_in_executor(None, self.run, inputs)
        channel = lane.channel
        host = self._host
        try:
            if host is None:
                raise EngineProcessError(f"the engine of {self._graph} is closed")
            channel.send_arrays(inputs)
        except (EOFError, OSError):
            self._give_back(lane)
            raise EngineProcessError(host.gone(self._graph)) from None  # type: ignore[union-attr]
        except BaseException:
            self._give_back(lane)
            raise
        answer: asyncio.Future[Message | None] = loop.create_future()
        fd = channel.connection.fileno()

        def readable() -> None:
            loop.remove_reader(fd)
            received: Message | None = None
            try:
                os.set_blocking(fd, True)  # uvloop's add_reader makes the socket non-blocking; `receive` blocks
                received = channel.receive(copy=True)
            except (EOFError, OSError):
                pass  # the process is gone: None
            finally:
                self._give_back(lane)
            if not answer.done():
                answer.set_result(received)

        loop.add_reader(fd, readable)
        received = await answer
        if received is None:
            raise EngineProcessError(host.gone(self._graph))
        return _outputs(received)

    def _take_lane(self, wait: bool) -> Lane | None:
        """A lane no call holds, now held for the caller: with `wait`, the first to free when every lane is busy;
        without, None then."""
        with self._lane_freed:
            while True:
                lane = next((lane for lane in self._lanes if not lane.busy), None)
                if lane is not None:
                    lane.busy = True
                    return lane
                if not wait:
                    return None
                self._lane_freed.wait()

    def _give_back(self, lane: Lane) -> None:
        """The caller is done with `lane`: the next caller may take it."""
        with self._lane_freed:
            lane.busy = False
            self._lane_freed.notify_all()  # a blocking call waits for any lane, close() for each

    def close(self) -> None:
        """Free the session in its process (after the batch it runs); a process left without sessions is kept
        for the next one or stopped, and a stopped process returns all its memory."""
        host, self._host = self._host, None  # a call from now on is refused as closed, on whichever lane
        if host is None:
            return
        # Each lane's batch ends first. Bounded: a call sent from an event loop that stopped before its answer came
        # would hold its lane forever.
        deadline = time.monotonic() + _RELEASE_TIMEOUT_S
        held = []
        with self._lane_freed:
            for lane in self._lanes:
                while lane.busy and (left := deadline - time.monotonic()) > 0:
                    self._lane_freed.wait(left)
                held.append(not lane.busy)
                lane.busy = True
        first = self._lanes[0].channel
        try:
            for lane in self._lanes[1:]:
                lane.channel.connection.close()  # their threads in the process end; the first lane's waits for them
            if held[0]:  # else the process frees the session when it sees the connection close
                with contextlib.suppress(EOFError, OSError):
                    first.send("release")
                    if first.connection.poll(_RELEASE_TIMEOUT_S):
                        first.receive(copy=True)
            first.connection.close()
        finally:
            for lane, got in zip(self._lanes, held, strict=True):
                if got:
                    self._give_back(lane)
        host.session_bytes -= self.session_bytes
        self._pool.session_closed(host)


def _outputs(received: Message) -> list[Array]:
    """A call's outputs from the engine process's answer.

    Raises:
        RuntimeError: ONNX Runtime refused the batch (its message).
    """
    tag, body = received
    if tag == "error":
        raise RuntimeError(body)
    results: list[Array] = body
    return results
