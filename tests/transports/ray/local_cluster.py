"""A Ray cluster of several nodes on this machine, each started with `ray start` as a user starts one (no variable
of ours in its environment), in a session of its own: removing a node kills its processes and only those."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_RAY = str(Path(sys.executable).with_name("ray"))
_OURS = ("LAYERSERVE_", "RAY_SERVE_")  # a user's shell has none of them


@dataclass(frozen=True)
class LocalNode:
    """One node: the process group of its `ray start` (its raylet, agents and, on the head, the GCS)."""

    group: int


def _free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports nobody listens on right now (held open together, so that none comes twice)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _processes() -> dict[int, tuple[int, int]]:
    """Every live process of this machine (no zombie): pid -> (parent pid, process group)."""
    found = {}
    for folder in Path("/proc").iterdir():
        if not folder.name.isdigit():
            continue
        try:
            fields = (folder / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            found[int(folder.name)] = (int(fields[1]), int(fields[2]))
    return found


def _command(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _title(pid: int) -> bytes:
    """A Ray worker's actor, from its process title (`ray::Class` or `ray::Class.method` while it runs one)."""
    return _command(pid).split(b"\0")[0].split(b" ")[0].split(b".")[0]


class LocalCluster:
    """A head and nodes started with `ray start`, each with ports and a temp folder of its own."""

    def __init__(self) -> None:
        self._temp = tempfile.TemporaryDirectory(prefix="ray-cluster-", ignore_cleanup_errors=True)
        self.address = ""
        self.nodes: list[LocalNode] = []
        self._started = 0

    @property
    def environment(self) -> dict[str, str]:
        """The environment of its nodes, and of a driver that connects to it: a user's shell (no variable of ours),
        and Ray's token authentication off. Any local `ray.init()` (another test's) leaves a token in ~/.ray, with
        which `ray start --head` turns authentication on, and then `ray start --address` is refused."""
        environment = {key: value for key, value in os.environ.items() if not key.startswith(_OURS)}
        return {**environment, "RAY_AUTH_MODE": "disabled"}

    def add_node(self, num_cpus: int) -> LocalNode:
        """Start a node (the first is the head) and return once `ray start` has; the head's GCS address is kept."""
        head, self._started = not self.nodes, self._started + 1
        ports = iter(_free_ports(10))
        command = [
            _RAY, "start", f"--num-cpus={num_cpus}", "--node-ip-address=127.0.0.1", "--disable-usage-stats",
            f"--temp-dir={self._temp.name}/node{self._started}", f"--node-manager-port={next(ports)}",
            f"--object-manager-port={next(ports)}", "--min-worker-port=0", "--max-worker-port=0",
            f"--dashboard-agent-listen-port={next(ports)}", f"--dashboard-agent-grpc-port={next(ports)}",
            f"--runtime-env-agent-port={next(ports)}", f"--metrics-export-port={next(ports)}",
            "--object-store-memory=150000000",
        ]  # fmt: skip
        if head:
            gcs = next(ports)
            self.address = f"127.0.0.1:{gcs}"
            command += ["--head", f"--port={gcs}", "--include-dashboard=false",
                        f"--ray-client-server-port={next(ports)}", f"--dashboard-port={next(ports)}"]  # fmt: skip
        else:
            command.append(f"--address={self.address}")
        starter = subprocess.Popen(command, env=self.environment, start_new_session=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)  # fmt: skip
        output, _ = starter.communicate(timeout=120)
        node = LocalNode(starter.pid)
        self.nodes.append(node)  # its processes are killed at shutdown even if it failed to start
        assert starter.returncode == 0, output[-3000:]
        return node

    def running(self, actor: bytes) -> list[LocalNode]:
        """The nodes whose raylet started a worker that runs `actor` (its process title before any `.method`, e.g.
        b"ray::ProxyActor")."""
        processes = _processes()
        groups = {processes.get(parent, (0, 0))[1] for pid, (parent, _) in processes.items() if _title(pid) == actor}
        return [node for node in self.nodes if node.group in groups]

    def remove(self, node: LocalNode) -> set[int]:
        """Kill the node at once, as a machine that vanishes: its processes, the workers its raylet started and
        theirs; their pids."""
        processes = _processes()
        doomed = {pid for pid, (_, group) in processes.items() if group == node.group}
        while more := {pid for pid, (parent, _) in processes.items() if parent in doomed} - doomed:
            doomed |= more
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.nodes.remove(node)
        return doomed

    def shutdown(self) -> None:
        """Remove every node, the head last, and wait until their processes are gone.

        Raises:
            AssertionError: some outlived SIGKILL for 30 s.
        """
        doomed = set[int]()
        for node in [*self.nodes[1:], *self.nodes[:1]]:
            doomed |= self.remove(node)
        deadline = time.monotonic() + 30
        while (left := doomed & set(_processes())) and time.monotonic() < deadline:
            time.sleep(0.2)
        self._temp.cleanup()
        assert not left, f"processes of the cluster outlived it: {sorted(left)}"
