"""The soak's processes: its own redis-server, and the resident memory of every server process (from /proc)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

# The processes that serve, whose memory must stay flat. The preparer (loading and exporting model files)
# and training jobs hold what their current task needs, and stop when they have none: reported, not limited.
SERVING_ROLES = ("supervisor", "server", "worker", "fork server", "engine process", "resource tracker")


@dataclass
class ProcessMemory:
    """One server process's resident memory over the run."""

    pid: int
    role: str
    first_mb: float
    last_mb: float
    peak_mb: float
    baseline_mb: float | None = None  # first sample at or after the warm-up, if alive then
    alive_at_end: bool = True
    samples: list[tuple[float, float]] = field(default_factory=list)  # (seconds into the load, MB)

    @property
    def growth_mb(self) -> float | None:
        """Last sample minus the baseline (None for a process born after the warm-up)."""
        return None if self.baseline_mb is None else self.last_mb - self.baseline_mb


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisProcess:
    """A `redis-server` of the soak's own on one port, killed (SIGKILL) and restarted on that port."""

    def __init__(self) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed (Debian package redis-server)")
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it and wait until it accepts connections."""
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def kill(self) -> None:
        """Kill it: an outage, not a shutdown."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc/<pid>/task/*/children."""
    found: list[int] = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(child) for child in children.read_text().split()]
        except OSError:
            continue
    return found + [grandchild for child in found for grandchild in descendants(child)]


def rss_mb(pid: int) -> float | None:
    """VmRSS of a process in MB, None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def role_of(pid: int, supervisor: int, workers: bool = True) -> str:
    """What a server process is: supervisor, worker, engine process, preparer, training job, ...; without
    `workers` the top process is the one server. (Before they were started as `python -m layerserve...`, uvicorn
    spawned the workers, a fork server forked the engine processes and the preparer was spawned.)"""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return "gone"
    if pid == supervisor:
        return "supervisor" if workers else "server"
    if "layerserve.training.train_job" in command:
        return "training job"
    if "resource_tracker" in command:
        return "resource tracker"
    if "layerserve.engines.process.child" in command:
        return "engine process"
    if "layerserve.lifecycle.preparer_child" in command:
        return "preparer"
    if "layerserve.workers" in command:
        return "worker"
    if "forkserver" in command:
        return "engine process" if role_of(parent, supervisor, workers) == "fork server" else "fork server"
    if "spawn_main" in command:
        return "worker" if parent == supervisor and workers else "preparer"
    return command[:60]


class MemorySampler:
    """Samples the resident memory of the supervisor and every descendant."""

    def __init__(self, supervisor: int) -> None:
        self.supervisor = supervisor
        self.processes: dict[int, ProcessMemory] = {}
        self._before_warmup: set[int] = set()

    def sample(self, t_s: float, after_warmup: bool) -> None:
        """One sample of every live process; a process's first sample after the warm-up is its baseline."""
        alive = {self.supervisor, *descendants(self.supervisor)}
        for pid in alive:
            mb = rss_mb(pid)
            if mb is None:
                continue
            process = self.processes.get(pid)
            if process is None:
                process = self.processes[pid] = ProcessMemory(pid, role_of(pid, self.supervisor), mb, mb, mb)
                if not after_warmup:
                    self._before_warmup.add(pid)
            elif after_warmup and pid in self._before_warmup and process.baseline_mb is None:
                process.baseline_mb = mb
            process.last_mb, process.peak_mb = mb, max(process.peak_mb, mb)
            process.samples.append((round(t_s, 1), round(mb, 1)))
        for pid, process in self.processes.items():
            process.alive_at_end = pid in alive and rss_mb(pid) is not None
