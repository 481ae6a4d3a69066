"""Shared by the benchmark scripts: the demo repository served by `layerserve serve` in a subprocess."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from corpora import package_dir
from layerserve.demo import build_demo_repository


@contextmanager
def demo_server(
    port: int, repository: Path | None = None, *flags: str, source: Path | None = None
) -> Iterator[tuple[str, Path]]:
    """Build the demo repository (unless one is given), serve it with `flags`, yield (url, repository); `source`: the
    `src` folder of another checkout of layerserve to serve it with (first on PYTHONPATH)."""
    work = Path(tempfile.mkdtemp(prefix="layerserve-bench-"))
    if repository is None:
        repository = work / "repo"
        build_demo_repository(repository)
    command = [sys.executable, "-m", "layerserve", "serve", str(repository), "--port", str(port)]
    command += ["--engine-cache-dir", str(work / "cache"), "--log-level", "warning", *flags]
    environment = None if source is None else {**os.environ, "PYTHONPATH": str(source)}
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL, env=environment)
    url = f"{'https' if '--tls-cert-file' in flags else 'http'}://127.0.0.1:{port}"  # https: trusted by SSL_CERT_FILE
    try:
        wait_ready(url)
        yield url, repository
    finally:
        process.terminate()
        process.wait(timeout=30)


def wait_ready(url: str, attempts: int = 3000) -> None:
    """Poll the server's readiness (a black box here) until it answers 200, or give up after `attempts` tries."""
    for _ in range(attempts):
        try:
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.1)


def server_pid(port: int) -> int:
    """The `layerserve serve` process listening on `port`."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            words = cmdline.read_bytes().split(b"\0")
            if b"serve" in words and str(port).encode() in words:
                return int(cmdline.parent.name)
    raise RuntimeError(f"no server on port {port}")


def sample_jpeg(target: Path) -> Path:
    """scikit-image's chelsea.png (451x300) written as a quality-90 JPEG."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.open(package_dir("skimage") / "data" / "chelsea.png").convert("RGB").save(buffer, "JPEG", quality=90)
    target.write_bytes(buffer.getvalue())
    return target
