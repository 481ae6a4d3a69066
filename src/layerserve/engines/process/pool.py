"""EngineProcessPool: the engine processes of one server: started, kept idle for the next version, stopped.

Opening, warming up and freeing a session costs the process that does it. ORT's destructor runs under
the GIL and takes 2-6 ms for EfficientNet-lite0 (it frees the arena and thousands of small blocks, and
joins the session's threads), and the warm-up keeps both cores busy. In the server process, each reload
of a big model stalled the event loop that answers every other model. Here a session is opened, warmed
up and freed in its own process; the server hands each batch over through shared memory and waits with
the GIL released. The processes are forked from multiprocessing's fork server, which has imported ONNX
Runtime once, and a process whose session was closed is kept for the next one (up to `kept_idle`): a
reload then opens a session in a process that already runs, rather than forking one and tearing another
down. Where the process may raise its priority back (CAP_SYS_NICE, or a RLIMIT_NICE that allows it), it
opens, warms up and frees sessions, and hashes big model files, at the lowest priority, and serves at the
normal one, so that a reload takes only idle CPU from the models that serve meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
from pathlib import Path

from layerserve.engines.process.channel import Channel
from layerserve.errors import ModelLoadError
from layerserve.lifecycle.model import file_digest

log = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 10.0


class EngineHost:
    """A process that opens one session at a time and runs batches on it."""

    def __init__(self, pool: EngineProcessPool) -> None:
        self._pool = pool
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["onnxruntime", "layerserve.engines.process.child"])
        connection, theirs = context.Pipe()
        self.channel = Channel(connection)
        from layerserve.engines.process.child import serve

        self.process = context.Process(target=serve, args=(theirs,), name="layerserve-engine", daemon=True)
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
        cpu_seconds = 0.0
        with contextlib.suppress(EOFError, OSError):
            self.channel.send("stop")
            if self.channel.connection.poll(_STOP_TIMEOUT_S):
                tag, body = self.channel.receive(copy=True)
                if tag == "stopped":
                    cpu_seconds = float(body)
        self.channel.connection.close()
        self.process.join(_STOP_TIMEOUT_S)
        if self.process.is_alive():
            log.warning("engine process %d did not stop; killing it", self.process.pid)
            self.process.kill()
            self.process.join(_STOP_TIMEOUT_S)
        self._pool.forget(self, cpu_seconds)

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


class EngineProcessPool:
    """The engine processes of one server: graphs of at least `min_bytes` get a session in one of them; up to
    `kept_idle` processes without a session (~11 MB of private memory each) are kept for the next versions."""

    def __init__(self, min_bytes: int, kept_idle: int = 2) -> None:
        self.min_bytes = min_bytes
        self.kept_idle = kept_idle
        self._lock = threading.Lock()
        self._idle: list[EngineHost] = []
        self._live: set[EngineHost] = set()
        self._stopped_cpu_seconds = 0.0

    def takes(self, path: Path) -> bool:
        """Whether a file this large gets an engine process."""
        return path.is_file() and path.stat().st_size >= self.min_bytes

    def take(self) -> EngineHost:
        """A kept idle process, else a new one.

        Raises:
            ModelLoadError: the process could not start.
        """
        with self._lock:
            while self._idle:
                host = self._idle.pop()
                if host.process.is_alive():
                    return host
                self._live.discard(host)
        try:
            host = EngineHost(self)
        except OSError as error:
            raise ModelLoadError(f"could not start an engine process: {error}") from None
        with self._lock:
            self._live.add(host)
        return host

    def give_back(self, host: EngineHost) -> None:
        """Free the host's session; keep it idle for the next engine, or stop it if enough are kept."""
        if host.release():
            self.keep_or_stop(host)

    def keep_or_stop(self, host: EngineHost) -> None:
        """Keep a host without a session idle for the next engine, or stop it if enough are kept."""
        with self._lock:
            if len(self._idle) < self.kept_idle:
                self._idle.append(host)
                return
        host.stop()

    def forget(self, host: EngineHost, cpu_seconds: float) -> None:
        """A host stopped: its CPU time stays counted."""
        with self._lock:
            self._live.discard(host)
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
        host = self.take()
        try:
            host.channel.send("digest", str(path))
            tag, body = host.channel.receive(copy=True)
        except (EOFError, OSError):
            raise ModelLoadError(host.gone(path.name)) from None
        self.keep_or_stop(host)
        if tag != "digest":
            raise ModelLoadError(f"could not read {path}: {body}")
        digest: str = body
        return digest

    def stop_idle(self) -> None:
        """Stop the kept idle processes (at shutdown, and in tests)."""
        with self._lock:
            idle = list(self._idle)
            self._idle.clear()
        for host in idle:
            host.stop()

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
        ticks, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
        for host in hosts:
            with contextlib.suppress(OSError, ValueError, IndexError, TypeError):
                fields = Path(f"/proc/{host.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
                cpu_seconds += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
                resident += int(Path(f"/proc/{host.process.pid}/statm").read_text().split()[1]) * page
        return cpu_seconds, resident
