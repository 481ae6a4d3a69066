"""EngineProcessPool: the engine processes of one server: started, shared by the sessions of several versions,
kept idle for the next ones, stopped.

Opening, warming up and freeing a session costs the process that does it. ORT's destructor runs under
the GIL and takes 2-6 ms for EfficientNet-lite0 (it frees the arena and thousands of small blocks, and
joins the session's threads), and the warm-up keeps both cores busy. In the server process, each reload
of a big model stalled the event loop that answers every other model. Here a session is opened, warmed
up and freed in an engine process; the server hands each batch over through shared memory and waits with
the GIL released. Each process is a fresh interpreter that runs only layerserve's engine module (`python -m
layerserve.engines.process.child`, see ChildProcess), never the script that started the server. A process holds
the sessions of up to all the big models (each served by a thread of its own over a connection of its own, so that
they compute side by side): what ONNX Runtime and Python cost a process (~70 MB) is paid once per process, not
once per model; `max_processes` processes at most (0: one per session), each new
session in the process with the fewest. A process without sessions is kept for the next one (up to `kept_idle`):
a reload then opens a session in a process that already runs, rather than starting one and tearing another
down. Where the process may raise its priority back (CAP_SYS_NICE, or a RLIMIT_NICE that allows it), it
opens, warms up and frees sessions, and hashes big model files, at the lowest priority, and serves at the
normal one, so that a reload takes only idle CPU from the models that serve meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from multiprocessing import reduction
from multiprocessing.connection import Pipe
from pathlib import Path

from layerserve.child_process import ChildProcess
from layerserve.engines.process.channel import Channel
from layerserve.engines.process.usage import process_usage
from layerserve.errors import ModelLoadError
from layerserve.lifecycle.model import file_digest
from layerserve.settings import Settings
from layerserve.tensors import TensorSpec

log = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 10.0


class EngineHost:
    """A process that holds sessions (see the module): its control channel opens them and hashes files."""

    def __init__(self, pool: EngineProcessPool) -> None:
        self._pool = pool
        self.sessions = 0  # counted by the pool
        self.session_bytes = 0  # what opening its sessions added to its memory, counted by their engines
        self._lock = threading.Lock()  # one exchange at a time on the control channel
        self._stopped = False
        self.process = ChildProcess("layerserve.engines.process.child")
        self.channel = Channel(self.process.connection)

    def open_session(
        self, path: Path, inputs: tuple[TensorSpec, ...], threads: int, rows: int, lanes: int = 1
    ) -> list[Channel]:
        """A session's own channels, `lanes` of them, each answering batches at the same time as the others (the
        first's first message answers the open: ready or error).

        Raises:
            EOFError, OSError: the process is gone.
        """
        pairs = [Pipe() for _ in range(lanes)]
        try:
            with self._lock:
                self.channel.send("open", (str(path), inputs, threads, rows, lanes))
                for _, theirs in pairs:
                    reduction.send_handle(self.channel.connection, theirs.fileno(), self.process.pid)
        except BaseException:
            for ours, _ in pairs:
                ours.close()
            raise
        finally:
            for _, theirs in pairs:
                theirs.close()
        return [Channel(ours) for ours, _ in pairs]

    def digest(self, path: Path) -> tuple[str, str]:
        """(tag, body) of hashing the file in the process: ("digest", hex) or ("error", message).

        Raises:
            EOFError, OSError: the process is gone.
        """
        with self._lock:
            self.channel.send("digest", str(path))
            tag, body = self.channel.receive(copy=True)
        return str(tag), str(body)

    def stop(self) -> None:
        """End the process (its memory goes back to the system with it); once."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            cpu_seconds = 0.0
            with contextlib.suppress(EOFError, OSError):
                self.channel.send("stop")
                if self.channel.connection.poll(_STOP_TIMEOUT_S):
                    tag, body = self.channel.receive(copy=True)
                    if tag == "stopped":
                        cpu_seconds = float(body)
            self.channel.connection.close()
        if self.process.wait(_STOP_TIMEOUT_S) is None:
            log.warning("engine process %d did not stop; killing it", self.process.pid)
            self.process.kill()
            self.process.wait(_STOP_TIMEOUT_S)
        self._pool.forget(self, cpu_seconds)

    def gone(self, graph: str) -> str:
        """Why the process stopped answering (it is reaped here), for the version's FAILED reason."""
        code = self.process.wait(1.0)
        if code is None:
            how = "stopped answering"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with status {code}"
        self.stop()
        return f"the engine process of {graph} {how}; load the model again to start a new one"

    def resident_bytes(self) -> int:
        """The process's resident memory (0 once it is gone)."""
        return process_usage(self.process.pid)[1]


class EngineProcessPool:
    """The engine processes of one server: graphs of at least `min_bytes` get a session in one of them, at most
    `max_processes` processes (0: one per session); up to `kept_idle` processes without a session are kept, with
    their arena, for the next versions."""

    def __init__(self, min_bytes: int, kept_idle: int = 2, max_processes: int = 0, lanes: int = 1) -> None:
        self.min_bytes = min_bytes
        self.lanes = lanes  # batches each session computes at once (see ProcessOnnxEngine)
        self.kept_idle = kept_idle
        self.max_processes = max_processes
        self._lock = threading.Lock()
        self._idle: list[EngineHost] = []
        self._live: set[EngineHost] = set()
        self._stopped_cpu_seconds = 0.0

    @classmethod
    def from_settings(cls, settings: Settings) -> EngineProcessPool:
        """The pool that `engine_process_min_mb`, `engine_processes` and `engine_lanes` describe."""
        return cls(
            int(settings.engine_process_min_mb * 1_000_000),
            max_processes=settings.engine_processes,
            lanes=settings.engine_lanes,
        )

    def takes(self, path: Path) -> bool:
        """Whether a file this large gets an engine process."""
        return path.is_file() and path.stat().st_size >= self.min_bytes

    def take(self) -> EngineHost:
        """The process for a new session (counted in it until `session_closed`): a kept idle one, else a new one
        while there are fewer than `max_processes`, else the one with the fewest sessions.

        Raises:
            ModelLoadError: the process could not start.
        """
        return self._host(opening=True)

    def _host(self, opening: bool) -> EngineHost:
        """A kept idle process, else (for a session) a new one while there are fewer than `max_processes`, else
        the running one with the fewest sessions; a session opening is counted in it before the lock is let go."""
        with self._lock:
            while self._idle:
                host = self._idle.pop()
                if host.process.is_alive():
                    host.sessions += opening
                    return host
                self._live.discard(host)
            running = [h for h in self._live if h.process.is_alive()]
            if running and (not opening or (self.max_processes and len(running) >= self.max_processes)):
                host = min(running, key=lambda h: h.sessions)
                host.sessions += opening
                return host
        try:
            host = EngineHost(self)
        except OSError as error:
            raise ModelLoadError(f"could not start an engine process: {error}") from None
        with self._lock:
            host.sessions += opening
            self._live.add(host)
        return host

    def session_closed(self, host: EngineHost) -> None:
        """A session of the host was freed (or never opened); a host left without any is kept idle or stopped."""
        with self._lock:
            host.sessions -= 1
        self.keep_or_stop(host)

    def keep_or_stop(self, host: EngineHost) -> None:
        """Keep a host without a session idle for the next engine, or stop it if enough are kept."""
        with self._lock:
            if host.sessions > 0 or host in self._idle:
                return
            if len(self._idle) < self.kept_idle and host.process.is_alive():
                self._idle.append(host)
                return
        host.stop()

    def forget(self, host: EngineHost, cpu_seconds: float) -> None:
        """A host stopped: its CPU time stays counted."""
        with self._lock:
            self._live.discard(host)
            if host in self._idle:
                self._idle.remove(host)
            self._stopped_cpu_seconds += cpu_seconds

    def digest(self, path: Path) -> str:
        """`file_digest(path)`: for a file this pool takes, computed in an engine process at the lowest priority
        (hashing 19 MB takes a core for ~15 ms, beside the serving threads and their GIL).

        Raises:
            OSError: the file cannot be read (hashed here).
            ModelLoadError: the file cannot be read, or the process died (hashed in an engine process).
        """
        if not self.takes(path):
            return file_digest(path)
        host = self._host(opening=False)
        try:
            tag, body = host.digest(path)
        except (EOFError, OSError):
            raise ModelLoadError(host.gone(path.name)) from None
        self.keep_or_stop(host)
        if tag != "digest":
            raise ModelLoadError(f"could not read {path}: {body}")
        return body

    def stop_idle(self) -> None:
        """Stop the kept idle processes (at shutdown, and in tests)."""
        with self._lock:
            idle = list(self._idle)
            self._idle.clear()
        for host in idle:
            host.stop()

    def idle_bytes(self) -> int:
        """Resident memory of the processes kept without a session."""
        with self._lock:
            idle = list(self._idle)
        return sum(host.resident_bytes() for host in idle)

    @property
    def idle_count(self) -> int:
        """Processes kept without a session."""
        with self._lock:
            return len(self._idle)

    def usage(self) -> tuple[float, int]:
        """CPU seconds (the stopped processes' included) and resident bytes of the engine processes."""
        with self._lock:
            cpu_seconds, hosts = self._stopped_cpu_seconds, list(self._live)
        resident = 0
        for host in hosts:
            cpu, rss = process_usage(host.process.pid)
            cpu_seconds += cpu
            resident += rss
        return cpu_seconds, resident

    @property
    def process_count(self) -> int:
        """Engine processes running now (with sessions or kept idle)."""
        with self._lock:
            return len(self._live)
