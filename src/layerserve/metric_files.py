"""The Prometheus text of every worker's metric files (`PROMETHEUS_MULTIPROC_DIR`), made in a process of its own.

With hundreds of models the files hold tens of thousands of series, and making their text takes a core for about a
second and some 90 MB of short-lived Python objects. Made in the worker that answers /metrics, those objects were
freed among the objects its requests made meanwhile, and the worker kept most of that memory for good, which the
memory budget then counted against its models (docs/many-models.md). A child that makes the text and exits gives
all of it back. It imports prometheus_client only: importing layerserve.metrics would add files of its own.

    python -m layerserve.metric_files   (writes the text to stdout)
"""

from __future__ import annotations

import subprocess
import sys

_TIMEOUT_S = 60.0


def exposition_of_files() -> bytes:
    """The text of every worker's metric files, made by a child process.

    Raises:
        RuntimeError: the child failed (its error output in the message), or took longer than a minute.
    """
    try:
        done = subprocess.run(
            [sys.executable, "-m", __name__],
            check=False,
            capture_output=True,
            stdin=subprocess.DEVNULL,
            timeout=_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"making the metrics text took over {_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        raise RuntimeError(f"making the metrics text failed: {done.stderr.decode(errors='replace')[-2000:]}")
    return done.stdout


def exposition_here() -> bytes:
    """The text of every worker's metric files, made in this process (the child's work; the fallback when it fails)."""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    return generate_latest(registry)


def main() -> None:
    """Write the files' text to stdout."""
    sys.stdout.buffer.write(exposition_here())


if __name__ == "__main__":
    main()
