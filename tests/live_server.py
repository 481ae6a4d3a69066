"""A real layerserve server on 127.0.0.1, in a thread of the test process."""

from __future__ import annotations

import asyncio
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvloop

from layerserve.server import Server
from layerserve.settings import Settings
from soak_server import descendants  # benchmarks/, on the tests' path


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class LiveServer:
    """A started server: its base URL, and how to stop it."""

    url: str
    server: Server
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop
    grpc_port: int = 0

    @property
    def grpc_target(self) -> str:
        """`127.0.0.1:GRPC_PORT`, the gRPC door (started by the app's lifespan when `grpc=True`)."""
        assert self.grpc_port, "this server was started without its gRPC door (start_server(..., grpc=True))"
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def host_port(self) -> str:
        """`127.0.0.1:PORT`, as tritonclient wants it."""
        return self.url.split("://", 1)[1]

    def stop(self) -> None:
        """Ask the server to stop and wait for its thread."""
        self.loop.call_soon_threadsafe(self.server.request_exit)
        self.thread.join(timeout=30)


def start_server(
    settings: Settings, ready_timeout_s: float = 180, grpc: bool = False, verify: ssl.SSLContext | None = None
) -> LiveServer:
    """Start a Server(settings) with its doors on a thread of its own and return once /v2/health/ready answers 200.

    With `grpc`, the gRPC door listens on a free port too; without, it is off (never the default 8001). A server
    with TLS settings is polled over https, trusting `verify`.
    """
    port, grpc_port = free_port(), free_port() if grpc else 0
    settings = settings.model_copy(update={"host": "127.0.0.1", "port": port, "grpc_port": grpc_port})
    server = Server(settings)
    loop = uvloop.new_event_loop()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.serve())

    thread = threading.Thread(target=serve, name=f"server-{port}", daemon=True)
    thread.start()
    scheme = "https" if settings.tls_cert_file else "http"
    live = LiveServer(f"{scheme}://127.0.0.1:{port}", server, thread, loop, grpc_port)
    deadline = time.monotonic() + ready_timeout_s
    # A bounded wait on the real readiness endpoint: the server is a black box from here.
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{live.url}/v2/health/ready", timeout=5, verify=verify or True).status_code == 200:
                return live
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    live.stop()
    raise TimeoutError(f"server on port {port} not ready after {ready_timeout_s} s")


def executions(url: str, model: str) -> int:
    """Model calls (batches) a served model's versions have made, from its statistics."""
    stats = httpx.get(f"{url}/v2/models/{model}/stats").json()["model_stats"]
    return sum(int(version["execution_count"]) for version in stats)


def start_server_process(repository: Path, cache: Path, port: int, *flags: str) -> subprocess.Popen[bytes]:
    """`layerserve serve` in a subprocess, logging to `server.log` beside the repository (gRPC off unless `flags`
    give a `--grpc-port`)."""
    command = [sys.executable, "-m", "layerserve", "serve", str(repository), "--port", str(port), "--grpc-port", "0"]
    command += ["--engine-cache-dir", str(cache), "--log-level", "warning", "--log-file", str(server_log(repository))]
    return subprocess.Popen([*command, *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def server_log(repository: Path) -> Path:
    """Where `start_server_process` logs."""
    return repository.parent / "server.log"


def wait_process_ready(
    url: str, process: subprocess.Popen[bytes], log: Path, timeout_s: float = 240, verify: ssl.SSLContext | bool = True
) -> list[int]:
    """Poll until ready (an https `url` trusting `verify`); the liveness answers seen while it was not ready (status
    codes)."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout_s
    with httpx.Client(verify=verify, timeout=5) as client:
        while time.monotonic() < deadline:
            assert process.poll() is None, log.read_text() if log.exists() else "no log"
            try:
                if client.get(f"{url}/v2/health/ready").status_code == 200:
                    return seen
                seen.append(client.get(f"{url}/v2/health/live").status_code)
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    raise AssertionError("the server did not become ready")


def metric_sample(url: str, name: str, headers: dict[str, str] | None = None, **labels: str) -> float:
    """The value of one sample of the server's /metrics (the sum of the samples with these labels; 0 if none)."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def is_running(pid: int) -> bool:
    """Whether a process with this id exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
    """Poll a server state (a black box from here) until `check` holds; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def preparer_children(pid: int) -> list[int]:
    """The live preparer child processes (`python -m layerserve.lifecycle.preparer_child`) below process `pid`."""
    found = []
    for child in descendants(pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"layerserve.lifecycle.preparer_child" in command and is_running(child):
            found.append(child)
    return found


def maps_tensorflow(pid: int) -> bool:
    """Whether the process has TensorFlow's library mapped (it imported TensorFlow)."""
    return "libtensorflow" in Path(f"/proc/{pid}/maps").read_text()


@dataclass
class Replica:
    """A Ray Serve replica's server, hosted in this process as Ray Serve hosts it: its app under uvicorn (which runs
    its lifespan), on its loop; its direct port."""

    server: Server
    url: str
    direct_url: str
    loop: asyncio.AbstractEventLoop
    stop: Callable[[], None]


def start_replica(settings: Settings) -> Replica:
    """A replica of `settings` (as `build_replica` makes it) on a thread, once its models are loaded."""
    import uvicorn

    from layerserve.transports.ray.replica import build_replica

    direct_port, ingress_port = free_port(), free_port()
    settings = settings.model_copy(update={"grpc_port": 0})
    server, _ = build_replica(settings.model_dump_json(), identity="node/replica", direct_port=direct_port)
    hosted = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=ingress_port, log_level="warning",
                                           lifespan="on", log_config=None))  # fmt: skip
    loops: list[asyncio.AbstractEventLoop] = []
    started = threading.Event()

    async def serve() -> None:
        loops.append(asyncio.get_running_loop())
        started.set()
        await hosted.serve()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    started.wait(30)
    wait_until(lambda: hosted.started, "the replica has started (its models loaded)", 180)

    def stop() -> None:
        hosted.should_exit = True
        thread.join(60)

    return Replica(server, f"http://127.0.0.1:{ingress_port}", f"http://127.0.0.1:{direct_port}", loops[0], stop)
